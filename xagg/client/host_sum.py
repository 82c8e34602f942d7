"""The two steps of a host's ranks summing in shared memory, compiled
(csrc/host_sum.c, through ctypes) where a C compiler is found, in numpy
otherwise (the reference, equal to the bit): the sum of L slices (float32,
or a 16-bit type widened as read) into float32, divided by a count, in one
pass, and a barrier of L processes on counters in a shared mapping that
sleeps on a futex instead of polling.

xagg/torch/local_reduce.py lays out the segment and says what each is for.
"""
from __future__ import annotations

import ctypes
import logging
import time
from functools import lru_cache

import numpy as np

from xagg.client import native
from xagg.client.fixedpoint import ELEMS, widen

log = logging.getLogger("xagg.client")

SOURCES = (native.CSRC / "host_sum.c",)
LIB_PREFIX = "xagg-hostsum-"
LINE_WORDS = 8                  # csrc/host_sum.c: int64 counters per rank, one cache line
POLL_MAX_S = 0.001              # numpy's barrier: the longest sleep between looks at the counters


@lru_cache(maxsize=None)
def load():
    """The compiled helpers, or None (the reason logged once)."""
    cc = native.compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc, clang): a host's ranks sum and wait in numpy, more slowly")
        return None
    try:
        dll = ctypes.CDLL(str(native.build(cc, LIB_PREFIX, SOURCES, ())))
    except OSError as e:
        log.warning("compiled host sum unavailable, using numpy: %s", e)
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    dll.xagg_host_sum.argtypes = [p, i32, i32, i64, ctypes.c_float, p]
    dll.xagg_host_sum.restype = None
    dll.xagg_host_wait.argtypes = [p, p, i32, i32, i64, i32]
    dll.xagg_host_wait.restype = ctypes.c_int
    return dll


class HostSum:
    """``sum`` and ``wait`` on one host's segment, compiled or numpy (``fast``)."""

    def __init__(self, fast: bool = True):
        self.dll = load() if fast else None

    @property
    def compiled(self) -> bool:
        return self.dll is not None

    def sum(self, srcs: list, divide: float, out: np.ndarray) -> None:
        """float32 ``out`` = (srcs[0] + srcs[1] + ... ) / divide, added in that
        order in float32; the sources of one ELEMS type (a 16-bit one is
        widened element by element as it is read, never copied whole)."""
        n, dtype = out.size, srcs[0].dtype
        if dtype not in ELEMS or any(s.dtype != dtype for s in srcs):
            raise TypeError(f"host sum: the slices must share one of {[str(d) for d in ELEMS]}, "
                            f"got {[str(s.dtype) for s in srcs]}")
        if self.dll is not None:
            ptrs = (ctypes.c_void_p * len(srcs))(*(s.ctypes.data for s in srcs))
            self.dll.xagg_host_sum(ptrs, ELEMS[dtype], len(srcs), n, divide, out.ctypes.data)
            return
        if len(srcs) == 1:
            out[...] = widen(srcs[0])
        else:
            np.add(widen(srcs[0]), widen(srcs[1]), out=out)
        for s in srcs[2:]:
            np.add(out, widen(s), out=out)
        if divide != 1:
            np.divide(out, np.float32(divide), out=out)

    def wait(self, counters: np.ndarray, gen: np.ndarray, me: int, seq: int, timeout_s: float) -> bool:
        """Rank ``me`` at barrier ``seq`` (counters: int64 [L, LINE_WORDS],
        column 0 each rank's last barrier; gen: uint32 [1], the last one all
        reached): True once every rank is there, False after ``timeout_s``."""
        L = counters.shape[0]
        if self.dll is not None:
            return self.dll.xagg_host_wait(counters.ctypes.data, gen.ctypes.data, L, me, seq,
                                           max(1, int(timeout_s * 1000))) == 0
        counters[me, 0] = seq
        seqs, sleep, end = counters[:, 0], 0.0, time.monotonic() + timeout_s
        while (seqs < seq).any():
            if time.monotonic() > end:
                return False
            time.sleep(sleep)
            sleep = min(POLL_MAX_S, sleep * 2 or 1e-5)
        gen[0] = seq & 0xFFFFFFFF       # as the compiled barrier leaves it
        return True
