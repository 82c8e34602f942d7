"""Link rates as people write them ("1gbit", "500mbit", 2e9) -> bits/s.

SI units as tc uses them, the one spelling of every rate: the planner's
files and flags, `xagg lab --rate` (which adds tbf's range); bytes units
("mbps") are refused rather than guessed.
"""
from __future__ import annotations

import math
import re

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]?)(?:bit)?\s*$", re.I)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bps(value, field: str) -> float | None:
    """Bits/s from "1gbit", "200mbit", "1.5g" or a number; None, "" and "none"
    mean no limit (None). ValueError naming ``field`` otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{field}: bad rate {value!r}")
    if isinstance(value, (int, float)):
        bps = float(value)
    else:
        m = _RATE_RE.match(str(value))
        if not m:
            raise ValueError(f"{field}: bad rate {value!r}: use e.g. 1gbit, 200mbit, 500kbit or "
                             "plain bits/s (bytes units like 'mbps' are not accepted)")
        bps = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if not 0 < bps < math.inf:
        raise ValueError(f"{field}: bad rate {value!r}: must be > 0 bits/s")
    return bps


def format_bps(bps: float | None, unshaped: str = "unshaped") -> str:
    """"1gbit", "200mbit", ...; ``unshaped`` for None (no limit)."""
    if bps is None:
        return unshaped
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= mult:
            return f"{bps / mult:g}{unit}"
    return f"{bps:g}bit"
