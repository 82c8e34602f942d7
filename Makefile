# xagg — the two commands a user needs: `make demo` and `make test`.
# Every target sets the machine up first (idempotent: apt, kernel headers, venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup test test-fast bench demo clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PYTEST) -q -rs $(PYTEST_ARGS)

bench: setup
	$(PY) -m xagg.bench $(BENCH_ARGS)

demo: setup
	$(PY) examples/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bench-out .pytest_cache
