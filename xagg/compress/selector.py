"""``auto``: per bucket, the dense sum or the method predicted fastest.

At its first sum every rank measures each candidate's compute on this
host (calibrate.py) and times dense and every candidate once on the real
transport; the ranks agree on the figures (the maximum over ranks, through
one all-gather), and each bucket starts on the option auto.py predicts
fastest. Every ``every`` steps the ranks agree again on what each bucket's
sums took (the slowest rank's median over the window) and every rank feeds
the same figures to the same model, so each makes the same choice without
sending it. A window in which some bucket tries an option it never ran is
``trial`` steps long: what a try costs is paid over fewer steps. Residuals
live in one memory shared by all candidates, so a bucket that changes
method keeps what it had not sent; a bucket going dense sends it with its
next sum. A trial of whole steps (xagg/torch/hook_trial.py) ``pin``s every
bucket on one method a window at a time, and the buckets' models keep what
each took.
"""

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from xagg.compress import auto
from xagg.compress.auto import DENSE, BucketModel
from xagg.compress.base import Compressor, Part, Payload, exchange, layer_runs
from xagg.compress.calibrate import compute_cost, timed_sum
from xagg.compress.intsum import all_finite
from xagg.compress.optimizers import rescale_said

log = logging.getLogger("xagg.compress")
HOOKS = ("auto", "try", "plain", "buckets")
SPARSE_OPTIONS = ("auto", "on", "off")
SMALL = 1024                # elements of the probe sum that is almost all per-collective cost
LOOK = 16                   # the start-up's first look at the link: a dense sum of 1/LOOK of the probe's elements
PROBE_S = 0.25              # seconds the link takes for the dense probe at that look, at most: the probe is cut
                            # to fit (on a slow link every candidate's probe at full size cost seconds of step 0)
TIMES_KEPT = 64             # a bucket's sum times a window's median is taken over, at most
LANE_OPTIONS = {32: DENSE, 16: "int16"}     # lane bits -> the option the plain hook's lanes sum as


@dataclass
class Auto(Compressor):
    """auto:methods=int16+rgc,every=5,trial=3,margin=0.03,explore=0.2 -
    per bucket, dense or the candidate (default: every other method, with
    its defaults) predicted fastest from this host's measured compute and
    the path's measured rate, revisited every ``every`` steps (``trial``
    after a bucket moves to an option it has not run). ``hook``: how
    ``xagg-client run`` picks the job's hook: auto (from the same figures;
    where the compression hook may keep the job, a trial of ``hook_steps``
    steps a side: every bucket on each method predicted near the fastest,
    then the per-bucket choice, and the plain hook where the figures cannot
    tell it from them; the fastest two race again while close, up to
    ``hook_rounds`` rounds in all; the fastest side keeps the job), try (always the
    plain hook in the trial), plain, or buckets (the per-bucket choice, no
    trial). ``sparse``: how the methods whose sums carry a few coordinates a
    step (rgc, mstopk, iwp, sketch, lossless) are candidates: on (at their
    time), off (not), or auto: a method whose step trains less far than one
    of exact sums (``STEPS``: every sparse method's, iwp's and sketch's
    most) has its time counted ``STEPS`` times; where the model's optimizer
    rescales each coordinate by its own history, as Adam does, its time
    counts ``sparse_steps`` times that (default 2: not for how far its steps
    train, which on a GPT under AdamW was as ``STEPS`` says, but so that a
    trial there does not spend steps on sparse methods the plain hook beats
    by far; xagg/compress/optimizers.py)."""
    methods: str = "all"        # candidates, '+'-separated; all: every registered method
    every: int = 5              # steps between revisits
    trial: int = 3              # steps between revisits while a bucket tries an option new to it (at most every)
    margin: float = 0.03        # switch only for a predicted gain above this fraction
    explore: float = 0.2        # an option not yet run on a bucket must win by this fraction more
    probe: int = 1 << 20        # elements of the start-up sums on the real transport (fewer on a slow link)
    hook: str = "auto"          # the job's hook: auto (from the figures; tried where too close), try, plain, buckets
    hook_steps: int = 3         # steps each side of a trial is judged on, a round
    hook_rounds: int = 4        # a trial's rounds at most: every side, then races of the fastest two while close
    sparse: str = "auto"        # sparse methods as candidates: on, off, auto (counted STEPS times, and
                                # sparse_steps times that under an optimizer that rescales per coordinate)
    sparse_steps: float = 2.0   # a sparse step's time counts this many times more there (sparse=auto)

    NAME = "auto"
    costs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    buckets: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        from xagg.compress.registry import METHODS, get_compressor     # the registry lists auto too
        super().__post_init__()
        self._check("every", self.every >= 1, "must be >= 1")
        self._check("trial", self.trial >= 1, "must be >= 1")
        self._check("margin", self.margin >= 0, "must be >= 0")
        self._check("explore", self.explore >= 0, "must be >= 0")
        self._check("probe", self.probe >= 4, "must be >= 4")
        self._check("hook", self.hook in HOOKS, f"must be one of {', '.join(HOOKS)}")
        self._check("hook_steps", self.hook_steps >= 1, "must be >= 1")
        self._check("hook_rounds", self.hook_rounds >= 1, "must be >= 1")
        self._check("sparse", self.sparse in SPARSE_OPTIONS, f"must be one of {', '.join(SPARSE_OPTIONS)}")
        self._check("sparse_steps", self.sparse_steps >= 1, "must be >= 1")
        names = [m.strip().lower() for m in self.methods.split("+") if m.strip()]
        if names == ["all"]:
            names = [m for m in METHODS if m not in (DENSE, self.NAME)]
        bad = [m for m in names if m not in METHODS or m == self.NAME]
        self._check("methods", not bad, f"names {bad}: not candidates (known: {', '.join(METHODS)})")
        self._make = {m: (lambda m=m: get_compressor(m, min_size=self.min_size, seed=self.seed))
                      for m in dict.fromkeys([DENSE, *names])}
        self.subs = {m: make() for m, make in self._make.items()}
        if self.sparse == "off":
            self._drop_sparse()
        for c in self.subs.values():
            c.memory = self.memory      # residuals follow the bucket, whichever method sums it
            # and so do its buffers: a method new to a bucket fills the last one's (never read before
            # written), not fresh memory that page-faults through its first sums
            c.spare, c.buffers = self.spare, self.buffers
        self.path: auto.Path | None = None
        self.probed: int | None = None     # elements of the start-up's probe sums (_calibrate)
        self._step = -1
        self._next = self.every         # the step of the next revisit, the same on every rank
        self._path: dict = {}           # bucket -> the options it has been on, in order
        self._fresh: set = set()        # buckets whose option changed: their residual goes into the next sum
        self._lanes: set = set()        # the options the plain hook's lanes are (hook_for)
        self._pinned: str | None = None     # every bucket's option while a trial judges it (pin)
        self._revisiting = True             # off while a trial judges a fixed choice
        self._directive: tuple | None = None    # a pin() not yet applied
        self._barred = frozenset()          # options no bucket moves to (bar)
        # option -> its steps per exact step, where not 1 (fit_optimizers multiplies the sparse ones)
        self._counted: dict = ({m: c.STEPS for m, c in self.subs.items() if c.STEPS != 1.0}
                               if self.sparse == "auto" else {})

    def _drop_sparse(self) -> None:
        """The candidates without the sparse methods (sparse=off)."""
        self._make = {m: f for m, f in self._make.items() if not self.subs[m].SPARSE}
        self.subs = {m: self.subs[m] for m in self._make}

    def fit_optimizers(self, rescaling: list[str]) -> str | None:
        """Before the first sum: with ``sparse=auto``, where optimizers that
        rescale per coordinate (``rescaling``, their names) train the model,
        the sparse methods' times count ``sparse_steps`` times more from now
        on. Returns the line that says so, or None where nothing changed."""
        if self.sparse != "auto" or not rescaling or self.path is not None or self.sparse_steps == 1:
            return None
        sparse = [m for m, c in self.subs.items() if c.SPARSE]
        if not sparse:
            return None
        self._counted |= {m: self.sparse_steps * self.subs[m].STEPS for m in sparse}
        by_count: dict = {}
        for m in sparse:
            by_count.setdefault(self._counted[m], []).append(m)
        counts = ", ".join(f"{', '.join(ms)} at {c:.3g}x" for c, ms in by_count.items())
        return (f"compress auto: {rescale_said(rescaling)}, which trains slowly on sparse sums: "
                f"counting {counts} their time "
                "(auto:sparse=off leaves them out, sparse=on counts them at their time; "
                "docs/compression.md, Known limits)")

    def steps(self, option: str | None = None) -> float:
        """How many times ``option``'s time counts (Cost.steps); None: the
        buckets' options as they are now, weighted by their elements."""
        if option is not None:
            return self._counted.get(option, 1.0)
        n = sum(b.n for b in self.buckets.values())
        return sum(b.n * self.steps(b.choice) for b in self.buckets.values()) / n if n else 1.0

    @property
    def SUMMABLE(self) -> bool:       # noqa: N802 - the interface's name
        return all(c.SUMMABLE for c in self.subs.values())

    @property
    def NEEDS_WEIGHT(self) -> bool:   # noqa: N802
        """Whether the next sum wants the parameters: where a pin holds every
        bucket (one waiting for the step's first bucket included), its
        method's need; else any bucket's option's (any option's before the
        first bucket). The hook copies the parameters only where this says so."""
        pinned = self._directive[0] if self._directive is not None else self._pinned
        if pinned is not None:
            return self.subs[pinned].NEEDS_WEIGHT
        chosen = {b.choice for b in self.buckets.values()} or set(self.subs)
        return any(self.subs[m].NEEDS_WEIGHT for m in chosen)

    @property
    def DEFERS(self) -> bool:         # noqa: N802
        """Per sum (reduce): a bucket's method defers where it can, with its
        ``redo``; the selector's own sums (start-up, dense) agree at once."""
        return True

    # -- the sum -----------------------------------------------------------------------
    def reduce(self, name, tensor, step, coll, *, layers=None, weight=None, mean=False):
        defer, coll.deferring = coll.deferring, False
        try:
            return self._reduce(name, tensor, step, coll, layers, weight, mean, defer)
        finally:
            coll.deferring = defer

    def _reduce(self, name, tensor, step, coll, layers, weight, mean, defer: bool):
        if self.path is None:
            self._calibrate(coll, tensor.numel())
        if step != self._step:          # the first bucket of a step, the same one on every rank
            self._step = step
            if self._directive is not None:
                self._apply(coll, *self._directive)
            elif self._revisiting and step >= self._next:
                self._revisit(coll)
                trying = any(b.choice not in b.seen for b in self.buckets.values())
                self._next = step + (min(self.trial, self.every) if trying else self.every)
        n = tensor.numel()
        b = self.buckets.get(name)
        if b is None or b.n != n:       # a new bucket (DDP rebuilds its buckets after step 0)
            b = self.buckets[name] = self._start(n)
            self._times.pop(name, None)     # times of the bucket's earlier layout
            self._fresh.add(name)
            self._said(name, None, b)
        t0, dtype = time.perf_counter(), tensor.dtype
        dense = step < self.warmup or b.choice == DENSE
        r = None
        if dense or name in self._fresh:
            # a method keeps its residual where it likes (the client keeps int16's): what another
            # option left for this bucket goes into its first sum on the new one
            self._fresh.discard(name)
            tensor, r = self.take_residual(name, tensor, layers)
        if dense:
            out = exchange(Payload({"dense": Part("sum", tensor.reshape(-1).to(torch.float32))}),
                           coll, name)["dense"].view(tensor.shape)
            if mean:
                out.div_(coll.world_size)
        else:
            sub = self.subs[b.choice]
            coll.deferring = defer and sub.DEFERS   # its last round agreed with the step's others (reduce restores)
            out = sub.reduce(name, tensor, step, coll, layers=layers, weight=weight, mean=mean)
            self.redo = sub.redo if coll.deferring else None
        if r is not None and name not in self.memory and not all_finite(out):
            self.memory[name] = r       # a step the scaler skips: keep what was not sent
        if step >= self.warmup:
            # a window's last TIMES_KEPT sums at most: a method that won a trial sums for good unobserved
            self._times.setdefault(name, deque(maxlen=TIMES_KEPT)).append(time.perf_counter() - t0)
        return out.to(dtype)

    def take_residual(self, name, tensor, layers):
        """(tensor + the residual kept for ``name``, the residual), the residual
        taken out of memory; it covers the layers of at least min_size elements."""
        r = self.memory.pop(name, None)
        if r is None:
            return tensor, None
        flat = tensor.reshape(-1).to(torch.float32).clone()
        sizes = list(layers) if layers is not None else [flat.numel()]
        big = [s >= self.min_size for s in sizes]
        if sum(s for s, b in zip(sizes, big) if b) != r.numel():    # not this layout's: the method drops it too
            return tensor, None
        at = 0
        for o, e, b in layer_runs(sizes, big):     # slices: a boolean mask's index_put took ~1 s on 7.7M elements
            if b:
                flat[o:e] += r[at:at + e - o]
                at += e - o
        return flat.view(tensor.shape), r

    # -- what the ranks agree on ---------------------------------------------------------
    def _agree(self, coll, values: list[float]) -> list[float]:
        """The elementwise maximum over ranks (exact: a gather, not a sum)."""
        mine = torch.tensor(values, dtype=torch.float64)
        return coll.allgather(mine).max(0).values.tolist()

    def _calibrate(self, coll, n_first: int) -> None:
        """Compute on Loopback, then dense and every candidate once on ``coll``."""
        self._times: dict = {}
        world = coll.world_size
        costs = {m: compute_cost(make, world) for m, make in self._make.items()}
        n = max(4, min(self.probe, n_first))      # never more than the job was sized for
        small = min(SMALL, n // 4)
        t = [timed_sum(self._make[DENSE](), small, coll, coll.rank)]
        n = self.probed = self._probe_size(coll, n, small)
        t += [timed_sum(self._make[m](), n, coll, coll.rank) for m in costs]
        flat = [v for c in costs.values() for v in (c.fixed, c.per_elem, c.wire, c.rounds)]
        agreed = self._agree(coll, flat + t)
        costs = {m: auto.Cost(*agreed[4 * k:4 * k + 3], int(agreed[4 * k + 3])) for k, m in enumerate(costs)}
        t_small, t_probe = agreed[4 * len(costs)], agreed[4 * len(costs) + 1:]
        self.path = auto.fit_path(costs[DENSE], small, t_small, n, t_probe[0])
        self.costs = {m: replace(auto.scale_for(c, n, self.path, tm), steps=self.steps(m))
                      for (m, c), tm in zip(costs.items(), t_probe)}
        if coll.rank == 0:
            log.info("xagg auto: path %.0f Mbit/s, %.2f ms per collective; at %d elements %s",
                     8e-6 / self.path.inv_rate, 1e3 * self.path.round_s, n,
                     ", ".join(f"{m} {1e3 * tm:.1f} ms" for m, tm in zip(costs, t_probe)))
        self._rank = coll.rank

    def _probe_size(self, coll, n: int, small: int) -> int:
        """``n``, or fewer where the link is slow: a dense sum of n // LOOK
        elements (the slowest rank's best of two, agreed) says how many the
        link moves in PROBE_S, and the probe is cut to that, never below the
        look. Every rank gets the same size from the agreed time."""
        look = n // LOOK
        if look <= small:
            return n
        took = self._agree(coll, [timed_sum(self._make[DENSE](), look, coll, coll.rank)])[0]
        return max(look, min(n, int(look * PROBE_S / took))) if took > 0 else n

    def hook_for(self, coll, sizes: list) -> auto.HookChoice:
        """Before the job's first sum, on its real transport (every rank, at
        the same point): the plain hook, in 32-bit lanes or 16 where int16 is a
        candidate, or this selector's per-bucket
        choice, for buckets of ``sizes`` elements. Calibrates once: the
        figures serve the buckets if the choice is this selector."""
        self._calibrate(coll, max(sizes))
        lanes = {bits: m for bits, m in LANE_OPTIONS.items() if m in self.subs}
        self._lanes = set(lanes.values())
        chose = auto.hook_choice(self.costs, self.path, sizes, lanes)
        if self.hook == "auto":
            return chose
        bits = chose.lanes or min(lanes, key=lambda b: (sum(auto.formula(self.costs[lanes[b]], n, self.path)
                                                            for n in sizes), -b))
        if self.hook == "buckets":      # the per-bucket choice alone: no trial of whole steps
            return replace(chose, lanes=None, trial=False, methods=(), plain_when=auto.LAST, sums=())
        return replace(chose, lanes=bits, trial=self.hook == "try", plain_when=auto.LAST, sums=())

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        for c in self.subs.values():
            c.memory = self.memory

    def pin(self, option: str | None, revisit: bool = False) -> None:
        """For a trial that judges whole steps (xagg/torch/hook_trial.py):
        from the next step on, every bucket on ``option`` (new buckets too),
        or with None each on the option its model chooses; revisits only
        where ``revisit``. Applied at that step's first bucket, on every rank
        at the same point; what each bucket's sums took since the last pin is
        kept as what its option took (the buckets' models learn from every
        side of a trial)."""
        self._directive = (option, revisit)

    def _apply(self, coll, option: str | None, revisit: bool) -> None:
        self._directive = None
        self._observe_window(coll)
        self._pinned, self._revisiting = option, revisit
        self._next = self._step + self.every
        for k, b in sorted(self.buckets.items()):
            self._move(k, b, option or self._choose(b, self.explore), False)

    def bar(self, options) -> None:
        """From now on no bucket moves to any of ``options`` (one already on
        it stays): a trial of whole steps measured each of them slower than
        the per-bucket choice, by what a sum's time does not show."""
        self._barred = frozenset(options)

    def _choose(self, b: BucketModel, explore: float = 0.0) -> str:
        """``b``'s option by the model, among the options not barred (and its own)."""
        return auto.choose(self.costs, b, self.path, self.margin, explore, self._barred)

    def _move(self, k: str, b: BucketModel, choice: str, revisit: bool = True) -> None:
        """``b`` onto ``choice``; a revisit's change counts (it doubles the
        bucket's margin), a trial's does not."""
        if b.choice != choice:
            was, b.choice = b.choice, choice
            self._fresh.add(k)
            if revisit:
                b.changes += 1
                self.stats["changes"] = self.stats.get("changes", 0) + 1
            self._said(k, was, b)

    def _start(self, n: int) -> BucketModel:
        b = BucketModel(n, DENSE, self.path.inv_rate)
        b.choice = self._pinned or self._choose(b)
        return b

    def _observe_window(self, coll) -> list:
        """The window's times agreed (each bucket's slowest rank's median)
        and recorded as what each bucket's option took: the buckets that ran."""
        names = sorted(self.buckets)
        # a bucket that ran no sum in the window (a rank's optimizer skipped a step) sends 0
        mine = [statistics.median(self._times[k]) if self._times.get(k) else 0.0 for k in names]
        agreed = self._agree(coll, mine) if names else []
        self._times = {}
        ran = []
        for k, t in zip(names, agreed):
            if t > 0:
                self.buckets[k] = auto.observe(self.costs, self.buckets[k], t)
                ran.append(k)
        return ran

    def _revisit(self, coll) -> None:
        for k in self._observe_window(coll):
            b = self.buckets[k]
            self._move(k, b, self._choose(b, self.explore))

    def _said(self, name: str, was: str | None, b: BucketModel) -> None:
        self._path[name] = [*(self._path.get(name, []) if was else []), b.choice]
        if self._rank == 0:
            pred = auto.predict(self.costs, b, self.path)
            log.info("xagg auto: %s (%d elements): %s%s, predicted %s", name, b.n,
                     f"{was} -> " if was else "", b.choice,
                     ", ".join(f"{m} {1e3 * t:.1f} ms" for m, t in sorted(pred.items(), key=lambda kv: kv[1])))

    # -- what it says ----------------------------------------------------------------
    def choices(self) -> dict:
        """Bucket name -> the option in use."""
        return {k: b.choice for k, b in sorted(self.buckets.items())}

    def summary(self) -> str:
        """Each bucket's option, and where it changed, the options it went through."""
        def went(k):
            p = self._path.get(k, [])
            return f" ({' -> '.join(p)})" if len(p) > 1 else ""
        per = ", ".join(f"{k} ({b.n / 1e6:.1f}M) {b.choice}{went(k)}" for k, b in sorted(self.buckets.items()))
        return f"compress auto: {per or 'no bucket yet'}; {self.stats.get('changes', 0)} change(s)"
