"""`make gpu-test`'s probe: the venv's torch must see a CUDA device, else
say what to install (setup.sh installs the CPU build)."""
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"make gpu-test: torch {torch.__version__} in the venv sees no CUDA device. On a CUDA host, "
             f"install the CUDA build of the same version into the venv first, e.g.\n"
             f"  .venv/bin/pip install 'torch=={torch.__version__.split('+')[0]}' "
             f"--index-url https://download.pytorch.org/whl/cu126")
print(f"gpu-test: torch {torch.__version__}, {torch.cuda.device_count()} CUDA device(s): "
      f"{torch.cuda.get_device_name(0)}")
