"""Whether a venv holds what `make setup` installs into it: exit 0, or 1
with one line naming what is missing. setup.sh installs then, so a missing
module is expected on a first run, and it is said, not raised."""
from __future__ import annotations

import importlib.util
import sys
from importlib import metadata

MODULES = ("torch", "numpy", "click", "pyroute2", "scipy", "prometheus_client",
           "pytest", "pytest_timeout", "sklearn", "matplotlib")
TORCH = "2.13.0"        # the CPU build setup.sh installs: an unpinned torch is a multi-GB CUDA one


def missing() -> list[str]:
    out = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if "torch" not in out and not metadata.version("torch").startswith(TORCH):
        out.append(f"torch {TORCH} (it has {metadata.version('torch')})")
    return out


if __name__ == "__main__":
    lack = missing()
    if lack:
        print(f"[setup] the venv lacks {', '.join(lack)}")
    sys.exit(1 if lack else 0)
