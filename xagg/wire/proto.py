"""The xagg wire format, derived from the C headers in ``bpf/``.

Nothing here is a hand-kept copy: constants come from the ``#define`` lines
of ``bpf/xagg_consts.h`` and the header dtype from ``struct xagg_hdr`` in
``bpf/xagg_proto.h`` (natural C alignment). ``tests/test_layout.py`` checks
both against the types bcc generates from the same files.

``bpf/`` reaches this package as ``xagg/wire/bpf``, a link to the top-level
directory that the build copies into the wheel, so a checkout and an
installed package read the same files from the same place.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np

BPF_DIR = Path(os.environ.get("XAGG_BPF_DIR", Path(__file__).resolve().parent / "bpf"))

_DEFINE = re.compile(r"^#define\s+(XAGG_[A-Z0-9_]+)\s+(-?(?:0x[0-9a-fA-F]+|\d+))\b", re.M)
_CTYPES = {"__u8": "u1", "__u16": "<u2", "__u32": "<u4", "__u64": "<u8",
           "__s8": "i1", "__s16": "<i2", "__s32": "<i4", "__s64": "<i8",
           "struct bpf_spin_lock": "<u4"}


@lru_cache(maxsize=None)
def constants() -> SimpleNamespace:
    """Every ``#define XAGG_*`` of xagg_consts.h (the #ifndef defaults)."""
    text = (BPF_DIR / "xagg_consts.h").read_text()
    return SimpleNamespace(**{k: int(v, 0) for k, v in _DEFINE.findall(text)})


def struct_dtype(name: str, header: str = "xagg_proto.h", **sizes: int) -> np.dtype:
    """numpy dtype of ``struct NAME`` from a bpf/ header, C-aligned.

    Array bounds may name constants (``vals[XAGG_VALS]``, ``set[XAGG_SET_WORDS + 1]``); ``sizes``
    overrides them as the -D flags override the C defaults.
    """
    text = (BPF_DIR / header).read_text()
    m = re.search(r"struct\s+%s\s*\{(.*?)\};" % re.escape(name), text, re.S)
    if not m:
        raise KeyError(f"struct {name} not found in {header}")
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    consts = vars(constants()) | sizes
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        fm = re.fullmatch(r"(__[us]\d+|struct bpf_spin_lock)\s+(\w+)(?:\[([\w\s+]+)\])?", decl)
        if not fm:
            raise ValueError(f"struct {name}: cannot map field {decl!r}")
        ctype, fname, dim = fm.groups()
        if dim is None:
            fields.append((fname, _CTYPES[ctype]))
        else:
            # a bound is a sum of constants and numbers: vals[XAGG_VALS], set[XAGG_SET_WORDS + 1]
            n = sum(int(consts.get(t.strip(), t.strip())) for t in dim.split("+"))
            fields.append((fname, _CTYPES[ctype], (n,)))
    return np.dtype(fields, align=True)


C = constants()
HDR_DTYPE = struct_dtype("xagg_hdr")
HDR_SIZE = HDR_DTYPE.itemsize
VERDICTS = [k[len("XAGG_V_"):].lower()
            for k, _ in sorted(((k, v) for k, v in vars(C).items() if k.startswith("XAGG_V_")),
                               key=lambda kv: kv[1])]
assert len(VERDICTS) == C.XAGG_NR_VERDICTS, "verdict #defines must be 0..NR-1"

# the header's encoding for each lane width a sum may take (fixedpoint.WIRE_BITS)
ENCODING_OF_BITS = {32: C.XAGG_ENC_I32, 16: C.XAGG_ENC_I16X2}
BITS_OF_ENCODING = {e: b for b, e in ENCODING_OF_BITS.items()}
assert len(BITS_OF_ENCODING) == C.XAGG_NR_ENCODINGS, "every XAGG_ENC_* names one lane width"

JUMBO_MTU = 9000          # the most any configuration may ask for


def max_vals(mtu: int = 1500) -> int:
    """Values per packet that fit one frame of ``mtu`` bytes (IPv4 20 + UDP 8 + header)."""
    return (mtu - 28 - HDR_SIZE) // 4


MAX_VALS = max_vals(JUMBO_MTU)     # values per packet any configuration may ask for


def slot_bytes(vals: int = C.XAGG_VALS) -> int:
    """Kernel memory per chunk slot (struct xagg_slot), derived like the rest."""
    return struct_dtype("xagg_slot", "xagg_maps.h", XAGG_VALS=vals).itemsize


def packet_dtype(vals: int = C.XAGG_VALS) -> np.dtype:
    """One whole UDP payload: header + ``vals`` int32."""
    return np.dtype([("hdr", HDR_DTYPE), ("vals", "<i4", (vals,))])


def make_packets(*, job_id: int, cookie: int, worker_id: int, round_: int,
                 chunks: np.ndarray, values: np.ndarray, op: int = C.XAGG_OP_SUM,
                 flags: int = 0, worker_mask: int | None = None,
                 agg_id: int = 0, n_aggs: int = 1, bits: int = 32) -> np.ndarray:
    """Vectorised: one packet per row of ``values`` (shape [n, vals]).
    ``worker_mask``: the bits of ``worker_id``'s 64-worker block (default: its
    own bit), as struct xagg_hdr defines it; ``bits``: the values' lane width
    (the header's encoding: the aggregator sums only equal widths)."""
    values = np.asarray(values, dtype="<i4")
    n, vals = values.shape
    pk = np.zeros(n, dtype=packet_dtype(vals))
    h = pk["hdr"]
    h["magic"] = C.XAGG_MAGIC
    h["version"] = C.XAGG_VERSION
    h["op"] = op
    h["flags"] = flags
    h["encoding"] = ENCODING_OF_BITS[bits]
    h["job_id"] = job_id
    h["cookie"] = cookie
    h["chunk"] = chunks
    h["round"] = round_ & 0xFFFFFFFF
    h["worker_id"] = worker_id
    h["count"] = vals
    h["agg_id"] = agg_id
    h["n_aggs"] = n_aggs
    h["worker_mask"] = (1 << worker_id % 64) if worker_mask is None else worker_mask
    pk["vals"] = values
    return pk
