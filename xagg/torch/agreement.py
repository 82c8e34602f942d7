"""What the ranks agree on at the end of a step, as data: what each rank
posts, how the agreed vector reads, and what every rank does about it.

The engine (engine.py) sums a step's buckets on its lanes (lanes.py), one
xagg round per bucket. At the last bucket of a step every rank posts a few
integers on the rendezvous store (board.py), which takes the elementwise
maximum over ranks. ``post`` says what a rank posts, ``read`` names the
fields of the maximum, and ``decide`` turns it into a ``StepDecision``; the
engine only executes decisions. Nothing here touches a socket, a thread or
torch, so the rule is tested as a table (tests/test_agreement.py).

**The agreement rule.** A bucket may succeed on one rank and fail on another
(rank A got every result, rank B lost the last one when the aggregator
died). So every rank posts two numbers per bucket (failed here? succeeded
here?) and whether all its buckets succeeded. Per bucket:

* succeeded everywhere: the aggregator's sum, bit-identical on all ranks (KEEP);
* succeeded somewhere: a rank that has the sum broadcasts it to the others
  (FROM_RANK; the highest such rank, so every rank names the same one);
* failed everywhere: reduced again over gloo from the original tensors (REDO).

The decision is the same on every rank (it reads only the agreed vector),
so every rank issues the same collectives in the same order. Broadcasts and
reductions run on a private gloo group, which carries only these recoveries
and the fallback's reductions. So DDP never sees mixed or partial sums.

**A rank whose buckets all succeeded completes its futures at once and does
not wait for the agreement**: an aggregator that finished every chunk had
every rank's every chunk, so the sum it holds is the sum, and a rank that
missed it gets it from this one. Such a rank reads the agreement in the
background and acts on it before it issues its next collective. Only a rank
with a failed bucket waits for the agreement before completing its futures.

**Mode switches happen at the same step on every rank.** A failure agreed
for step s moves every rank to gloo after step s + 1 (ranks that did not
wait learn of it only later), or after step s itself when no rank had all
its buckets (then every rank waited). Of two switches pending, the earlier
wins (``sooner``).

**Rounds stay equal across ranks, lane by lane.** Every bucket uses a round
number of its lane on every rank, attempted or not, and a second one where
the client sums some chunks again (a missed exponent prediction,
xagg/client/allreduce.py): every rank that got the first round's results
decides that alike, and a rank that failed a bucket takes the highest round
count of every lane from the agreement before its next step.

**Retry after a back-off.** After a failure every rank is on gloo for
``backoff`` steps (fallback.py), then rank 0 re-registers the job (when it
registers) and the ranks agree again (``post_retry``, ``decide_retry``) on
success, on every lane's round, and on the set of aggregators rank 0's
registration left (aggregators.py). Back on xagg, rounds restart at
max(round over ranks) + 2, past every round used, so the partial slots an
abandoned round left are superseded by the next round of the same parity
(bpf/xagg_slot.h slot_step) and its late packets are dropped as stale.

A rank that fails a bucket skips xagg for the buckets its lanes start after
that in the step (the others then time out on them), so one failure costs a
few timeouts, whatever the number of buckets.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class How(enum.Enum):
    """Where a bucket's final sum comes from."""
    KEEP = "keep"               # the aggregator's sum, which every rank holds
    FROM_RANK = "from rank"     # broadcast by the rank that holds it
    REDO = "redo"               # summed again over the process group (gloo)


@dataclass(frozen=True)
class Fate:
    how: How
    rank: int = -1              # FROM_RANK: the rank that broadcasts its sum


KEEP, REDO = Fate(How.KEEP), Fate(How.REDO)


def from_rank(rank: int) -> Fate:
    return Fate(How.FROM_RANK, rank)


@dataclass(frozen=True)
class Switch:
    """An agreed move of every rank to gloo."""
    after: int                  # the step after which it happens
    reason: str
    first: bool                 # a new fallback (False: a retry that failed)


@dataclass(frozen=True)
class StepDecision:
    fates: tuple[Fate, ...]             # per bucket of the step, in order
    rounds: tuple[int, ...] | None      # this rank's rounds per lane from now on (None: its own)
    switch: Switch | None               # None: nothing failed anywhere
    succeeded: bool                     # every bucket succeeded on every rank


@dataclass(frozen=True)
class Agreed:
    """The maximum over ranks of what each posted for one step."""
    failed_by: tuple[int, ...]      # per bucket: 1 + the highest rank that failed it; 0: none did
    held_by: tuple[int, ...]        # per bucket: 1 + the highest rank that has its sum; 0: none
    anyone_all_ok: bool             # some rank had every bucket of the step
    rounds: tuple[int, ...]         # per lane: the highest next round


def post(rank: int, failed: Sequence[bool], rounds: Sequence[int]) -> list[int]:
    """What ``rank`` posts for a step whose buckets ``failed`` here or not,
    with its lanes' next ``rounds``: ranks are posted as rank + 1, so the
    maximum names the highest rank and 0 names none."""
    me = rank + 1
    return ([me if f else 0 for f in failed] + [0 if f else me for f in failed]
            + [0 if any(failed) else 1, *rounds])


def read(values: Sequence[int], buckets: int) -> Agreed:
    """The fields of the agreed vector of a step of ``buckets`` buckets."""
    nb = buckets
    return Agreed(tuple(values[:nb]), tuple(values[nb:2 * nb]), bool(values[2 * nb]), tuple(values[2 * nb + 1:]))


def decide(agreed: Agreed, step: int, failed_here: Sequence[bool], rounds_here: Sequence[int],
           reason_here: str = "", retrying: bool = False) -> StepDecision:
    """What this rank does about step ``step``'s agreement: ``failed_here``
    and ``rounds_here`` are what it posted, ``reason_here`` why its bucket
    failed, ``retrying`` whether xagg is on trial after a back-off (then a
    failure is a failed retry, not a new fallback)."""
    fates = tuple(KEEP if not f else from_rank(src - 1) if src else REDO
                  for f, src in zip(agreed.failed_by, agreed.held_by))
    mine = any(failed_here)
    # a rank that failed a bucket may not know of a second round the others
    # took for it: it goes on from theirs, lane by lane
    rounds = tuple(max(m, t) for m, t in zip(rounds_here, agreed.rounds)) if mine else None
    switch = None
    if any(agreed.failed_by):
        reason = (reason_here if mine else "") or \
            f"rank {max(agreed.failed_by) - 1} got no answer from the aggregators"
        # a rank that had everything learns of the failure only after its next step
        switch = Switch(step + 1 if agreed.anyone_all_ok else step, reason, not retrying)
    return StepDecision(fates, rounds, switch, switch is None)


def sooner(pending: Switch | None, new: Switch | None) -> Switch | None:
    """Of a switch already agreed and a new one, the one that happens first."""
    if new is None or (pending is not None and pending.after <= new.after):
        return pending
    return new


@dataclass(frozen=True)
class RetryDecision:
    back: bool                      # every rank can: back on xagg
    rounds: tuple[int, ...] | None  # every lane's next round when back (None: unchanged)
    out: int                        # when back: the aggregators planned out (bit k: aggregator k)


def post_retry(rank: int, failed_here: bool, rounds: Sequence[int], proposed_out: int) -> list[int]:
    """What ``rank`` posts when the ranks agree whether to try xagg again:
    rank 0 posts the set its registration left out, the others 0, so the
    maximum is rank 0's."""
    return [int(failed_here), *rounds, proposed_out if rank == 0 else 0]


def decide_retry(values: Sequence[int]) -> RetryDecision:
    """The retry's agreed vector read: back on xagg when no rank failed, with
    every lane's rounds moved past every round any rank used."""
    failed, *tops, out = values
    if failed:
        return RetryDecision(False, None, 0)
    return RetryDecision(True, tuple(top + 2 for top in tops), out)


# -- the re-plan check (replan.py) --------------------------------------------------
SCALE = 10**9               # weights travel as integers: weight x SCALE


@dataclass(frozen=True)
class ReplanDecision:
    switch: bool                    # rank 0 proposed a split and no rank failed a bucket of the step
    rounds: tuple[int, ...]         # every lane's highest round
    weights: list[float] | None     # the new split (switch only)
    routes: list | None             # per rank, per aggregator: the tree's routes (None: flat)


def post_replan(proposal: tuple | None, failed_here: bool, rounds: Sequence[int], aggregators: int,
                world: int) -> list[int]:
    """What a rank posts at a re-plan check: rank 0's ``proposal`` (weights,
    routes or None; None on the other ranks) as integers, so every rank
    decodes the same bits, each route + 1 (zeros: a flat plan); whether a
    bucket of the step failed here; its rounds."""
    m = aggregators
    ints = [round(w * SCALE) for w in proposal[0]] if proposal else [0] * m
    hops = [c + 1 for row in proposal[1] for c in row] if proposal and proposal[1] else [0] * (world * m)
    return [int(proposal is not None), int(failed_here), *rounds, *ints, *hops]


def decide_replan(values: Sequence[int], lanes: int, aggregators: int, world: int) -> ReplanDecision:
    """The re-plan check's agreed vector read: switch to rank 0's proposal
    unless a rank failed a bucket of the step (its agreement moves the job
    to gloo anyway)."""
    m = aggregators
    want, failed, *rest = values
    top, ints, hops = tuple(rest[:lanes]), rest[lanes:lanes + m], rest[lanes + m:]
    if not want or failed:
        return ReplanDecision(False, top, None, None)
    routes = [[c - 1 for c in hops[w * m:(w + 1) * m]] for w in range(world)] if any(hops) else None
    return ReplanDecision(True, top, [v / SCALE for v in ints], routes)
