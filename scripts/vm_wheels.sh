#!/usr/bin/env bash
# The Python wheels the VMs install from (they have no way out to an index).
# The host's pip finds torch==2.13.0 (the CPU build) on local disk through its
# config (find-links in /etc/pip.conf, `pip config list` shows it), so
# `pip download` here collects exactly what this host would install: the
# project's dependencies, its plan and test extras and torch 2.13.0 from pyproject.toml, plus pip and
# setuptools for scripts/setup.sh. scripts/vm_box.sh installs them into the
# box's venv. Cached by the list (a new dependency makes a new box).
set -euo pipefail
cd "$(dirname "$0")/.."
XVM_STEP_TAG=vm-wheels
. scripts/vm_common.sh

PY=${PYTHON:-python3}
REQS=$("$PY" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p.get("optional-dependencies", {})      # the test extra names xagg[torch,plan] itself
reqs = p["dependencies"] + [r for k in ("plan", "test") for r in extras.get(k, []) if not r.startswith("xagg[")]
# torch as setup.sh pins it: the torch extra's range would let pip take a newer (CUDA, multi-GB) build
reqs += ["torch==2.13.0", "pip", "setuptools>=77", "wheel"]
print(" ".join(sorted(set(reqs))))
EOF
)
DIR=$XVM_CACHE/wheels
KEY=$(echo "$REQS" | sha256sum | cut -c1-16)
if [ "$(cat "$DIR/stamp" 2>/dev/null)" = "$KEY" ] && [ -f "$DIR/requirements.txt" ]; then
    say "wheels up to date ($(ls "$DIR"/*.whl | wc -l) in $DIR)"
    exit 0
fi
say "downloading wheels for: $REQS"
rm -rf "$DIR.new" && mkdir -p "$DIR.new"
# shellcheck disable=SC2086  # REQS is a list of requirement words
"$PY" -m pip download -q --only-binary=:all: --python-version 3.11 -d "$DIR.new" $REQS 2> >(grep -v "is ignored: it is neither" >&2)
rm -rf "$DIR" && mv "$DIR.new" "$DIR"
echo "$REQS" | tr ' ' '\n' > "$DIR/requirements.txt"
echo "$KEY" > "$DIR/stamp"
say "$(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1), in $DIR"
