"""leave(): a finished rank exits with its own status, its atexit handlers
run and its output flushed, without the interpreter's teardown."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_leave_runs_atexit_flushes_and_keeps_the_status():
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('handler ran', flush=False))\n"
            "print('unflushed', end='')\n"
            "sys.stderr.write('err unflushed')\n"
            "from xagg.torch.leave import leave\n"
            "leave(3)\n"
            "print('after leave')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "unflushedhandler ran\n"
    assert proc.stderr == "err unflushed"
