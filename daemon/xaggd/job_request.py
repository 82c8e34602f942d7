"""A register or resize request's fields, checked: each error names the
field, as the control API answers it (``{"ok": false, "error": "workers[1]:
..."}``)."""
from __future__ import annotations

import ipaddress

from xagg.wire.addresses import parse_addr
from xagg.wire.proto import C
from xaggd.auth import JOB_TOKEN_CHARS


class RequestError(ValueError):
    """A control request that cannot be served; the message names the field."""


class NoRoom(RequestError):
    """The job does not fit in the free slots or job indexes."""


def u32(req: dict, name: str, default=None, required=True) -> int:
    if name not in req or req[name] is None:
        if required and default is None:
            raise RequestError(f"{name}: missing (an unsigned 32-bit integer)")
        return default
    v = req[name]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
        raise RequestError(f"{name}: must be an unsigned 32-bit integer, got {v!r}")
    return v


def pos_int(req: dict, name: str, required=True, default=None) -> int:
    if name not in req or req[name] is None:
        if required:
            raise RequestError(f"{name}: missing (a positive integer)")
        return default
    v = req[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"{name}: must be a positive integer, got {v!r}")
    return v


def ipv4(v, name: str, allow_empty=False) -> str:
    if allow_empty and v in ("", None):
        return ""
    if not isinstance(v, str):
        raise RequestError(f"{name}: must be an IPv4 address string, got {v!r}")
    try:
        ipaddress.IPv4Address(v)
    except ValueError:
        raise RequestError(f"{name}: not an IPv4 address: {v!r}") from None
    return v


def job_token(req: dict) -> str | None:
    """A request's ``job_token`` (None: not given), checked."""
    value = req.get("job_token")
    if value is None:
        return None
    lo, hi = JOB_TOKEN_CHARS
    if not isinstance(value, str) or not lo <= len(value) <= hi or not value.isprintable() \
            or any(c.isspace() for c in value):
        raise RequestError(f"job_token: must be a string of {lo} to {hi} printable characters "
                           "without spaces (the one the register answer gave)")
    return value


def parse_workers(req: dict, max_workers: int) -> list[str]:
    """``workers``: one entry per worker id, its IPv4 source address or ""
    / null for any source; or ``n_workers`` alone (any source)."""
    workers, n = req.get("workers"), req.get("n_workers")
    if workers is None and n is None:
        raise RequestError("workers: missing (a list of worker IPv4 addresses, one per worker id; "
                           "\"\" accepts any source), or give n_workers")
    if n is not None:
        n = pos_int(req, "n_workers")
        if n > max_workers:
            raise RequestError(f"n_workers: {n} workers, this aggregator takes at most {max_workers}")
    if workers is None:
        return [""] * n
    if not isinstance(workers, list) or not workers:
        raise RequestError(f"workers: must be a non-empty list of IPv4 addresses, got {workers!r}")
    if len(workers) > max_workers:
        raise RequestError(f"workers: {len(workers)} workers, this aggregator takes at most {max_workers}")
    if n is not None and n != len(workers):
        raise RequestError(f"n_workers: {n} does not match the {len(workers)} entries of workers")
    out = []
    for i, w in enumerate(workers):
        if isinstance(w, str) and w.count(":") == 1:
            w = w.split(":")[0]            # "ip:port": the port is learned from packets
        out.append(ipv4(w, f"workers[{i}]", allow_empty=True))
    return out


def parse_aggregators(req: dict, current: list | None = None) -> list[dict]:
    aggs = req.get("aggregators")
    if aggs is None:
        return current if current is not None else [{"addr": "", "weight": 1.0}]
    if not isinstance(aggs, list) or not aggs:
        raise RequestError("aggregators: must be a non-empty list of {\"addr\": \"HOST:PORT\", \"weight\": W}")
    out = []
    for i, a in enumerate(aggs):
        if isinstance(a, str):
            a = {"addr": a}
        if not isinstance(a, dict):
            raise RequestError(f"aggregators[{i}]: must be an object {{\"addr\": ..., \"weight\": ...}}, got {a!r}")
        extra = set(a) - {"addr", "weight"}
        if extra:
            raise RequestError(f"aggregators[{i}].{sorted(extra)[0]}: unknown field (known: addr, weight)")
        addr = a.get("addr", "")
        if not isinstance(addr, str):
            raise RequestError(f"aggregators[{i}].addr: must be a \"HOST:PORT\" string, got {addr!r}")
        w = a.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
            raise RequestError(f"aggregators[{i}].weight: must be a finite number >= 0, got {w!r}")
        out.append({"addr": addr, "weight": float(w)})
    if sum(a["weight"] for a in out) <= 0:
        raise RequestError("aggregators: the weights are all zero")
    return out


def worker_mask(v, name: str, n_workers: int) -> int:
    """A worker set: a bit mask, or a list of worker ids."""
    if isinstance(v, list) and all(isinstance(w, int) and not isinstance(w, bool) for w in v):
        if not all(0 <= w < n_workers for w in v) or not v:
            raise RequestError(f"{name}: worker ids must be 0..{n_workers - 1}, got {v!r}")
        return sum(1 << w for w in set(v))
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 1 << n_workers:
        raise RequestError(f"{name}: must be a list of worker ids or a mask of workers "
                           f"0..{n_workers - 1}, got {v!r}")
    return v


def parse_children(req: dict, n_workers: int) -> list[dict]:
    """``children``: the child aggregators that send this one partial sums for
    its chunks, [{"addr": IPv4, "workers": ids or mask}]."""
    kids = req.get("children") or []
    if not isinstance(kids, list) or len(kids) > C.XAGG_MAX_CHILDREN:
        raise RequestError(f"children: must be a list of at most {C.XAGG_MAX_CHILDREN} "
                           "{\"addr\": IPv4, \"workers\": [ids]}")
    out = []
    for i, c in enumerate(kids):
        if not isinstance(c, dict) or set(c) - {"addr", "workers"}:
            raise RequestError(f"children[{i}]: must be {{\"addr\": IPv4, \"workers\": [ids] or mask}}, got {c!r}")
        out.append({"addr": ipv4(c.get("addr"), f"children[{i}].addr"),
                    "workers": worker_mask(c.get("workers"), f"children[{i}].workers", n_workers)})
    return out


def parse_child_for(req: dict, n_workers: int, aggregators: list, agg_index: int) -> list[dict]:
    """``child_for``: the other aggregators' chunk ranges this one sums some
    workers' contributions for, [{"agg_index": p, "workers": ids or mask}];
    aggregators[p]["addr"] is where the partial sums go."""
    subs = req.get("child_for") or []
    if not isinstance(subs, list):
        raise RequestError("child_for: must be a list of {\"agg_index\": p, \"workers\": [ids]}")
    out, seen = [], set()
    for i, c in enumerate(subs):
        if not isinstance(c, dict) or set(c) - {"agg_index", "workers"}:
            raise RequestError(f"child_for[{i}]: must be {{\"agg_index\": p, \"workers\": [ids] or mask}}, "
                               f"got {c!r}")
        p = c.get("agg_index")
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(aggregators) \
                or p == agg_index or p in seen:
            raise RequestError(f"child_for[{i}].agg_index: must name another of the job's aggregators "
                               f"(0..{len(aggregators) - 1}, not {agg_index}, each once), got {p!r}")
        seen.add(p)
        try:
            ip, port = parse_addr(aggregators[p]["addr"])
        except ValueError as e:
            raise RequestError(f"aggregators[{p}].addr: {e} (a child sends its partial sums there)") from None
        out.append({"agg_index": p, "workers": worker_mask(c.get("workers"), f"child_for[{i}].workers",
                                                              n_workers),
                    "parent": f"{ip}:{port}"})
    return out


def agg_index(req: dict, default: int = 0) -> int:
    """``agg_index``: which of ``aggregators`` this one is (bounds: jobs.py, against the list)."""
    value = req.get("agg_index", default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"agg_index: must be an integer, got {value!r}")
    return value


def replace_flag(req: dict) -> bool:
    value = req.get("replace", False)
    if not isinstance(value, bool):
        raise RequestError(f"replace: must be true or false, got {value!r}")
    return value
