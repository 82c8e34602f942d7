"""Ending a rank's process once its work is done, without the interpreter's
teardown.

A rank that has finished (its collectives done, its process group destroyed)
can still die at interpreter exit: torch's gloo and store threads are C++
``std::thread``s owned by objects the teardown destroys in no set order, and
one still joinable there calls ``std::terminate`` ("terminate called without
an active exception"), turning a finished run into status -6. Leaving with
``os._exit`` after the atexit handlers (ours, logging's, the script's) and a
flush keeps the status the run earned.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def leave(code: int = 0) -> NoReturn:
    """Run the atexit handlers, flush stdout and stderr, and exit with
    ``code`` without the interpreter's teardown."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
