"""The client's hot loops compiled, through ctypes: ``csrc/exchange.c`` (the
round loop, with ``batch.c`` and ``retransmit.c``), ``csrc/codec.c`` (the
fixed-point codec, used by codec.py), ``csrc/local.c``, ``csrc/select.c``,
``csrc/peel.c``, ``csrc/sketch.c``, ``csrc/residual.c``, ``csrc/scatter.c``
and ``csrc/int8.c`` (the compressors' top-k, the lossless method's peeling,
the count-sketch, the sent values taken out of a residual, a sparse sum
written into a dense result and the int8 method's passes, used by
xagg/compress), one shared library.

Built on first use with the machine's C compiler (cc, gcc or clang) into a
cache directory, named by a hash of the sources, the headers they include,
the compiler and its flags, so every rank of a job shares one build and an
edit rebuilds. Where no compiler works, or ``XAGG_FASTPATH=0``, ``load()``
returns None and the client runs its numpy loop and numpy codec (the
references these are tested against).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from xagg.client.fixedpoint import ELEMS
from xagg.client.local import Local
from xagg.wire.proto import BPF_DIR, HDR_SIZE

log = logging.getLogger("xagg.client")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "exchange.c", CSRC / "batch.c", CSRC / "retransmit.c", CSRC / "codec.c", CSRC / "local.c",
           CSRC / "select.c", CSRC / "peel.c", CSRC / "sketch.c", CSRC / "residual.c",
           CSRC / "scatter.c", CSRC / "int8.c", CSRC / "orlanes.c")
LOCAL_HEADERS = (CSRC / "exchange.h", CSRC / "codec.h", CSRC / "elem.h", CSRC / "local.h", CSRC / "layout.h",
                 CSRC / "sketch.h", CSRC / "simd.h")
HEADERS = ("xagg_consts.h", "xagg_proto.h")
CACHE = Path(os.environ.get("XAGG_CACHE", Path.home() / ".cache" / "xagg"))

_p = ctypes.c_void_p


class Exchange(ctypes.Structure):
    """struct xagg_exchange (csrc/exchange.h); its layout is checked against the C one on load."""
    _fields_ = [("fd", ctypes.c_int32), ("n_aggs", ctypes.c_int32), ("addrs", _p), ("pkts", _p),
                ("off", _p), ("row_map", _p), ("width", ctypes.c_int64), ("pkt_size", ctypes.c_uint32),
                ("vals", ctypes.c_uint32), ("job_id", ctypes.c_uint32), ("cookie", ctypes.c_uint32),
                ("round", ctypes.c_uint32), ("window", ctypes.c_int32), ("rto_floor", ctypes.c_double),
                ("timeout", ctypes.c_double), ("gso", ctypes.c_int32), ("srtt", ctypes.c_double),
                ("rttvar", ctypes.c_double), ("reorder", ctypes.c_int32), ("results", _p), ("done", _p),
                ("sent", ctypes.c_int64), ("retransmits", ctypes.c_int64), ("received", ctypes.c_int64),
                ("err", ctypes.c_int32), ("src", _p), ("dst", _p), ("n", ctypes.c_int64),
                ("chunk_of_row", _p), ("pred", _p), ("own_at", _p), ("exps", _p), ("headroom", ctypes.c_int32),
                ("bias", ctypes.c_int32), ("unbias", ctypes.c_uint32), ("probe_resends", ctypes.c_int64),
                ("rto_resends", ctypes.c_int64), ("local", _p), ("transport", _p), ("lane_bits", ctypes.c_int32),
                ("res_in", _p), ("res_out", _p), ("src_elem", ctypes.c_int32), ("dst_elem", ctypes.c_int32),
                ("divide", ctypes.c_float), ("window_min", ctypes.c_int32), ("storm_share", ctypes.c_float)]


class SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_uint16), ("port", ctypes.c_uint16 * 1), ("addr", ctypes.c_uint8 * 4),
                ("zero", ctypes.c_uint8 * 8)]


def sockaddrs(addrs) -> ctypes.Array:
    """(ip, port) pairs as a C array of struct sockaddr_in (network byte order)."""
    arr = (SockaddrIn * len(addrs))()
    for a, (ip, port) in zip(arr, addrs):
        a.family = socket.AF_INET
        a.port[0] = socket.htons(port)
        a.addr[:] = list(socket.inet_aton(ip))
    return arr


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


# -O3: gcc 12 vectorises the codec's loops only from -O3 (at -O2 its cost
# model refuses loops with a remainder); -fno-trapping-math lets it turn the
# rounding's select into a blend (no result changes: only which FP exception
# flags get set may). scripts/bench_codec.py measures what both gain over -O2.
# -ffp-contract=off: a fused multiply-add would round once where the numpy
# reference rounds twice. No -march: ranks on other CPUs share the cache.
CFLAGS = ("-O3", "-fno-trapping-math", "-ffp-contract=off", "-Wall", "-shared", "-fPIC")
LIB_PREFIX = "xagg-client-"


def build(cc: str, prefix: str = LIB_PREFIX, sources=None, headers=None, libs=()) -> Path:
    """The shared library of ``sources`` (default SOURCES, including
    LOCAL_HEADERS; linked with ``libs``) in the cache, built unless a build
    of the same inputs is there; builds of older sources under the same
    ``prefix`` are removed."""
    sources, headers = sources or SOURCES, headers or LOCAL_HEADERS
    h = hashlib.sha256(" ".join((cc, *CFLAGS, *libs)).encode())
    for p in (*sources, *headers, *(BPF_DIR / n for n in HEADERS)):
        h.update(p.read_bytes())
    lib = CACHE / f"{prefix}{h.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=CACHE)     # ranks build at once: rename is atomic
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, f"-I{BPF_DIR}", "-o", tmp, *map(str, sources), *libs]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise OSError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
        for old in CACHE.glob(f"{prefix}*.so"):
            if old != lib:                              # builds of older sources
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def check_layout(dll) -> None:
    """OSError unless the library's struct xagg_exchange and struct
    xagg_local are laid out like ``Exchange`` and ``local.Local``."""
    for fn, twin, extra in ((dll.xagg_exchange_layout, Exchange, [HDR_SIZE]), (dll.xagg_local_layout, Local, [])):
        names = [f for f, *_ in twin._fields_]
        out = (ctypes.c_int64 * (1 + len(extra) + len(names)))()
        fn.restype = ctypes.c_int64
        have = fn(out, len(out))
        mine = [ctypes.sizeof(twin), *extra] + [getattr(twin, f).offset for f in names]
        if have != len(mine) or list(out) != mine:
            raise OSError(f"struct layout differs from its ctypes twin {twin.__name__}: C {list(out)[:have]}, "
                          f"Python {mine}")


@lru_cache(maxsize=None)
def load():
    """The compiled library, or None (with the reason logged once)."""
    if os.environ.get("XAGG_FASTPATH", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc, clang): the client runs its slower numpy loop")
        return None
    try:
        dll = ctypes.CDLL(str(build(cc)))
        check_layout(dll)
    except OSError as e:
        log.warning("compiled round loop unavailable, using the numpy loop: %s", e)
        return None
    declare(dll)
    return dll


def declare(dll) -> None:
    """Argument types of the round loop's and the codec's functions."""
    dll.xagg_exchange.argtypes = [ctypes.POINTER(Exchange)]
    dll.xagg_exchange.restype = ctypes.c_int
    _declare_codec(dll)
    _declare_select(dll)


def _declare_select(dll) -> None:
    """csrc/select.c: the compressors' top-k fused with the residual update;
    csrc/peel.c: the lossless method's peeling; csrc/sketch.c: the shared hashes and the count-sketch;
    csrc/residual.c: what is sent at chosen indices, quantised and taken out of the residual;
    csrc/scatter.c: a sparse sum written into a dense result; csrc/int8.c: the int8 method's passes."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.xagg_select_topk.argtypes = [p, p, p, ctypes.c_float, p, i64, i64, ctypes.c_uint64, ctypes.c_int, p, p]
    dll.xagg_select_topk.restype = i64
    dll.xagg_sketch_select.argtypes = [p, i64, p, ctypes.c_int, i64, ctypes.c_uint64, p]
    dll.xagg_sketch_select.restype = i64
    dll.xagg_sketch_select_cells.argtypes = [p, i64, i64, p, p, i64, p]
    dll.xagg_sketch_select_cells.restype = i64
    dll.xagg_sketch_members.argtypes = [p, i64, i64, p, p]
    dll.xagg_sketch_members.restype = None
    dll.xagg_send_from.argtypes = [p, p, i64, p, ctypes.c_float, p]
    dll.xagg_send_from.restype = None
    dll.xagg_scatter_into.argtypes = [p, p, p, i64, i64, p, p, i64, ctypes.c_int, ctypes.c_float, p]
    dll.xagg_scatter_into.restype = i64
    dll.xagg_int8_bound.argtypes = [p, p, p, i64, i64, p]
    dll.xagg_int8_quantise.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    dll.xagg_int8_dequantise.argtypes = [p, i64, i64, i64, p, ctypes.c_float, p]
    dll.xagg_int8_bound.restype = dll.xagg_int8_quantise.restype = dll.xagg_int8_dequantise.restype = None
    dll.xagg_peel.argtypes = [p, i64, p, i64, p, p]
    dll.xagg_peel.restype = i64
    dll.xagg_hash_codes.argtypes = [p, i64, p, ctypes.c_int, i64, p]
    dll.xagg_hash_codes_blocked.argtypes = [i64, p, ctypes.c_int, i64, i64, p]
    dll.xagg_hash_codes_blocked.restype = None
    dll.xagg_or_pack.argtypes = [p, i64, ctypes.c_int, p]
    dll.xagg_or_unpack.argtypes = [p, i64, ctypes.c_int, p]
    dll.xagg_or_pack.restype = dll.xagg_or_unpack.restype = None
    dll.xagg_bits_set.argtypes = [p, i64, p]
    dll.xagg_bits_members.argtypes = [p, i64, p]
    dll.xagg_bits_set.restype = dll.xagg_bits_members.restype = None
    dll.xagg_bits_count.argtypes = [p, i64]
    dll.xagg_bits_count.restype = i64
    dll.xagg_sketch_insert.argtypes = [p, i64, p, ctypes.c_int, p]
    dll.xagg_sketch_query_mean.argtypes = [p, i64, p, ctypes.c_int, p]
    dll.xagg_hash_codes.restype = dll.xagg_sketch_insert.restype = dll.xagg_sketch_query_mean.restype = None
    dll.xagg_sketch_accumulate.argtypes = [p, p, p, i64, p, ctypes.c_int, p]
    dll.xagg_sketch_accumulate.restype = ctypes.c_float


def _declare_codec(dll) -> None:
    """Argument types of csrc/codec.c's functions (pointers as addresses,
    a tensor's followed by its element type: fixedpoint.ELEMS)."""
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    dll.xagg_chunk_exponents.argtypes = [p, i32, i64, i32, p]
    dll.xagg_quantise.argtypes = [p, i32, i64, i32, p, i32, i32, p, i64, p]
    dll.xagg_dequantise.argtypes = [p, p, p, i32, ctypes.c_uint32, i32, f32, p, i32, i64]
    for f in (dll.xagg_chunk_exponents, dll.xagg_quantise, dll.xagg_dequantise):
        f.restype = None
    dll.xagg_encode_one.argtypes = [p, i32, i64, i32, i64, i32, i32, i32, p, p]     # the round loop's; for tests
    dll.xagg_encode_one.restype = i32
    # 16-bit lanes: the residual in and out after the tensor
    dll.xagg_chunk_exponents16.argtypes = [p, i32, p, i64, i32, p]
    dll.xagg_quantise16.argtypes = [p, i32, p, p, i64, i32, p, i32, i32, p, i64, p]
    dll.xagg_dequantise16.argtypes = [p, p, p, i32, ctypes.c_uint32, i32, f32, p, i32, i64]
    for f in (dll.xagg_chunk_exponents16, dll.xagg_quantise16, dll.xagg_dequantise16):
        f.restype = None
    dll.xagg_encode16_one.argtypes = [p, i32, p, p, i64, i32, i64, i32, i32, i32, p, p]
    dll.xagg_encode16_one.restype = i32


def _ptr(a: np.ndarray):
    assert a.flags.c_contiguous
    return a.ctypes.data


@dataclass
class InLoopCodec:
    """The codec inside the round loop (struct xagg_exchange's src..unbias).
    As a data row first goes out, its chunk's exponent is read from ``src``
    and written at byte ``own_at[c]`` of the packets (lane 0 of the chunk's
    meta entry, in a meta row that goes out after the data rows), the send
    exponent (fixedpoint.send_exponents of it and ``pred``) stored in
    ``exps`` and the chunk quantised with it; its result is dequantised into
    ``dst`` as it arrives. ``chunk_of_row`` (int64, one per packet row) names
    the chunk a data row carries, -1 for the others (meta rows), whose
    results still land in the result rows. Data rows are biased
    (XAGG_OP_SUM64): ``bias`` added to each value sent, ``unbias`` taken off
    each sum (fixedpoint.bias). ``bits``: the lane width (16: two values a
    word, a chunk twice the words in values), with error feedback where
    ``fb`` is given (codec.Feedback: 16-bit lanes only). ``src`` and ``dst``
    may each hold float32, float16 or bfloat16 (fixedpoint.ELEMS), read and
    written in place; each sum is divided by ``divide`` in float32 before
    it is rounded into ``dst``."""
    src: np.ndarray
    dst: np.ndarray
    pred: np.ndarray
    own_at: np.ndarray
    exps: np.ndarray
    chunk_of_row: np.ndarray
    headroom: int
    bias: int = 0
    unbias: int = 0
    bits: int = 32
    fb: object = None
    divide: float = 1.0

    def check(self, pkts: np.ndarray, vals: int) -> None:
        """AssertionError unless C can use these arrays without writing out of bounds."""
        count = -(-self.src.size // (vals * 32 // self.bits))
        assert self.bits in (32, 16) and (self.fb is None or self.bits == 16)
        if self.fb is not None:
            self.fb.check(self.src.size)
            assert not np.shares_memory(self.fb.out, self.src) and not np.shares_memory(self.fb.out, self.dst)
        assert self.src.dtype in ELEMS and self.dst.dtype in ELEMS and self.src.size == self.dst.size
        assert not np.shares_memory(self.src, self.dst)
        assert self.pred.dtype == self.exps.dtype == np.int32 and self.pred.size == self.exps.size == count
        assert self.chunk_of_row.dtype == np.int64 and self.chunk_of_row.size == len(pkts)
        assert int(self.chunk_of_row.max(initial=-1)) < count
        assert self.own_at.dtype == np.int64 and self.own_at.size == count
        assert count == 0 or (self.own_at.min() >= 0 and self.own_at.max() + 4 <= pkts.nbytes)
        for a in (self.src, self.dst, self.pred, self.own_at, self.exps, self.chunk_of_row):
            assert a.flags.c_contiguous


def exchange(dll, x: Exchange, pkts: np.ndarray, off: np.ndarray, row_map: np.ndarray,
             results: np.ndarray, done: np.ndarray, codec: InLoopCodec | None = None) -> int:
    """Run one round (the GIL is released meanwhile); returns the C status:
    0 done, 1 timeout, -1 error (``x.err``). The arrays must stay alive for
    the call, so they are passed here rather than stored by the caller."""
    x.pkts, x.off, x.row_map = _ptr(pkts), _ptr(off), _ptr(row_map)
    x.results, x.done = _ptr(results), _ptr(done)
    x.width = row_map.shape[1]
    assert x.pkt_size == pkts.dtype.itemsize
    if codec is None:
        x.src = x.dst = x.chunk_of_row = x.pred = x.own_at = x.exps = None
    else:
        codec.check(pkts, x.vals)
        x.src, x.dst, x.chunk_of_row = _ptr(codec.src), _ptr(codec.dst), _ptr(codec.chunk_of_row)
        x.pred, x.own_at, x.exps = _ptr(codec.pred), _ptr(codec.own_at), _ptr(codec.exps)
        x.n, x.headroom = codec.src.size, codec.headroom
        x.bias, x.unbias = codec.bias, codec.unbias
        x.lane_bits = codec.bits
        x.res_in, x.res_out = (None, None) if codec.fb is None else (_ptr(codec.fb.into), _ptr(codec.fb.out))
        x.src_elem, x.dst_elem, x.divide = ELEMS[codec.src.dtype], ELEMS[codec.dst.dtype], codec.divide
    return dll.xagg_exchange(ctypes.byref(x))


def main() -> int:
    """`python -m xagg.client.native`: build (or find) the library now; setup runs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dll = load()
    if dll is None:
        print("compiled round loop: unavailable (see the warning above); the client uses numpy")
        return 1
    print(f"compiled round loop and codec: {dll._name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
