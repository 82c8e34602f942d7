"""`make gpu-test`'s probe: the interpreter's torch must see a CUDA device,
and xagg's own needs be there (on a GPU image's python given as GPU_PY),
else say what to install (setup.sh installs the CPU build)."""
import importlib.util
import os
import sys

missing = [m for m in ("torch", "numpy", "click", "pyroute2", "prometheus_client", "xagg", "xaggd")
           if importlib.util.find_spec(m) is None]
if missing or not os.path.exists(os.path.join(os.path.dirname(sys.executable), "xaggd")):
    sys.exit(f"make gpu-test: {sys.executable} lacks {', '.join(missing) or 'the xaggd command'}: install the "
             f"project into it first, keeping its torch:\n  {sys.executable} -m pip install -e . pytest "
             f"pytest-timeout scikit-learn\n(offline: --no-deps -e . and the missing ones as wheels)")

import torch  # noqa: E402  (after the probe: a python without torch is told so above)

if not torch.cuda.is_available():
    sys.exit(f"make gpu-test: torch {torch.__version__} in {sys.executable} sees no CUDA device. On a CUDA "
             f"host, install the CUDA build of the same version there first, e.g.\n"
             f"  {sys.executable} -m pip install 'torch=={torch.__version__.split('+')[0]}' "
             f"--index-url https://download.pytorch.org/whl/cu126\n"
             f"or name a python that has one: make gpu-test GPU_PY=python3")
print(f"gpu-test: torch {torch.__version__}, {torch.cuda.device_count()} CUDA device(s): "
      f"{torch.cuda.get_device_name(0)}")
