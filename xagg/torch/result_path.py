"""How a job's results come back when the hook's fan-out is "auto" (its
default), and the check that the choice delivers.

**Choosing.** At start every rank says how it reaches each aggregator
(xagg.wire.registration.worker_reach: its source address, and whether its
routing table puts the aggregator on its own link), and every rank turns
the same gathered reports into the same result path (xagg.wire.fanout.choose):
a multicast group where every worker is on each aggregator's segment, so
each aggregator sends one frame per chunk instead of one per worker;
unicast elsewhere. A job the operator registered keeps unicast (the
daemon's default for a job that names no fan-out): its ranks cannot know
what the operator chose. A tree plan (routes) keeps unicast too: a child
aggregator's results come back through the tc clone path.

**Checking.** A group that does not deliver (a switch that drops multicast,
a worker whose join never reaches it) would not stop the job: an
aggregator answers a worker's resend of a finished chunk to that worker
alone, so the worker gets every sum one retransmit timeout late. So before
the first step every lane sums a small integer tensor through its job
``PROBE_ROUNDS`` times, each worker's value its index + 1, and checks the
exact sum; a rank that got its sums only by resending, in every one of
those rounds, did not hear the group (one lost packet on a healthy path
costs a resend in one round, not in all). Then rank 0 registers the job
again with unicast fan-out, every rank makes its clients again, and rank 0
logs one warning naming the setting; the job never drops to gloo for it.
A fan-out set by name is not checked: the job runs what it asked for and
falls back like any job.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from xagg.client import XaggError
from xagg.torch.fallback import agree_max
from xagg.wire import chunks
from xagg.wire.fanout import AUTO, Fanout, ResultPath, choose
from xagg.wire.registration import worker_reach

log = logging.getLogger("xagg.torch")

UNICAST = ResultPath(Fanout.UNICAST)
PROBE_ROUNDS = 3


@dataclass(frozen=True)
class Choice:
    path: ResultPath
    why: str                # in words, for the log
    check: bool             # "auto" picked one frame per chunk: the first round checks it


def agree(config, group, world: int, workers: list[int]) -> Choice:
    """The job's result path (a collective where "auto" decides on a job that
    registers): ``workers`` are the ranks that speak for the job's workers,
    in worker order."""
    if config.fanout != AUTO:
        return Choice(ResultPath(Fanout.parse(config.fanout), config.result_group), "as set", False)
    if not config.registers:
        return Choice(UNICAST, "the operator registered the job (unicast unless --fanout names another)", False)
    if config.routes:
        return Choice(UNICAST, "a tree plan's children take their results unicast", False)
    every = [None] * world
    dist.all_gather_object(every, worker_reach(config.aggregators), group=group)
    path, why = choose([every[r] for r in workers], config.aggregators, config.result_group)
    if dist.get_rank(group) == 0:
        log.info("xagg: results by %s (--fanout auto: %s)",
                 f"multicast group {path.group}" if path.group else "unicast", why)
    return Choice(path, why, path.one_frame)


def probe_elements(weights: list[float], vals: int, cap: int | None) -> int:
    """Elements of the probe tensor: enough chunks that every aggregator with a
    share gets one (each sends its own frames to the group), within the
    largest tensor the job was sized for (``cap``)."""
    live = [k for k, w in enumerate(weights) if w]
    n = len(live)
    while not all(hi > lo for k, (lo, hi) in enumerate(chunks.split(n, weights)) if k in live):
        n += 1
    return max(1, min(n * vals, cap or n * vals))


def probe_lane(client, cap: int | None) -> str:
    """``PROBE_ROUNDS`` exact integer rounds on ``client``: "" if a sum came
    back without a resend, else why not."""
    cfg = client.cfg
    x = np.full(probe_elements(cfg.weights or [1.0] * len(cfg.aggregators), cfg.vals, cap),
                cfg.worker_id + 1, np.int32)
    want = cfg.n_workers * (cfg.n_workers + 1) // 2
    heard = False
    for _ in range(PROBE_ROUNDS):       # all of them, on every rank: each is a round of every worker
        resent = client.stats.retransmits
        try:
            got = client.allreduce_int(x)
        except (XaggError, OSError) as e:
            return str(e)
        if not np.all(got == want):
            return f"the probe's sum is wrong ({int(got.flat[0])}, not {want})"
        heard = heard or client.stats.retransmits == resent
    return "" if heard else f"each of {PROBE_ROUNDS} probe rounds got its sums only by resending"


def check_delivery(aggs, cap: int | None) -> bool:
    """The first round's check of a group "auto" chose (a collective, every
    rank, right after its lanes have their clients): True when the job
    moved to unicast. ``cap``: the elements a lane's job was sized for."""
    st = aggs.state
    why = ""
    # every rank's clients made (a first one may build the compiled loop) before
    # any rank sends: a rank that waited longer than its timeout would give up early
    dist.barrier(group=aggs.group)
    for lane in aggs.lanes:         # every lane, on every rank: the rounds stay equal
        why = probe_lane(lane.client, cap) or why
    missed = agree_max([int(bool(why)) if r == aggs.rank else 0 for r in range(aggs.world)], aggs.group)
    # every job's rounds past the probe's, by two as after a failed step (agreement.py)
    st.rounds[:] = [r + PROBE_ROUNDS + 1 for r in st.rounds]
    if not any(missed):
        return False
    group = aggs.results.group
    if why:
        log.info("xagg: rank %d: the probe round through group %s: %s", aggs.rank, group, why)
    aggs.results = UNICAST
    ok, reason = 1, ""
    if aggs.rank == 0:
        aggs.request = {k: v for k, v in aggs.request.items() if k != "bcast_ip"} | {"fanout": UNICAST.fanout.label}
        ok, reason = aggs.register()
    ok = agree_max([ok if aggs.rank == 0 else 0], aggs.group)[0]
    aggs.remake_clients()
    ranks = [r for r, m in enumerate(missed) if m]
    if aggs.rank == 0:
        log.warning("xagg: results to multicast group %s did not reach rank(s) %s before the first step: the "
                    "job goes on with unicast fan-out (--fanout auto chose the group: %s; --fanout unicast "
                    "skips it, or let the switch forward the group)", group, ", ".join(map(str, ranks)),
                    aggs.choice.why)
    if not ok:
        st.fallback.fail(aggs.rank, f"registering the job with unicast fan-out failed: {reason}")
    return True
