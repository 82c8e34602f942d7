"""``NAME[:opt=value,...]`` -> a compressor (what ``--compress`` takes)."""
import dataclasses

from xagg.compress.base import Compressor
from xagg.compress.dense import Dense
from xagg.compress.iwp import ImportanceWeighted
from xagg.compress.lossless import Lossless
from xagg.compress.quant import Int8, Int16
from xagg.compress.selector import Auto
from xagg.compress.sketch import SketchFusion
from xagg.compress.topk import MSTopK, ResidualTopK

METHODS = {c.NAME: c for c in (Dense, ResidualTopK, MSTopK, ImportanceWeighted, SketchFusion,
                               Lossless, Int8, Int16, Auto)}
ALIASES = {"none": "dense", "topk": "rgc"}

_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def options(name: str) -> dict:
    """Option name -> (type, default) of a method."""
    cls = METHODS[ALIASES.get(name, name)]
    return {f.name: (f.type, f.default) for f in dataclasses.fields(cls) if f.init}


def parse_spec(spec: str) -> tuple[str, dict]:
    """'rgc:ratio=0.01,warmup=5' -> ('rgc', {'ratio': '0.01', 'warmup': '5'}), unvalidated."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"compressor spec {spec!r}: missing method name (known: {', '.join(METHODS)})")
    opts = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or not key or not val.strip():
            raise ValueError(f"compressor spec {spec!r}: {item!r} is not opt=value")
        if key in opts:
            raise ValueError(f"compressor spec {spec!r}: option {key!r} given twice")
        opts[key] = val.strip()
    return name, opts


def split_specs(text: str) -> list:
    """'rgc,sketch:ratio=0.1,cols=2' -> ['rgc', 'sketch:ratio=0.1,cols=2']: a
    comma-separated list of specs, where a piece with '=' and no ':' is one
    more option of the method before it."""
    out: list = []
    for piece in filter(None, (s.strip() for s in text.split(","))):
        if out and "=" in piece and ":" not in piece:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def _convert(method: str, key: str, typ, val: str):
    try:
        if typ is bool:
            return _BOOL[val.lower()]
        return typ(val)
    except (KeyError, ValueError):
        raise ValueError(f"{method}: option {key}={val!r} is not a valid {typ.__name__}") from None


def get_compressor(spec, **overrides) -> Compressor:
    """A compressor from a spec string (or the compressor itself, returned as is)."""
    if isinstance(spec, Compressor):
        return spec
    name, raw = parse_spec(spec)
    name = ALIASES.get(name, name)
    if name not in METHODS:
        raise ValueError(f"unknown compressor {name!r} (known: {', '.join(METHODS)})")
    known = options(name)
    kwargs = {}
    for key, val in {**raw, **{k: str(v) for k, v in overrides.items()}}.items():
        if key not in known:
            raise ValueError(f"{name}: unknown option {key!r} (known: {', '.join(known)})")
        kwargs[key] = _convert(name, key, known[key][0], val)
    return METHODS[name](**kwargs)


def describe() -> str:
    """One line per method: its spec with defaults and what it sends."""
    lines = []
    for name, cls in METHODS.items():
        doc = (cls.__doc__ or "").strip().split(" - ", 1)[-1].split("\n\n")[0]
        lines.append(f"{name:9s} {' '.join(doc.split())}")
    return "\n".join(lines)
