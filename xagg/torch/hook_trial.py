"""``--compress auto``'s trial of whole steps: where the compression hook
may keep the job, each compressing method the start-up figures put within
TRY_EDGE of the fastest (the TRIES fastest at most, and one counted once
where those are all counted more: auto.hook_choice) runs a window of steps
with every bucket on it, then the per-bucket choice, and, where the
figures cannot tell the plain hook from the compression hook
(auto.hook_choice: neither predicted PLAIN_EDGE faster), the plain hook; the side whose steps were fastest
keeps the job. A bucket's own sum time misses what its method costs the
rest of the step (backward on shared cores, ranks waiting on one that
selects); a step's time holds it.

DDP takes one comm hook per model, so one is registered (``trial_hook``)
and it hands each bucket to the side in use: the compression hook
(xagg.compress.ddp) whose selector is the Auto that made the start-up
choice, pinned to a method or choosing per bucket (Auto.pin), or the plain
hook (its lanes, its overlap with backward). Both sum on the run's one
job, one after the other: a side's transport (an XaggState) is opened at
the first bucket of its first step and the other's closed, as every rank
does at the same bucket; each is opened once and started again at a later
change, going on from what its clients learned (XaggState.close(keep=True)):
its sums are predicted at once, not each summed twice. Once a side keeps
the job the other's transport lets go of what it held.

A step's time is what passes between the ends of two steps' last sums
(the last bucket's future done), so it holds the optimizer, forward,
backward and the step's own sums, and none of the step before's: timed
from the last bucket's hook call instead, a step's tail of sums went into
the next step's time, and the slow second step of a change made the
third, judged, look slow too. The first two steps of a side are not
counted: the first holds the change (up to twice a step), the second
what the first leaves behind (the plain hook settles a step's agreement
in the next; a method still fills its buffers and layout). A side's
first entry leaves a third step unjudged: its buffers are touched for the
first time over its first three steps (a page fault each, costly on a
loaded host), and a window that held the third judged a method slower
than it is. The first round tries every side: the first runs steps
0..2*window (step 0 is DDP's, before it rebuilds its buckets), each
later side window + 3 steps, and each is judged on its last ``window``.
No bucket is revisited inside a side, and the buckets' models keep what each method took on them, so the
per-bucket side chooses from measured times. At a round's end every rank
agrees on each side's median over all its judged steps (the slowest
rank's), so all make the same choice at the same bucket. A side's median
counts as many times as the selector counts its method (Auto.steps: a
sparse method's under an optimizer that rescales per coordinate; the
per-bucket side's, its buckets' options weighted by their elements).
Where sides are counted more than once, the plain hook's place is
``plain_when`` (auto.hook_choice says why): AFTER the others, only where
the fastest side's step, counted, took longer than the plain hook's
predicted sums; or FIRST, first in the first round. The sides counted
more than once then run only after the first round, and only where their
step, counted, could beat its fastest: that step less its predicted sums
is the model's own compute, which a counted step pays as many times as it
counts (a sparse method's figures are its sums alone: its selection's
share of the cores backward runs on shows only in whole steps, and its
window trains less). Where the fastest two are within ``edge`` of each other, a window
of steps is as likely to order them wrongly as rightly (steps on a shared
host vary by 10% and more), so they race another round, in the reverse of
the order they last ran (drift cancels; the side that ran last goes on
without uncounted steps), up to ``rounds`` rounds; steps spent on the
slower of two close sides cost little. A method and the per-bucket choice
within ``edge`` do not race: the method keeps the job either way (below),
and the per-bucket choice gives its place in a race to the next side
within ``edge``. Then the fastest side keeps the job (the per-bucket
choice only where no method is within ``edge`` of it): a method that
wins keeps every bucket; the per-bucket choice, if it wins, goes on
revisiting, its buckets off every method whose steps it beat by more than
``edge`` (Auto.bar: a bucket's sum time misses what made them slower).

Nothing sent is lost in a change: a bucket going to the plain hook puts
what its method had not sent yet (the selector's residual) into its first
plain sum, and the plain hook's 16-bit rounding residual, which its
transport keeps, goes into its next plain sum. Only that last residual
stays behind where the compression hook keeps the job (under one 16-bit
step an element).
"""
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from xagg.compress.auto import AFTER, BUCKETS, FIRST, LAST
from xagg.compress.ddp import HookState, ddp_hook
from xagg.torch.fallback import agree_max
from xagg.torch.hook import xagg_hook
from xagg.torch.state import XaggState

WINDOW = 3          # steps each side is judged on a round
ROUNDS = 4          # the first tries every side; each later one races the fastest two again
RACE_EDGE = 0.10    # the fastest two race on while the second is within this fraction of the first
UNCOUNTED = 2       # a side's first steps not judged: the change, then what it leaves behind
FIRST_UNCOUNTED = 3     # ... at its first entry: its buffers' first touch as well
PLAIN = "plain"


def trial_steps(window: int = WINDOW, sides: int = 2, rounds: int = ROUNDS) -> int:
    """The most steps a trial of ``sides`` sides takes before its side is chosen."""
    first = 2 * window + 1 + (sides - 1) * (window + FIRST_UNCOUNTED)
    return first + (rounds - 1) * 2 * (window + UNCOUNTED) if sides > 1 else first


@dataclass
class HookTrial:
    """The registered hook's state: its sides (``methods``, then the
    per-bucket choice, then the plain hook where it has ``lanes``), the step,
    what each side's steps took, and once chosen, the side that keeps the job."""
    buckets: HookState                          # the compression hook's state (its compressor an Auto)
    transport: XaggState                        # its collectives' job (XaggCollectives), open at the start
    open_plain: Callable[[], XaggState]         # -> the plain hook's XaggState, in its lanes (called once)
    lanes: int | None                           # the plain hook's (None: no plain side)
    methods: tuple = ()                         # compressing methods each tried on every bucket, in order
    group: object = None                        # the DDP model's process group
    window: int = WINDOW
    rounds: int = ROUNDS
    edge: float = RACE_EDGE
    plain_when: str = LAST                      # where the plain side runs (auto.HookChoice.plain_when)
    plain_s: float = 0.0                        # the plain hook's predicted sums for a step (seconds)
    sums: tuple = ()                            # (side, its predicted sums, counted, its count) (FIRST)
    said: Callable[[str], None] = print         # told the outcome's line once (every rank)
    clock: Callable[[], float] = time.perf_counter
    plain: Optional[XaggState] = None
    step: int = 0
    chosen: Optional[str] = None
    line: str = ""                              # the outcome, once chosen
    times: dict = field(default_factory=dict)   # side -> its steps' seconds
    judged: dict = field(default_factory=dict)  # side -> the seconds of its judged steps, every round
    plan: list = field(default_factory=list)    # step -> its side, to the end of the round
    round: int = 1
    _last: Optional[float] = None               # when the previous step's last sum was done
    _last_side: Optional[str] = None
    _run: int = 0                               # steps the side in use has run in a row, the last one's included
    _entered: Optional[str] = None              # the side the selector was last set for
    _fed: set = field(default_factory=set)      # buckets whose residual went into a plain sum
    _counted: dict = field(default_factory=dict)    # side -> how many times its time counts, where not 1

    def __post_init__(self):
        if not self.lanes:
            self.plain_when = LAST
        self.sides = ([PLAIN] if self.plain_when == FIRST else []) + [*self.methods, BUCKETS] + \
            ([PLAIN] if self.lanes and self.plain_when != FIRST else [])
        self.times = {s: [] for s in self.sides}
        self.judged = {s: [] for s in self.sides}
        # the first round: every side, the plain hook first where it runs first, not where it runs after;
        # a side counted more than once waits for the first round's figures (_second_round), unless
        # no method side would run before it
        ahead = [s for s in self.sides if s != PLAIN or self.plain_when != AFTER]
        self._later = [s for s, _, count in self.sums if count > 1 and s in ahead]
        if self.plain_when != FIRST and all(s in self._later for s in ahead if s != PLAIN):
            self._later = []
        first = [s for s in ahead if s not in self._later]
        self.plan = [first[0]] * (2 * self.window + 1)
        self._plan_round(first[1:])
        self._order = list(first)       # the sides of the last round, in the order they ran
        self._weighed = self.plain_when == LAST     # AFTER/FIRST: the plain hook's place weighed after round 1
        self._races = 0                             # rounds that raced the fastest two again

    def _plan_round(self, order) -> None:
        """A window for each side of ``order``; a side that changes from
        the step before it runs UNCOUNTED steps more (not judged), and
        FIRST_UNCOUNTED where it has not run before."""
        for s in order:
            unjudged = 0 if s == self.plan[-1] else UNCOUNTED if s in self.plan else FIRST_UNCOUNTED
            self.plan += [s] * (self.window + unjudged)

    def side(self) -> str:
        """The side this step's buckets go to; at a round's end (the step's
        first bucket, on every rank) the round is judged first."""
        if self.chosen is None and self.step >= len(self.plan):
            self.review()
        return self.chosen if self.chosen is not None else self.plan[self.step]

    def enter(self, side: str) -> None:
        """At a side's first bucket: the selector set for it (applied at its
        next sum, the same bucket on every rank)."""
        if side == self._entered:
            return
        self._entered = side
        if side != PLAIN:
            self._fed.clear()       # what it leaves goes into the plain hook's first sums, if that runs again
        if side == BUCKETS:         # revisits once it holds the job
            self.buckets.compressor.pin(None, revisit=self.chosen == BUCKETS)
        elif side != PLAIN:
            self.buckets.compressor.pin(side)

    @property
    def compressor(self):
        """The selector once it holds the job (the run's summary says what
        each bucket ended on), else None."""
        return self.buckets.compressor if self.chosen not in (None, PLAIN) else None

    def close(self) -> None:
        for st in (self.plain, self.transport):
            if st is not None:
                st.close()

    def use(self, side: str) -> None:
        """Open ``side``'s transport if it is closed, closing the other's:
        the plain hook's is made at its first use, then started again."""
        if side == PLAIN:
            if self.plain is None or not self.plain.started:
                self.transport.close(keep=self.chosen is None)
                self.plain = self.open_plain() if self.plain is None else self.plain.start()
        elif not self.transport.started:
            if self.plain is not None:
                self.plain.close(keep=self.chosen is None)
            self.transport.start()

    # -- what the steps took -------------------------------------------------------------
    def step_done(self, side: str) -> None:
        if side != PLAIN:       # the per-bucket side's options as this step left them
            self._counted[side] = self.buckets.compressor.steps(None if side == BUCKETS else side)
        now = self.clock()
        self._run = self._run + 1 if side == self._last_side else 1
        if self._last is not None and self._run > UNCOUNTED:
            self.times[side].append(now - self._last)
        self._last, self._last_side = now, side
        self.step += 1

    def review(self) -> None:
        """The round's judged steps (each side's last ``window``) added, every
        side's median agreed over ranks (each the slowest rank's, in
        microseconds); the fastest two race another round where they are
        within ``edge`` (``_racing``), else the fastest keeps the job
        (``decide``)."""
        for s in self._order:
            self.judged[s] += self.times[s][-self.window:]
        mine = [round(1e6 * statistics.median(self.judged[s])) if self.judged[s] else 0 for s in self.sides]
        took = dict(zip(self.sides, agree_max(mine, self.group)))
        us = self._counted_us(took)
        prefer = [PLAIN, BUCKETS, *self.methods]
        ranked = sorted((s for s in self.sides if us[s] > 0), key=lambda s: (us[s], prefer.index(s)))
        close = self._racing(ranked, us)
        second = [] if self._weighed else self._second_round(took, us)
        self._weighed = True
        if second and self.round < self.rounds:
            self.round += 1
            self._order = second
            self._plan_round(second)
        elif self.round < self.rounds and len(close) > 1:
            self.round += 1
            self._races += 1
            # the reverse of the order they last ran; a side that was not in that round after them
            self._order = [s for s in reversed(self._order) if s in close] + \
                [s for s in close if s not in self._order]
            self._plan_round(self._order)
        else:
            self.decide(took, self._steady(ranked, us) if ranked else self.sides[0])

    def _racing(self, ranked: list, us: dict) -> list:
        """The fastest two of the sides ``ranked`` (by counted step) within
        ``edge`` of the fastest, but not the per-bucket choice where a method
        is within it: the method keeps the job whichever of the two is faster
        (``_steady``), and a race would hand it to the per-bucket choice only
        where later windows put that more than the edge ahead over all the
        judged steps, a chance each round pays for with two changes of method
        and a window of each. Left in, it took the place of a method within
        the edge whose one window had been unlucky, and the side it raced
        kept the job."""
        close = [s for s in ranked if us[s] <= us[ranked[0]] * (1 + self.edge)]
        if BUCKETS in close and any(s in self.methods for s in close):
            close.remove(BUCKETS)
        return close[:2]

    def _counted_us(self, took: dict) -> dict:
        """Each side's agreed median (microseconds) times the count of its steps."""
        return {s: round(t * self._counted.get(s, 1.0)) for s, t in took.items()}

    def _steady(self, ranked: list, us: dict) -> str:
        """The fastest side (``ranked``, by counted step), unless that is the
        per-bucket choice and a method's counted step is within ``edge`` of
        it: then the fastest such method. The per-bucket choice goes on
        moving buckets by their sum times, which miss what a method costs the
        rest of the step; a pinned method sums as it was measured. Only a
        win by more than noise gives the job to the side that keeps changing."""
        best = ranked[0]
        if best != BUCKETS:
            return best
        near = [s for s in ranked[1:] if s in self.methods and us[s] <= us[best] * (1 + self.edge)]
        return near[0] if near else best

    def _second_round(self, took: dict, us: dict) -> list:
        """The sides to run after the first round, where the plain hook's
        place and the sides counted more than once were left to it (agreed
        figures: the same on every rank). A side counted more than once runs
        where its step, counted, could beat the first round's fastest: that
        step less its predicted sums is the model's own compute, which a
        side's counted step pays as many times as it counts, plus its counted
        sums. Then (AFTER) the plain hook, where the fastest step, counted,
        took longer than the plain hook's predicted sums."""
        ran = [s for s in self.sides if us[s] > 0]
        if not ran:
            return []
        best = min(ran, key=lambda s: us[s])
        fastest = us[best] / 1e6
        predicted = {PLAIN: self.plain_s, **{side: sums / count for side, sums, count in self.sums}}
        own = max(0.0, took[best] / 1e6 - predicted.get(best, took[best] / 1e6))
        later = [side for side, sums, count in self.sums if side in self._later and count * own + sums < fastest]
        return later + ([PLAIN] if self.plain_when == AFTER and fastest > self.plain_s else [])

    def decide(self, us: dict, chosen: str) -> str:
        """``chosen`` keeps the job; rank 0's line says every side's agreed
        median (``us``, microseconds) and what it counted as, where not itself."""
        self.chosen = chosen
        self._entered = None            # the winner is set anew: its revisits, its pin for good
        loser = self.transport if chosen == PLAIN else self.plain
        if loser is not None and not loser.started:
            loser.close()               # what it kept for another window goes
        # the methods whose whole steps the per-bucket choice beat by more than noise: its buckets keep off
        # them (a bucket's sum time, which its revisits go by, misses what they cost the rest of the step)
        counted = self._counted_us(us)
        barred = [m for m in self.methods if chosen == BUCKETS and counted[m] > counted[BUCKETS] * (1 + self.edge)]
        self.buckets.compressor.bar(barred)
        what = {PLAIN: f"plain hook, {self.lanes}-bit lanes",
                BUCKETS: "per-bucket methods in the compression hook"}.get(
                    self.chosen, f"every bucket on {self.chosen} in the compression hook")
        named = {PLAIN: "plain hook", BUCKETS: "per-bucket methods"}
        took = ", ".join(f"{named.get(s, s)} {us[s] / 1e3:.0f} ms" + (
            f" (counted {self._counted[s]:.3g}x)" if self._counted.get(s, 1.0) != 1.0 else "")
            for s in self.sides if us[s] > 0)
        if PLAIN in self.sides and not us[PLAIN]:
            took += ", plain hook not run (its sums alone predicted longer)"
        skipped = [named.get(s, s) for s in self.sides if s != PLAIN and not us[s]]
        if skipped:
            took += f", not run: {', '.join(skipped)} (could not beat the first round's fastest step, counted)"
        steps = f"{self.window} steps" if self.window > 1 else "1 step"
        raced = ""
        if self._races:
            raced = (f"; {' and '.join(named.get(s, s) for s in self._order)} raced {self._races} more "
                     f"round(s), {len(self.judged[self._order[0]])} steps each")
        why = f"; its buckets keep off {', '.join(barred)}, slower by whole steps" if barred else ""
        if chosen in self.methods and counted.get(BUCKETS, 0) and counted[BUCKETS] < counted[chosen]:
            why = (f"; {chosen} within {100 * self.edge:.0f}% of the per-bucket methods, which go on "
                   "changing their buckets: the pinned method keeps the job")
        self.line = (f"compress auto: {what}, measured a step: {took} "
                     f"(the slowest rank's median of {steps} each{raced}){why}")
        self.said(self.line)
        return self.chosen

    # -- residuals ---------------------------------------------------------------------
    def feed_residual(self, bucket: dist.GradBucket) -> None:
        """Put what the per-bucket method left for ``bucket`` into its buffer."""
        name = f"bucket{bucket.index()}"
        if name in self._fed:
            return
        self._fed.add(name)
        buf = bucket.buffer()
        layers = [p.numel() for p in bucket.parameters()]
        flat, r = self.buckets.compressor.take_residual(name, buf.detach().to("cpu", torch.float32), layers)
        if r is not None:
            buf.copy_(flat.view(buf.shape).to(buf.device, buf.dtype))


# no ``from __future__ import annotations`` here: DDP checks the hook's bucket annotation is dist.GradBucket
def trial_hook(t: HookTrial, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    side = t.side()
    t.enter(side)
    t.use(PLAIN if side == PLAIN else BUCKETS)
    if side == PLAIN:
        t.feed_residual(bucket)
        fut = xagg_hook(t.plain, bucket)
    else:
        fut = ddp_hook(t.buckets, bucket)
    if not bucket.is_last():
        return fut

    def step_done(f, side=side):   # DDP waits for this future: the step is counted before the next one starts
        t.step_done(side)
        return f.value()
    return fut.then(step_done)
