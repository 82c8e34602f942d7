# xagg — the two commands a user needs: `make demo` and `make test`.
# Every target sets the machine up first (idempotent: apt, kernel headers, venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup test test-fast gpu-test bench demo clean vm-box vm-test

setup:
	@bash scripts/setup.sh

test: setup
	$(PYTEST) -q -rs --durations=30 $(PYTEST_ARGS)

# The DDP hook's tests and `xagg-client run` training with CUDA models and
# gradients: against the userspace aggregator (any CUDA host), then against
# the XDP program in a lab (root, bcc and kernel headers, as `make test`).
# The venv needs a CUDA build of torch: scripts/cuda_ready.py says which.
# On a GPU image whose own python has CUDA torch (no venv, maybe no network),
# name it instead: `make gpu-test GPU_PY=python3` skips setup and runs there.
GPU_PY ?=
gpu-test: $(if $(GPU_PY),,setup)
	@$(or $(GPU_PY),$(PY)) scripts/cuda_ready.py
	XAGG_TEST_DEVICE=cuda $(or $(GPU_PY),$(PY)) -m pytest -q -rs tests/test_torch_hook.py tests/test_hook_xdp.py \
		tests/test_hook_bf16_xdp.py $(PYTEST_ARGS)

bench: setup
	$(PY) -m xagg.bench $(BENCH_ARGS)

demo: setup
	$(PY) examples/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bench-out .pytest_cache

# Multi-VM test on KVM (docs/vagrant.md): a Debian box built here, then
# 1 aggregator + 3 worker VMs through xaggd's native XDP; everything destroyed after.
vm-box:
	@bash scripts/vm_box.sh

vm-test: vm-box
	@bash scripts/vm_test.sh
