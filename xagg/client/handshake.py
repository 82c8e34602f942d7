"""One packet exchange with each aggregator before the first sum: the
aggregator's XDP program answers a bare header flagged XAGG_F_PROBE with
its values per packet and whether it knows the job and cookie
(bpf/xagg_probe.h). A client of a job the operator registered learns the
packet size it must use, and a wrong address, job id, cookie or packet
size is named in one line before any packet is dropped as malformed.
"""
from __future__ import annotations

import select
import socket
from dataclasses import dataclass

import numpy as np

from xagg.wire.addresses import parse_addr
from xagg.wire.proto import C, HDR_DTYPE, VERDICTS

TRIES = 3
WAIT_S = 0.5        # per try: an aggregator answers from its NIC's receive path


@dataclass(frozen=True)
class Answer:
    addr: str           # the aggregator, as given
    vals: int           # values per packet it sums
    verdict: str        # "probed" (job and cookie known), "unknown_job", "bad_cookie", "malformed"
    version: int        # its wire version


def question(job_id: int, cookie: int) -> bytes:
    h = np.zeros(1, HDR_DTYPE)
    h["magic"], h["version"], h["flags"] = C.XAGG_MAGIC, C.XAGG_VERSION, C.XAGG_F_PROBE
    h["job_id"], h["cookie"] = job_id, cookie
    return h.tobytes()


def read_answer(addr: str, data: bytes) -> Answer | None:
    """The answer in ``data``, or None if it is not one."""
    if len(data) < 5 or int.from_bytes(data[:4], "little") != C.XAGG_MAGIC:
        return None
    if data[4] != C.XAGG_VERSION:           # another layout: only its version can be read
        return Answer(addr, 0, "malformed", data[4])
    if len(data) != HDR_DTYPE.itemsize:
        return None
    h = np.frombuffer(data, HDR_DTYPE)[0]
    if not (int(h["flags"]) & C.XAGG_F_PROBE and int(h["flags"]) & C.XAGG_F_RESULT):
        return None
    verdict = int(h["chunk"])
    return Answer(addr, int(h["count"]), VERDICTS[verdict] if verdict < len(VERDICTS) else "malformed",
                  int(h["version"]))


def ask(aggregators: list[str], job_id: int, cookie: int, *, tries: int = TRIES,
        wait_s: float = WAIT_S) -> dict[str, Answer | None]:
    """Each aggregator's answer (None: none came in ``tries`` tries)."""
    targets = {parse_addr(a): a for a in aggregators}
    got: dict[str, Answer | None] = dict.fromkeys(aggregators)
    q = question(job_id, cookie)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(tries):
            waiting = [t for t, a in targets.items() if got[a] is None]
            if not waiting:
                break
            for t in waiting:
                s.sendto(q, t)
            while select.select([s], [], [], wait_s)[0]:
                data, src = s.recvfrom(2048)
                a = targets.get(src)
                if a is not None and got[a] is None:
                    got[a] = read_answer(a, data)
                if all(v is not None for v in got.values()):
                    break
    return got


def problem(answers: dict[str, Answer | None], job_id: int, vals: int | None) -> str | None:
    """One line naming what is wrong, or None. ``vals``: the client's values
    per packet if the user set them, else None (the aggregators' are taken)."""
    silent = [a for a, ans in answers.items() if ans is None]
    if silent:
        return (f"aggregator {', '.join(silent)} did not answer a probe ({TRIES} tries): not reachable, "
                f"or no xaggd serves that address (check -a/--aggregators)")
    for a, ans in answers.items():
        if ans.verdict == "malformed":
            return f"aggregator {a} speaks wire version {ans.version}, this client {C.XAGG_VERSION}"
        if ans.verdict == "unknown_job":
            return f"aggregator {a} has no job {job_id} (check --job-id: the operator registers the job with xaggd)"
        if ans.verdict == "bad_cookie":
            return f"aggregator {a} holds job {job_id} with another cookie (check --cookie)"
    sizes = {a: ans.vals for a, ans in answers.items()}
    if len(set(sizes.values())) > 1:
        return "the aggregators sum different values per packet: " + ", ".join(f"{a} {v}" for a, v in sizes.items())
    theirs = next(iter(sizes.values()), None)
    if vals is not None and theirs is not None and vals != theirs:
        return f"values per packet: this client sends {vals} (--vals), the aggregators sum {theirs}"
    return None
