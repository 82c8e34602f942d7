"""The cost model behind ``--compress auto``: per bucket, is the dense sum
or a compression method faster here, now?

A method costs a rank, for an n-element bucket,

    scale * (fixed + per_elem * n + wire * n * inv_rate + rounds * round_s) + extra

``fixed``/``per_elem``: compress + decompress compute, measured on this
host; ``wire``: bytes on the busier direction of the rank's link per
element; ``rounds``: collectives per sum; ``inv_rate``: seconds per byte of
the path the sums take; ``round_s``: what one collective costs beyond its
bytes. ``scale`` and ``extra`` make the formula meet one probe sum on the
real path at start (scale_for): what it took beyond the formula (a gather
over gloo instead of the aggregator, an exactness round of the transport,
a round's Python) is added per call; a probe faster than the formula
scales it down. Dense is a method like any other (wire 4, one round).

Once an option has run on a bucket, its measured time replaces the
formula: ``Seen(t, inv)`` is the time it took when the path cost ``inv``
seconds per byte, and it predicts ``t + wire * n * (inv_now - inv)``. An
observation of the option in use both records its time and moves the
bucket's ``inv_rate`` (the part of a change in time the link explains), so
every other option's prediction follows the link as it drifts. A method
that is slow for a reason the formula misses is thus judged by what it
took, never by the formula again.

Nothing here measures or talks to the network: the inputs are agreed
figures (every rank holds the same), so every rank computes the same
choice (selector.py feeds it; tests/test_compress_auto.py is the table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

DENSE = "dense"
MIN_INV_RATE = 1e-12        # seconds per byte: a terabyte per second, where a fit would go to 0 or below
NET_SHARE = 0.5             # an option's time says how the link moved only where its bytes are this much of it
MAX_REALITY = 1.5           # the most a step's sums are taken to exceed their formulas (options not run)


@dataclass(frozen=True)
class Cost:
    """What a method costs one rank, measured at start."""
    fixed: float            # seconds per call of compute (compress + decompress)
    per_elem: float         # seconds per element of compute
    wire: float             # bytes per element on the busier direction of the link
    rounds: int             # collectives per sum
    scale: float = 1.0      # measured on the real path / predicted by the formula, where that was less
    extra: float = 0.0      # seconds per call measured on the real path beyond the formula, where it was more
    steps: float = 1.0      # its steps that train as far as one step of exact sums: its time counts this
                            # many times (a sparse method's under an optimizer that rescales per coordinate)


@dataclass(frozen=True)
class Path:
    inv_rate: float         # seconds per byte
    round_s: float          # seconds per collective beyond its bytes


@dataclass(frozen=True)
class Seen:
    t: float                # seconds one sum of the bucket took (agreed over ranks)
    inv_rate: float         # the path's seconds per byte when it did


@dataclass
class BucketModel:
    """One bucket's state: its size, the option in use, the path as last
    inferred, and what each option that ran on it took."""
    n: int
    choice: str
    inv_rate: float
    seen: dict = field(default_factory=dict)    # option -> Seen
    changes: int = 0                            # times its option changed: each doubles the margin


def formula(c: Cost, n: int, path: Path, inv_rate: float | None = None) -> float:
    inv = path.inv_rate if inv_rate is None else inv_rate
    return c.scale * (c.fixed + c.per_elem * n + c.wire * n * inv + c.rounds * path.round_s) + c.extra


def reality(costs: dict, b: BucketModel, path: Path) -> float:
    """How much slower than its formula the option closest to its formula ran
    on bucket ``b`` (1 before any ran; within [1, MAX_REALITY]). The formulas
    are scaled to a probe sum run alone at start; what they miss in a
    training step (the host's load, backward's compute beside the sums)
    slows every option alike, so an option not run here is predicted that
    much slower too: only an option slower than the step explains (beyond
    MAX_REALITY) sends the bucket trying another, a window of steps each."""
    ratios = [s.t / f for m, s in b.seen.items() if (f := formula(costs[m], b.n, path, s.inv_rate)) > 0]
    return min(MAX_REALITY, max(1.0, min(ratios, default=1.0)))


def predict(costs: dict, b: BucketModel, path: Path) -> dict:
    """Option -> predicted seconds for bucket ``b`` on the path as it is now,
    counted ``steps`` times (what a step of exact sums' training costs)."""
    out, real = {}, reality(costs, b, path)
    for name, c in costs.items():
        s = b.seen.get(name)
        out[name] = c.steps * ((s.t + c.wire * b.n * (b.inv_rate - s.inv_rate)) if s else
                               real * formula(c, b.n, path, b.inv_rate))
    return out


def choose(costs: dict, b: BucketModel, path: Path, margin: float, explore: float = 0.0,
           barred: frozenset = frozenset()) -> str:
    """The option to use from now on: the fastest predicted, unless the one
    in use is within ``margin`` (a fraction) of it (no switching on noise),
    doubled for each change the bucket made: options whose windows differ
    by less than their noise converge instead of taking turns.
    An option not yet run on the bucket while others have is judged by its
    formula plus ``explore`` (a fraction): trying it costs a window of
    steps, and a formula is less sure than a measured time. Ties go to the
    earlier option in ``costs``, so dense wins a tie when it is listed first.
    ``barred`` options are taken by no bucket not already on one."""
    pred = predict(costs, b, path)
    if b.seen:
        pred = {m: t if m in b.seen else t * (1 + explore) for m, t in pred.items()}
    best = min((m for m in pred if m not in barred or m == b.choice), key=lambda m: (pred[m], list(costs).index(m)))
    cur = pred.get(b.choice)
    if cur is not None and cur <= pred[best] * (1 + margin * 2 ** b.changes):
        return b.choice
    return best


def observe(costs: dict, b: BucketModel, t: float) -> BucketModel:
    """``b`` after its option in use took ``t`` seconds (agreed): the time is
    recorded, and where the option ran before and its bytes are most of its
    time, the change is put on the path (its bytes are what the path's rate
    acts on), at most halving or doubling it per window. An option whose
    time is mostly compute says nothing about the link: its noise, put on
    its few bytes, would swing every other option's prediction."""
    c, s = costs[b.choice], b.seen.get(b.choice)
    inv, wire = b.inv_rate, c.wire * b.n
    if s is not None and wire > 0 and wire * s.inv_rate >= NET_SHARE * s.t:
        inv = min(2 * s.inv_rate, max(s.inv_rate / 2, s.inv_rate + (t - s.t) / wire, MIN_INV_RATE))
    return replace(b, inv_rate=inv, seen={**b.seen, b.choice: Seen(t, inv)})


def fit_path(dense: Cost, n_small: int, t_small: float, n_big: int, t_big: float) -> Path:
    """The path from two dense sums of the real transport, of ``n_small`` and
    ``n_big`` elements: the bytes' cost is what grows with the size, the
    per-collective cost what stays."""
    d = dense
    inv = ((t_big - d.per_elem * n_big) - (t_small - d.per_elem * n_small)) / (d.wire * (n_big - n_small))
    inv = max(MIN_INV_RATE, inv)
    round_s = max(0.0, (t_small - d.fixed - d.per_elem * n_small - d.wire * n_small * inv) / d.rounds)
    return Path(inv, round_s)


def scale_for(c: Cost, n: int, path: Path, t: float) -> Cost:
    """``c`` made to give ``t`` (measured on the real path at ``n``
    elements). A probe slower than its formula spent the rest on what the
    formula does not see, per call: its own agreements, a round's Python,
    its buffers' first layout. A bucket of any size pays that once, so it is
    added per call (``extra``): scaled instead, a method whose probe carried
    a few such milliseconds was predicted that many times slower on every
    byte of a bucket ten times the probe. A probe faster than its formula
    found the path faster for its packets than the dense sums it was fitted
    on, which acts on every byte: the formula is scaled down."""
    base = formula(replace(c, scale=1.0, extra=0.0), n, path)
    if base <= 0:
        return replace(c, scale=1.0, extra=max(0.0, t))
    return replace(c, scale=1.0, extra=t - base) if t >= base else replace(c, scale=t / base, extra=0.0)


# The compression hook sums its buckets one after another on one thread, each
# round a synchronous round trip; the plain hook's overlap backward and each
# other in lanes, so its sums must be predicted this much slower before the
# compression hook takes the job outright. Where the plain hook is not
# predicted this much faster than the compressing methods either, the
# formulas cannot tell (they see neither the overlap nor the host's load in
# a training step): both are tried, a window of steps each, and the
# measured step times choose (xagg/torch/hook_trial.py).
PLAIN_EDGE = 1.5
LAST, FIRST, AFTER = "last", "first", "after"   # where a trial runs the plain hook: HookChoice.plain_when
BUCKETS = "per-bucket"                          # the trial's side of the per-bucket choice
# Inside the compression hook, the methods whose sums are predicted within
# this factor of the fastest are each tried on every bucket, a window of
# steps each, before the per-bucket choice. Wide: a sum's figures miss what
# a method's compute costs the rest of the step (backward on shared cores,
# the ranks it makes wait), which whole steps show: iwp's sum is predicted
# as its picking rank's, yet only one rank of N picks, and on hosts whose
# ranks share cores its steps were the fastest where its sums were
# predicted over 1.5x slower than rgc's. At most the TRIES fastest of them:
# each side costs a window of steps on an option that is slower or trains
# less, and in the trials measured the winner was among the three
# predicted fastest (docs/compression.md). Where those are all counted more
# than once, the fastest counted once within the edge is tried too: a
# counted figure's miss grows with its count, so methods whose steps train
# less crowd out on paper one that was faster by whole steps (int8 against
# rgc, mstopk and iwp on the wide model at MTU 9000).
TRY_EDGE = 3.0
TRIES = 3


@dataclass(frozen=True)
class HookChoice:
    """The job's hook, chosen before its first sum: the plain hook in
    ``lanes``-bit lanes, or (``lanes`` None) the compression hook's
    per-bucket choice; ``trial``: the compressing methods first (each bucket
    on its fastest), then the plain hook, and the faster by measured step
    time keeps the job."""
    lanes: int | None
    plain_s: float          # predicted seconds of a step's sums in the plain hook
    buckets_s: float        # ... with each bucket on its fastest option
    methods_s: float = math.inf     # ... on its fastest option the lanes are not (a compressing method)
    trial: bool = False
    methods: tuple = ()     # compressing methods each tried on every bucket first (where the compression
                            # hook may keep the job), fastest predicted first
    plain_when: str = LAST  # in a trial, where the plain hook runs: LAST, FIRST or AFTER (hook_choice)
    sums: tuple = ()        # (side, its predicted sums for a step, counted, its count): the methods' and
                            # per-bucket's (its buckets' fastest options' counts, weighted by elements)

    def line(self) -> str:
        pred = (f"predicted {1e3 * self.plain_s:.0f} ms for the plain hook vs "
                f"{1e3 * self.buckets_s:.0f} ms for per-bucket methods")
        tries = "".join(f"every bucket on {m}, " for m in self.methods)
        later = "; those counted more than once where their steps, counted, could beat the others' fastest"
        if self.plain_when == AFTER:
            return (f"compress auto: trying {tries}per-bucket methods, a window of steps each{later}, then the "
                    f"plain hook in {self.lanes}-bit lanes if their steps, counted, take longer than its sums "
                    f"({pred}, counted)")
        if self.plain_when == FIRST:
            return (f"compress auto: trying the plain hook in {self.lanes}-bit lanes, then {tries}per-bucket "
                    f"methods, a window of steps each{later} ({pred}, counted)")
        if self.trial:
            return (f"compress auto: trying {tries}per-bucket methods, then the plain hook in {self.lanes}-bit "
                    f"lanes, a window of steps each ({pred}, {1e3 * self.methods_s:.0f} ms with every bucket "
                    "compressed)")
        if self.lanes:
            return f"compress auto: plain hook, {self.lanes}-bit lanes ({pred}, which must win by {PLAIN_EDGE}x)"
        then = f", trying {tries}then per-bucket methods, a window of steps each" if self.methods else ""
        return f"compress auto: the compression hook{then} ({pred}, which must win by {PLAIN_EDGE}x)"


def hook_choice(costs: dict, path: Path, sizes: list, lanes: dict) -> HookChoice:
    """The plain hook in the faster of its ``lanes`` (bits -> the option its
    sums are: 32 dense, 16 int16 where lossy lanes are allowed) or the
    per-bucket choice, for buckets of ``sizes`` elements: a pure function of
    agreed figures, so every rank chooses alike. The per-bucket choice
    outright where predicted PLAIN_EDGE faster than the plain hook; the plain
    hook outright where it is predicted PLAIN_EDGE faster than the buckets
    each on a compressing method (or there is none); else a trial.
    ``methods`` (for where the compression hook may keep the job): the compressing
    methods whose sums, every bucket on one, are predicted within
    TRY_EDGE of the fastest such, fastest first, at most TRIES, for the trial to try,
    and where those are all counted more than once, the fastest counted once as well.
    Every figure is counted ``steps`` times (Cost). Where some compressing
    method's is counted more than once (its steps train less), a sum's
    figure misses what its method costs the rest of the step, and counted,
    the miss grows with the count, while every trial step on such a method
    costs training: the per-bucket choice does not take the job outright;
    where it would, the plain hook runs AFTER the methods, only if their
    measured steps, counted, take longer than its predicted sums (a step
    holds its sums: on a slow link it cannot win, and a window of its steps
    would be the trial's longest); in a trial, it runs FIRST. Either way a
    side counted more than once runs only after the others, where its step,
    counted, could beat their fastest: that step less its predicted sums is
    the model's own compute, which a counted step pays as many times
    (``sums``: each side's counted figure and count, for that bound;
    xagg/torch/hook_trial.py)."""
    def counted(m, n):
        return costs[m].steps * formula(costs[m], n, path)

    def fastest(options, n):
        return min((counted(m, n) for m in options), default=math.inf)

    def fastest_steps(n):       # the count of the option a bucket of n elements is predicted to take
        return costs[min(costs, key=lambda m: (counted(m, n), list(costs).index(m)))].steps
    plain = {bits: sum(counted(m, n) for n in sizes) for bits, m in lanes.items()}
    bits = min(plain, key=lambda b: (plain[b], -b))
    per = sum(fastest(costs, n) for n in sizes)
    compressing = [m for m in costs if m not in lanes.values()]
    methods = sum(fastest(compressing, n) for n in sizes)
    whole = {m: sum(counted(m, n) for n in sizes) for m in compressing}
    best = min(whole.values(), default=math.inf)
    near = [m for m in sorted(whole, key=lambda m: (whole[m], compressing.index(m))) if whole[m] <= TRY_EDGE * best]
    tries = tuple(near[:TRIES])
    once = next((m for m in near if costs[m].steps == 1), None)
    if once is not None and all(costs[m].steps > 1 for m in tries):
        tries += (once,)
    any_counted = any(costs[m].steps > 1 for m in compressing)
    per_steps = sum(n * fastest_steps(n) for n in sizes) / sum(sizes) if sizes else 1.0
    sums = (*((m, whole[m], costs[m].steps) for m in tries), (BUCKETS, per, per_steps))
    if plain[bits] > PLAIN_EDGE * per:
        if any_counted:
            return HookChoice(bits, plain[bits], per, methods, trial=True, methods=tries, plain_when=AFTER,
                              sums=sums)
        return HookChoice(None, plain[bits], per, methods, methods=tries)
    trial = methods <= PLAIN_EDGE * plain[bits]
    return HookChoice(bits, plain[bits], per, methods, trial=trial, methods=tries,
                      plain_when=FIRST if trial and any_counted else LAST, sums=sums if trial and any_counted else ())
