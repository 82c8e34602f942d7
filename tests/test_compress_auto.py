"""--compress auto: the cost model's decisions as a table (auto.py), and
the selector (selector.py) in four ranks of one process: the same choice on
every rank, sums that lose nothing when a bucket changes method, bad
options named. The real transport: tests/test_compress_auto_xdp.py."""
import math
import time
from dataclasses import replace

import pytest
import torch

from xagg.bench.compress import auto_said, past_trial_ms, time_to_loss, window_loss
from xagg.compress import ThreadGroup, get_compressor, optimizers
from xagg.compress.calibrate import Loopback
from xagg.compress.rng import choice
from xagg.compress.selector import LOOK, PROBE_S
from xagg.compress.auto import (AFTER, DENSE, FIRST, LAST, MAX_REALITY, PLAIN_EDGE, TRIES, TRY_EDGE, BucketModel,
                                Cost, Path, Seen, choose, fit_path, formula, hook_choice, observe, predict, scale_for)

MBIT = 1e6 / 8                       # bytes per second in a Mbit/s
N = 10_000_000                       # a 10M-parameter model's gradient in one bucket
# compute as `python -m xagg.bench.compress` measures it on an idle core; bytes per element as the methods send them
COSTS = {
    DENSE: Cost(0.0, 1e-10, 4.0, 1),
    "int16": Cost(0.002, 7e-9, 2.0, 2),
    "iwp": Cost(0.0, 7e-9, 0.12, 2),
    "sketch": Cost(0.03, 1.8e-8, 0.11, 3),
}


def path(mbit: float, round_ms: float = 1.0) -> Path:
    return Path(1 / (mbit * MBIT), round_ms / 1e3)


def bucket(p: Path, choice: str = DENSE, n: int = N, seen=None) -> BucketModel:
    return BucketModel(n, choice, p.inv_rate, dict(seen or {}))


@pytest.mark.parametrize("mbit, n, costs, expect", [
    # a slow link: the method with the fewest bytes whose compute fits wins
    (100, N, COSTS, "iwp"),
    # a fast link: nothing pays for its compute
    (40_000, N, COSTS, DENSE),
    # 1 Gbit/s: int16's halved bytes outweigh its compute, iwp's 30x fewer bytes more so
    (1_000, N, COSTS, "iwp"),
    (1_000, N, {k: COSTS[k] for k in (DENSE, "int16")}, "int16"),
    # a small bucket: the extra rounds cost more than the bytes saved
    (1_000, 2_000, COSTS, DENSE),
    # sketch's compute pays at 1 Gbit/s, not at 10
    (1_000, N, {DENSE: COSTS[DENSE], "sketch": COSTS["sketch"]}, "sketch"),
    (10_000, N, {DENSE: COSTS[DENSE], "sketch": COSTS["sketch"]}, DENSE),
    # the start-up probe found the method 10x slower than its formula on this path
    (1_000, N, {DENSE: COSTS[DENSE], "iwp": Cost(0.0, 3e-7, 0.12, 2, scale=10.0)}, DENSE),
])
def test_choice_from_the_formula(mbit, n, costs, expect):
    p = path(mbit)
    assert choose(costs, bucket(p, n=n), p, margin=0.03) == expect


def test_what_an_option_took_replaces_its_formula():
    p = path(1_000)
    b = bucket(p)
    assert choose(COSTS, b, p, 0.03) == "iwp"
    # iwp ran and took 2 s, more than dense's formula gives: it is judged by what it took
    b = bucket(p, "iwp", seen={"iwp": Seen(2.0, p.inv_rate)})
    assert predict(COSTS, b, p)["iwp"] == 2.0
    assert choose(COSTS, b, p, 0.03) == "sketch"       # the next fastest by its formula
    b.seen["sketch"] = Seen(0.5, p.inv_rate)
    assert choose(COSTS, b, p, 0.03) == "int16"


@pytest.mark.parametrize("cur, t_dense, t_cur, margin, expect", [
    ("int16", 1.00, 1.02, 0.03, "int16"),      # within the margin: stays
    ("int16", 1.00, 1.05, 0.03, DENSE),        # beyond it: moves
    (DENSE, 1.00, 1.00, 0.0, DENSE),           # a tie keeps the one in use
    ("int16", 1.00, 1.00, 0.0, "int16"),
])
def test_margin_keeps_the_option_in_use(cur, t_dense, t_cur, margin, expect):
    p = path(1_000)
    costs = {k: COSTS[k] for k in (DENSE, "int16")}
    b = bucket(p, cur, seen={DENSE: Seen(t_dense, p.inv_rate), "int16": Seen(t_cur, p.inv_rate)})
    assert choose(costs, b, p, margin) == expect


@pytest.mark.parametrize("explore, expect", [
    (0.0, "int16"),       # int16's formula at 1 Gbit/s, ~0.23 s, beats dense's measured 0.32 s
    (0.3, "int16"),       # ... by more than 30%
    (0.5, DENSE),         # not by enough to spend a window trying it
])
def test_an_option_never_run_must_win_by_the_exploration_margin(explore, expect):
    p = path(1_000)
    costs = {k: COSTS[k] for k in (DENSE, "int16")}
    b = bucket(p, seen={DENSE: Seen(formula(COSTS[DENSE], N, p), p.inv_rate)})    # dense ran as predicted
    assert choose(costs, b, p, 0.03, explore) == expect
    # before anything ran, every option is a formula: the margin is no one's handicap
    assert choose(costs, bucket(p), p, 0.03, explore) == "int16"


@pytest.mark.parametrize("ran, expect", [
    ({DENSE: 1.4}, 1.4),                  # dense ran 1.4x its formula: so would int16
    ({DENSE: 5.0}, MAX_REALITY),          # at most MAX_REALITY: beyond, a method's own slowness
    ({DENSE: 0.5}, 1.0),                  # never below the formula the probe measured
    ({DENSE: 1.8, "iwp": 1.2}, 1.2),      # the option closest to its formula says it
])
def test_an_option_never_run_is_predicted_as_slow_as_the_bucket_runs_formulas(ran, expect):
    p = path(1_000)
    b = bucket(p, seen={m: Seen(k * formula(COSTS[m], N, p), p.inv_rate) for m, k in ran.items()})
    assert predict(COSTS, b, p)["int16"] == pytest.approx(expect * formula(COSTS["int16"], N, p))
    for m, k in ran.items():               # what ran is judged by what it took
        assert predict(COSTS, b, p)[m] == pytest.approx(k * formula(COSTS[m], N, p))


@pytest.mark.parametrize("k, expect", [
    (1.3, "int16"),       # as slow as the step makes every option: nothing is tried
    (3.0, DENSE),         # slower than that, as a method of its own: the next formula is
])
def test_only_an_option_slower_than_the_step_explains_sends_auto_exploring(k, expect):
    p = path(1_000)
    costs = {k: COSTS[k] for k in (DENSE, "int16")}
    b = bucket(p, "int16", seen={"int16": Seen(k * formula(COSTS["int16"], N, p), p.inv_rate)})
    assert choose(costs, b, p, 0.03, 0.2) == expect


def test_a_tie_between_unused_options_goes_to_the_first_listed():
    p = path(1_000)
    b = bucket(p, "int16", seen={DENSE: Seen(1.0, p.inv_rate), "int16": Seen(3.0, p.inv_rate),
                                 "iwp": Seen(1.0, p.inv_rate)})
    assert choose({k: COSTS[k] for k in (DENSE, "int16", "iwp")}, b, p, 0.0) == DENSE
    assert choose({k: COSTS[k] for k in ("iwp", DENSE, "int16")}, b, p, 0.0) == "iwp"


def test_observations_follow_the_link_as_it_drifts():
    slow = Cost(0.0, 3e-8, 0.12, 2)          # 0.3 s of compute for 10M elements, few bytes
    costs = {DENSE: COSTS[DENSE], "slow": slow}
    p = path(1_000)
    b = observe(costs, bucket(p), 0.32)        # the first time: recorded, the path unchanged
    assert b.seen[DENSE] == Seen(0.32, p.inv_rate) and b.inv_rate == p.inv_rate
    assert choose(costs, b, p, 0.03) == DENSE  # 0.32 s against 0.31 predicted: within the margin
    b = observe(costs, b, 0.64)                # the link halved: dense's bytes took twice as long
    assert b.inv_rate == pytest.approx(2 * p.inv_rate)
    assert predict(costs, b, p)["slow"] == pytest.approx(formula(slow, N, p, 2 * p.inv_rate))
    assert choose(costs, b, p, 0.03) == "slow"
    # slow's time is mostly compute: its swings say nothing of the link
    b.choice = "slow"
    b = observe(costs, b, 0.33)
    b = observe(costs, b, 0.20)
    assert b.inv_rate == pytest.approx(2 * p.inv_rate)
    assert predict(costs, b, p)[DENSE] == pytest.approx(0.64)


def test_one_window_moves_the_link_by_at_most_a_factor_two():
    costs = {DENSE: COSTS[DENSE]}
    p = path(1_000)
    b = observe(costs, bucket(p), 0.32)
    assert observe(costs, b, 0.001).inv_rate == pytest.approx(p.inv_rate / 2)
    assert observe(costs, b, 30.0).inv_rate == pytest.approx(p.inv_rate * 2)


def test_an_observation_never_makes_the_rate_negative():
    costs = {k: COSTS[k] for k in (DENSE,)}
    p = path(100)
    b = observe(costs, bucket(p), 3.0)
    b = observe(costs, b, 0.001)
    assert b.inv_rate > 0 and math.isfinite(b.inv_rate)


@pytest.mark.parametrize("mbit, round_ms", [(100, 1.0), (1_000, 0.2), (10_000, 3.0)])
def test_path_from_two_dense_sums(mbit, round_ms):
    true = path(mbit, round_ms)
    d = COSTS[DENSE]
    t_small, t_big = formula(d, 1024, true), formula(d, 1 << 20, true)
    p = fit_path(d, 1024, t_small, 1 << 20, t_big)
    assert p.inv_rate == pytest.approx(true.inv_rate) and p.round_s == pytest.approx(true.round_s)


@pytest.mark.parametrize("slower", [True, False])
def test_the_formula_meets_the_probe(slower):
    """A probe slower than its formula adds its excess per call: a bucket ten
    times the probe pays it once, not ten times. One faster scales the whole
    formula down (the path was faster for its packets)."""
    p, c, n = path(1_000), COSTS["int16"], 1 << 20
    base = formula(c, n, p)
    probe = base * (3.0 if slower else 0.5)
    fitted = scale_for(c, n, p, probe)
    assert formula(fitted, n, p) == pytest.approx(probe)
    big = formula(fitted, 10 * n, p)
    if slower:
        assert fitted.scale == 1.0 and big == pytest.approx(formula(c, 10 * n, p) + 2 * base)
    else:
        assert fitted.extra == 0.0 and big == pytest.approx(0.5 * formula(c, 10 * n, p))


# -- the selector, in four ranks of one process ------------------------------------------
def run_auto(spec: str, steps: int, sizes=(200_000, 3_000)):
    comps = [get_compressor(spec) for _ in range(4)]

    def body(c):
        comp, outs, choices, contrib = comps[c.rank], [], [], []
        for step in range(steps):
            for b, n in enumerate(sizes):
                name = f"bucket{b}"
                x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + 10 * b + c.rank))
                before = comp.memory.get(name)
                before = before.clone() if before is not None else None    # a method may reuse its buffer
                out = comp.reduce(name, x, step, c, layers=[n])
                after = comp.memory.get(name)
                # what this rank put into the sum: its gradient, less what it keeps for later
                contrib.append(x + (before if before is not None else 0) - (after if after is not None else 0))
                outs.append(out.clone())       # it holds until the bucket's next reduce
            choices.append(comp.choices())
        return outs, choices, contrib

    return comps, ThreadGroup(4).run(body)


def test_a_trial_pins_every_bucket_on_one_method_and_the_buckets_keep_what_each_took():
    """pin(method): from the next step every bucket (and one DDP builds
    later) is on it, with no revisit, whatever is predicted faster; each pin
    records what the window's sums took as the pinned method's time on each
    bucket; pin(None, revisit=True) hands the buckets back to their own
    choice, which revisits again. The parameters are wanted (the hook
    copies them) as the pinned method wants them, from the pin on."""
    comps = [get_compressor("auto:methods=int16+rgc+iwp,every=1,min_size=0,probe=4096") for _ in range(4)]
    sizes = (200_000, 3_000)
    plan = {0: ("iwp", False), 3: ("rgc", False), 6: (None, True)}
    needs = []

    def body(c):
        comp, choices, seen = comps[c.rank], [], []
        comp.hook_for(c, list(sizes))
        for step in range(9):
            if step in plan:
                comp.pin(*plan[step])
            if c.rank == 0:
                needs.append(comp.NEEDS_WEIGHT)     # where the hook asks: before the step's first sum
            late = sizes if step else sizes[:1]         # bucket1 appears at step 1, as after DDP's rebuild
            for b, n in enumerate(late):
                comp.reduce(f"bucket{b}", torch.randn(n, generator=torch.Generator().manual_seed(step + c.rank)),
                            step, c, layers=[n])
            choices.append(comp.choices())
            seen.append(({k: sorted(b.seen) for k, b in comp.buckets.items()},
                         sum(b.changes for b in comp.buckets.values()), comp._next))
        return choices, seen
    res = ThreadGroup(4).run(body)
    (choices, seen), comp = res[0], comps[0]
    assert all(r == res[0] for r in res)                # every rank pins and chooses alike
    for step in range(3):
        assert set(choices[step].values()) == {"iwp"}, choices[step]
    for step in range(3, 6):
        assert set(choices[step].values()) == {"rgc"}, choices[step]
    # what each pinned window took is kept for both buckets, and no pin counted as a revisit's change
    assert seen[3][0] == {"bucket0": ["iwp"], "bucket1": ["iwp"]}, seen[3]
    assert seen[6][0] == {"bucket0": ["iwp", "rgc"], "bucket1": ["iwp", "rgc"]}, seen[6]
    assert [changes for _, changes, _ in seen[:7]] == [0] * 7
    assert len({nxt for _, _, nxt in seen[:6]}) <= 2        # pinned: no revisit moved the next one on
    # free again: each bucket on its own choice, and from the next step a revisit each step
    assert [nxt for _, _, nxt in seen[6:]] == [7, 8, 9], seen[6:]
    assert comp._revisiting and comp._pinned is None
    assert "iwp -> rgc" in comp.summary()
    # pinned to iwp: wanted; pinned to rgc, the buckets still on iwp until the step's first sum: not
    assert needs[:6] == [True] * 3 + [False] * 3, needs


def test_a_pinned_method_leaves_its_last_sum_to_the_steps_agreement_as_it_does_alone():
    """Where the DDP hook defers (Collectives.deferring: the step's one
    agreement settles the last rounds), a bucket's method that can defer
    does so under auto too, with its ``redo``; auto's own dense sums and a
    method with a reduce of its own (int16) agree at once. Its start-up
    probes are timed as the hook's steps sum: deferred where the method
    defers, then settled. Alone, iwp's last sum is deferred: under auto it
    must not cost a round of agreement per sum more."""
    class Seen(Loopback):
        def _sum(self, t):
            self.sums.append((self.deferring, self.final_round))
            return super()._sum(t)
    comp = get_compressor("auto:methods=iwp+int16,min_size=0,probe=4096")
    assert comp.DEFERS and get_compressor("iwp").DEFERS and not get_compressor("int16").DEFERS
    coll, n = Seen(4), 50_000
    coll.sums, coll.deferring = [], True
    x, w = torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.randn(n)
    comp.reduce("bucket0", x, 0, coll, layers=[n], weight=w)            # start-up: dense's and iwp's probes
    assert coll.deferring and len(coll.sums) >= 6 and all(d and last for d, last in coll.sums[:6]), coll.sums
    for step, option in ((1, "iwp"), (2, "iwp"), (3, DENSE), (4, "int16")):
        comp.pin(option) if step in (1, 3, 4) else None
        # iwp's picking rank: a loopback's other ranks have no indices
        coll.sums, coll.rank = [], choice(4, comp.seed, step, "bucket0")
        out = comp.reduce("bucket0", x, step, coll, layers=[n], weight=w).clone()
        assert comp.choices() == {"bucket0": option}
        deferred = [final for d, final in coll.sums if d]
        if option == "iwp":
            assert deferred == [True], coll.sums        # its last round only, as alone
            assert torch.equal(comp.redo(), out)        # the same result again from the same rounds
        else:
            assert deferred == [], coll.sums
        assert coll.deferring                           # the hook's setting is left as it was


@pytest.mark.parametrize("bytes_per_s, cut", [(None, False), (2e6, True)])
def test_the_start_up_probe_is_cut_to_what_a_slow_link_moves(bytes_per_s, cut):
    """A link that moves the probe's first look (a dense sum of 1/LOOK of
    its elements) slowly cuts every candidate's probe to what it moves in
    about PROBE_S; a fast one leaves it whole."""
    class Link(Loopback):
        def _sum(self, t):
            self.sizes.append(t.numel())
            if bytes_per_s:
                time.sleep(4 * t.numel() / bytes_per_s)
            return super()._sum(t)
    probe, n = 1 << 18, 300_000
    comp, coll = get_compressor(f"auto:methods=int16,probe={probe}"), Link(4)
    coll.sizes = []
    comp.reduce("bucket0", torch.randn(n), 0, coll, layers=[n])
    look = probe // LOOK
    assert look in coll.sizes
    if cut:
        # the look took 4 * look / bytes_per_s (33 ms) and more: the probe is what moves in PROBE_S, or less
        assert look <= comp.probed <= look * PROBE_S * bytes_per_s / (4 * look) and comp.probed in coll.sizes
    else:
        assert comp.probed == probe and probe in coll.sizes


def test_a_residual_taken_back_goes_onto_the_layers_it_covers():
    """What a method kept covers the layers of at least min_size, in order:
    taken back, it is added to exactly those slices of the bucket (small
    layers between them untouched), and memory no longer holds it; one of
    another layout is left alone."""
    comp = get_compressor("auto:methods=rgc,min_size=1024")
    layers = [3000, 10, 2000, 5, 1500]
    x = torch.randn(sum(layers), generator=torch.Generator().manual_seed(2))
    r = torch.randn(3000 + 2000 + 1500, generator=torch.Generator().manual_seed(3))
    comp.memory["b"] = r.clone()
    got, taken = comp.take_residual("b", x, layers)
    want = x.clone()
    want[:3000] += r[:3000]
    want[3010:5010] += r[3000:5000]
    want[5015:] += r[5000:]
    assert torch.equal(got, want) and torch.equal(taken, r) and "b" not in comp.memory
    comp.memory["b"] = torch.ones(10)
    got, taken = comp.take_residual("b", x, layers)
    assert got is x and taken is None


def test_every_rank_chooses_the_same_and_the_sums_lose_nothing():
    comps, res = run_auto("auto:methods=int16+rgc,every=2,min_size=0", steps=7)
    outs0, choices0, _ = res[0]
    for outs, choices, _ in res[1:]:
        assert choices == choices0
        assert all(torch.equal(a, b) for a, b in zip(outs, outs0))
    # every sum is the sum of what the ranks put in: nothing lost or counted twice,
    # whichever method a bucket was on and when it changed
    for k, out in enumerate(outs0):
        want = sum(r[2][k] for r in res)
        assert torch.allclose(out, want, atol=1e-4 * float(want.abs().max()) + 1e-5), k
    assert set(choices0[-1]) == {"bucket0", "bucket1"}
    assert comps[0].summary().startswith("compress auto: bucket0 (0.2M) ")


@pytest.mark.parametrize("methods", ["int16", "rgc"])
def test_a_bucket_new_to_its_option_sends_what_another_kept(methods):
    """int16 keeps no residual in memory (the client's lanes do): whatever
    option a bucket starts on, what memory held for it goes into its sum."""
    g = ThreadGroup(2)
    kept = torch.full((8,), 0.5)

    def body(c):
        comp = get_compressor(f"auto:methods={methods},min_size=0")
        comp.reduce("warm", torch.zeros(64), 0, c)          # calibrates, every rank together
        comp.memory["b"] = kept.clone()
        before = comp.memory.get("b")
        out = comp.reduce("b", torch.ones(8), 0, c, layers=[8])
        return out, comp.choices()["b"], before, comp.memory.get("b")

    for out, choice, before, after in g.run(body):
        put = 2 * (torch.ones(8) + before - (after if after is not None else 0))
        assert torch.allclose(out, put), (choice, out, put)
        assert after is None or choice != "int16"


@pytest.mark.parametrize("spec, opt", [
    ("auto:methods=int16+nosuch", "methods"),
    ("auto:methods=auto", "methods"),
    ("auto:every=0", "every"),
    ("auto:margin=-0.1", "margin"),
    ("auto:explore=-1", "explore"),
    ("auto:trial=0", "trial"),
    ("auto:hook=sometimes", "hook"),
    ("auto:hook_steps=0", "hook_steps"),
])
def test_bad_options_are_named(spec, opt):
    with pytest.raises(ValueError, match=f"auto: option {opt}="):
        get_compressor(spec)


def test_a_barred_option_is_taken_by_no_bucket_not_already_on_it():
    """After a trial whose whole steps beat a method, the per-bucket choice
    keeps its buckets off it (Auto.bar): at 100 Mbit/s iwp is predicted
    fastest, yet barred it is taken only by a bucket already on it."""
    a = get_compressor("auto:methods=int16+iwp+sketch")
    a.costs, a.path = COSTS, path(100)
    assert a._choose(bucket(a.path)) == "iwp"
    a.bar(["iwp"])
    assert a._choose(bucket(a.path)) == "sketch"
    assert a._choose(bucket(a.path, "iwp")) == "iwp"


def test_a_method_new_to_a_bucket_sums_into_the_buffers_the_last_one_used():
    """A bucket pinned on rgc, then on mstopk: mstopk's sum comes back in the
    memory rgc's did (the methods share the bucket's buffers, as they share
    its residual), not in a fresh bucket-sized tensor."""
    comps = [get_compressor("auto:methods=rgc+mstopk,min_size=0,probe=4096") for _ in range(4)]
    n = 200_000

    def body(c):
        comp, where = comps[c.rank], []
        comp.hook_for(c, [n])
        for step, method in enumerate(["rgc", "rgc", "mstopk", "mstopk"]):
            comp.pin(method)
            g = torch.randn(n, generator=torch.Generator().manual_seed(step + c.rank))
            where.append(comp.reduce("bucket0", g, step, c, layers=[n]).data_ptr())
        return where, comp.choices()
    for where, choices in ThreadGroup(4).run(body):
        assert choices == {"bucket0": "mstopk"}
        assert len(set(where)) == 1, where


def test_a_window_that_tries_an_option_is_trial_steps_long():
    """Whatever the measured times made each bucket choose: after a revisit
    that left some bucket on an option it never ran, the next comes
    ``trial`` steps later, else ``every``; the summary names each bucket's
    options in the order it went through them, one change each."""
    comps = [get_compressor("auto:methods=int16+rgc+iwp,every=4,trial=2,min_size=0") for _ in range(4)]

    def body(c):
        comp, seen = comps[c.rank], []
        for step in range(14):
            for b, n in enumerate((60_000, 3_000)):
                x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + 10 * b + c.rank))
                comp.reduce(f"bucket{b}", x, step, c, layers=[n])
            trying = any(b.choice not in b.seen for b in comp.buckets.values())
            seen.append((step, comp._next, trying))
        return seen

    runs = ThreadGroup(4).run(body)
    assert all(r == runs[0] for r in runs)          # every rank revisits at the same steps
    revisits = [(step, nxt, trying) for (step, nxt, trying), (_, before, _) in zip(runs[0][1:], runs[0])
                if nxt != before]
    assert revisits, runs[0]
    for step, nxt, trying in revisits:
        assert nxt - step == (2 if trying else 4), (step, nxt, trying)
    comp = comps[0]
    paths = [len(comp._path[k]) - 1 for k in comp.buckets]
    assert sum(paths) == comp.stats.get("changes", 0)
    for k, b in comp.buckets.items():
        assert comp._path[k][-1] == b.choice
        if len(comp._path[k]) > 1:
            assert f"{k} ({b.n / 1e6:.1f}M) {b.choice} ({' -> '.join(comp._path[k])})" in comp.summary()


@pytest.mark.parametrize("changes, expect", [
    (0, DENSE),      # int16 10% slower than dense: beyond the margin of 3%
    (1, DENSE),      # ... and of 6%
    (2, "int16"),    # 12%: a bucket that changed twice stays for a 10% gain
])
def test_each_change_doubles_the_margin_so_a_bucket_settles(changes, expect):
    p = path(1_000)
    costs = {k: COSTS[k] for k in (DENSE, "int16")}
    b = bucket(p, "int16", seen={DENSE: Seen(1.0, p.inv_rate), "int16": Seen(1.1, p.inv_rate)})
    b.changes = changes
    assert choose(costs, b, p, 0.03) == expect


# -- the job's hook, chosen once before its first sum ------------------------------------
DEEP = [6_500_000] * 6 + [1_300_000]      # a 10M-parameter model in DDP's 25 MB buckets


LOSSY, EXACT = {32: DENSE, 16: "int16"}, {32: DENSE}


@pytest.mark.parametrize("mbit, costs, lanes, expect, trial", [
    # 1 Gbit/s: int16's bytes beat iwp's compute on paper (16-bit lanes beat 32), but by less
    # than the formulas can tell: tried
    (1_000, {**COSTS, "iwp": Cost(0.0, 7e-8, 0.12, 2, scale=3.0)}, LOSSY, 16, True),
    # ... iwp wins per bucket, but by less than the plain hook's overlap may be worth: tried
    (1_000, {**COSTS, "iwp": Cost(0.0, 1.5e-8, 0.12, 2)}, LOSSY, 16, True),
    # no lossy lane among the candidates, sketch's compute 3x the plain hook's sums: 32-bit lanes
    (1_000, {DENSE: COSTS[DENSE], "sketch": Cost(0.03, 1.8e-8, 0.11, 3, scale=4.0)}, EXACT, 32, False),
    # a fast link: nothing pays for its compute, not even int16's: 32-bit lanes
    (40_000, COSTS, LOSSY, 32, False),
    # no compressing method among the candidates: nothing to try
    (1_000, {k: COSTS[k] for k in (DENSE, "int16")}, LOSSY, 16, False),
    # 100 Mbit/s: the methods' bytes win by far more than the overlap
    (100, COSTS, LOSSY, None, False),
    (100, {DENSE: COSTS[DENSE], "sketch": COSTS["sketch"]}, EXACT, None, False),
])
def test_the_hook_for_the_job(mbit, costs, lanes, expect, trial):
    c = hook_choice(costs, path(mbit), DEEP, lanes)
    assert (c.lanes, c.trial) == (expect, trial)
    # the plain hook keeps the job unless the per-bucket choice wins by the edge
    assert (c.plain_s <= PLAIN_EDGE * c.buckets_s) == (expect is not None)
    assert c.buckets_s <= min(c.plain_s, c.methods_s)
    # tried where neither the per-bucket choice nor the plain hook wins by the edge
    assert c.trial == (expect is not None and c.methods_s <= PLAIN_EDGE * c.plain_s)
    start = "compress auto: trying every bucket on " if trial else \
        "compress auto: plain hook, " if expect else "compress auto: the compression hook, trying every bucket on "
    assert c.line().startswith(start)
    # the methods a trial tries on every bucket: the compressing ones within the edge of the fastest, fastest first
    whole = {m: sum(formula(costs[m], n, path(mbit)) for n in DEEP) for m in costs if m not in lanes.values()}
    assert list(c.methods) == sorted((m for m in whole if whole[m] <= TRY_EDGE * min(whole.values())),
                                     key=whole.get)[:TRIES]
    assert bool(c.methods) == bool(whole)


def test_a_trial_tries_the_methods_near_the_fastest_fastest_first():
    costs = {**COSTS, "rgc": Cost(0.0, 8e-9, 0.16, 2), "lossless": Cost(0.05, 9e-8, 0.3, 3)}
    c = hook_choice(costs, path(100), DEEP, LOSSY)
    # sums predicted: iwp 1, rgc 1.25, sketch 1.9, lossless 7.3: lossless is past the edge
    assert c.lanes is None and c.methods == ("iwp", "rgc", "sketch")
    assert "trying every bucket on iwp, every bucket on rgc, every bucket on sketch, then per-bucket methods" \
        in c.line()
    # a fourth within the edge: only the TRIES predicted fastest are tried
    cheap = {**costs, "lossless": Cost(0.0, 8e-9, 0.17, 2)}
    c = hook_choice(cheap, path(100), DEEP, LOSSY)
    assert TRIES == 3 and c.methods == ("iwp", "rgc", "lossless"), c.methods


@pytest.mark.parametrize("int8_wire, tried", [(0.26, True), (2.0, False)])
def test_a_method_counted_once_is_tried_where_the_fastest_are_all_counted_more(int8_wire, tried):
    # three sparse methods counted 1.5x predicted faster than int8, counted once: a fourth side for
    # int8 where it is within the edge (1 byte an element with its scales); none past the edge
    sparse = {m: Cost(0.0, 1e-9, w, 1, steps=1.5) for m, w in (("rgc", 0.06), ("mstopk", 0.07), ("iwp", 0.08))}
    costs = {DENSE: COSTS[DENSE], "int16": COSTS["int16"], **sparse, "int8": Cost(0.0, 1e-9, int8_wire, 2)}
    c = hook_choice(costs, path(1_000), DEEP, LOSSY)
    assert c.methods[:TRIES] == ("rgc", "mstopk", "iwp")
    assert c.methods[TRIES:] == (("int8",) if tried else ()), c.methods
    # one of the fastest counted once already: no extra side
    c = hook_choice({**costs, "iwp": Cost(0.0, 1e-9, 0.08, 1)}, path(1_000), DEEP, LOSSY)
    assert sorted(c.methods) == ["iwp", "mstopk", "rgc"], c.methods


@pytest.mark.parametrize("hook, plain, trial", [("try", True, True), ("plain", True, False),
                                                ("buckets", False, False)])
def test_the_hook_can_be_given(hook, plain, trial):
    comps = [get_compressor(f"auto:methods=int16+rgc,probe=4096,hook={hook}") for _ in range(4)]
    res = ThreadGroup(4).run(lambda c: comps[c.rank].hook_for(c, [20_000, 5_000]))
    assert len(set(res)) == 1
    # the lanes the figures find faster, whatever they say of the methods
    assert (res[0].lanes in (16, 32) if plain else res[0].lanes is None) and res[0].trial == trial
    assert bool(res[0].methods) == (hook != "buckets")     # buckets: the per-bucket choice alone, no trial


def test_every_rank_chooses_the_same_hook_from_its_own_measurements():
    # each rank measures its own compute and probe sums; the agreed figures give one choice
    comps = [get_compressor("auto:methods=int16+rgc,probe=4096") for _ in range(4)]
    res = ThreadGroup(4).run(lambda c: comps[c.rank].hook_for(c, [20_000, 5_000]))
    assert len(set(res)) == 1
    assert res[0].lanes in (16, 32, None)
    # calibrated once: the buckets' sums reuse the figures the hook was chosen from
    assert all(comp.costs == comps[0].costs and comp.path == comps[0].path for comp in comps)
    no_lossy = [get_compressor("auto:methods=rgc,probe=4096") for _ in range(4)]
    res = ThreadGroup(4).run(lambda c: no_lossy[c.rank].hook_for(c, [20_000]))
    assert len(set(res)) == 1 and res[0].lanes in (32, None)


class LarsSGD(torch.optim.Optimizer):
    """A third-party optimizer of SGD's family that does not subclass torch's SGD."""
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.fixture
def seen_optimizers():
    optimizers.install()
    yield
    optimizers.uninstall()


def test_the_optimizers_over_a_model_that_rescale_per_coordinate_are_named(seen_optimizers):
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    keep = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), LarsSGD(model.parameters()),
            torch.optim.AdamW(other.parameters())]
    assert optimizers.rescaling(model) == []            # SGD's family; AdamW holds another model's parameters
    keep += [torch.optim.Adagrad([model.bias]), torch.optim.Adam(model.parameters()),
             torch.optim.Adam([model.weight])]
    assert optimizers.rescaling(model) == ["Adagrad", "Adam"]
    assert optimizers.rescaling(other) == ["AdamW"]
    del keep                                            # an optimizer dropped is forgotten
    assert optimizers.rescaling(model) == []


ALL = [DENSE, "rgc", "mstopk", "iwp", "sketch", "lossless", "int8", "int16"]
SPARSE_METHODS = {"rgc", "mstopk", "iwp", "sketch", "lossless"}


@pytest.mark.parametrize("spec, rescaling, left, counted", [
    ("auto", ["AdamW"], ALL, 2.0),                      # a sparse step's time counts twice its STEPS there
    ("auto", [], ALL, 1.0),
    ("auto:sparse_steps=1", ["AdamW"], ALL, 1.0),       # its STEPS alone
    ("auto:sparse_steps=3", ["Adam"], ALL, 3.0),
    ("auto:sparse_steps=3", [], ALL, 1.0),              # ... only under such an optimizer
    ("auto:sparse=on", ["AdamW"], ALL, None),           # at their time: not even a method's own STEPS
    ("auto:sparse=off", [], [DENSE, "int8", "int16"], 1.0),
    ("auto:methods=rgc+int16", ["Adam"], [DENSE, "rgc", "int16"], 2.0),
    ("auto:methods=int8+int16", ["Adam"], [DENSE, "int8", "int16"], 1.0),
])
def test_auto_counts_sparse_steps_more_under_an_optimizer_that_rescales_per_coordinate(spec, rescaling, left,
                                                                                        counted):
    comp = get_compressor(spec)
    line = comp.fit_optimizers(rescaling)
    assert sorted(comp.subs) == sorted(comp._make) == sorted(left)
    sparse = [m for m in left if m in SPARSE_METHODS]
    # every sparse method counts its own STEPS, times the optimizer's count
    expect = {m: 1.0 if counted is None or m not in sparse else counted * get_compressor(m).STEPS for m in left}
    assert (line is not None) == (counted not in (None, 1.0))
    if line:
        assert line.startswith(f"compress auto: {rescaling[0]} scales each coordinate's step") and \
            "auto:sparse=off" in line
        for c in {expect[m] for m in sparse}:       # each count once, with the methods it counts
            assert f"{', '.join(m for m in sparse if expect[m] == c)} at {c:.3g}x" in line, line
    assert {m: comp.steps(m) for m in left} == expect
    # the figures carry the count, and the hook is chosen among the candidates on them
    comps = [get_compressor(f"{spec}{',' if ':' in spec else ':'}probe=4096") for _ in range(2)]
    for c in comps:
        c.fit_optimizers(rescaling)
    res = ThreadGroup(2).run(lambda coll: comps[coll.rank].hook_for(coll, [20_000, 5_000]))
    assert set(comps[0].costs) == set(left) and not set(res[0].methods) - set(left)
    assert {m: c.steps for m, c in comps[0].costs.items()} == {m: comp.steps(m) for m in left}


@pytest.mark.parametrize("mbit, steps, expect, plain_when", [
    (1_000, 1.0, "iwp", LAST),      # at its time iwp's sum is the fastest at 1 Gbit/s ...
    (1_000, 2.0, "int16", FIRST),   # ... but not by 2x: counted twice, int16 keeps the bucket
    (100, 2.0, "iwp", AFTER),       # on a slow link it is more than twice as fast: it keeps it
    (100, 1.0, "iwp", LAST),
])
def test_a_counted_method_keeps_a_bucket_only_where_it_wins_by_its_count(mbit, steps, expect, plain_when):
    costs = {**COSTS, "iwp": replace(COSTS["iwp"], scale=2.0, steps=steps)}
    del costs["sketch"]
    p = path(mbit)
    assert choose(costs, bucket(p), p, margin=0.03) == expect
    # and once run, its measured time is counted alike
    seen = bucket(p, "iwp", seen={"iwp": Seen(0.1, p.inv_rate)})
    assert predict(costs, seen, p)["iwp"] == pytest.approx(0.1 * steps)
    # the job's hook, on counted figures: the per-bucket choice never takes the job outright (a sum's
    # figure misses the rest of the step, and the count multiplies the miss): where it would, the plain
    # hook runs after the methods; in a trial, first, with each side's counted sums for the bound
    c = hook_choice(costs, p, DEEP, LOSSY)
    assert c.plain_when == plain_when and c.buckets_s == pytest.approx(sum(
        min(predict(costs, bucket(p, n=n), p).values()) for n in DEEP))
    if steps == 1.0:
        assert c.sums == () and c.lanes == (16 if mbit == 1_000 else None)     # as before
    else:
        assert (c.lanes, c.trial) == (16, True)
        # each side's counted sums and count: per-bucket's, its buckets' predicted options' (iwp's at 100
        # Mbit/s, int16's at 1 Gbit/s), weighted by their elements
        assert c.sums == (("iwp", pytest.approx(c.methods_s), 2.0),
                          ("per-bucket", pytest.approx(c.buckets_s), 2.0 if mbit == 100 else 1.0))
        assert c.line().startswith({
            AFTER: "compress auto: trying every bucket on iwp, per-bucket methods, a window of steps each; those "
                   "counted more than once where their steps, counted, could beat the others' fastest, then the "
                   "plain hook in 16-bit lanes if their steps, counted, take longer than its sums",
            FIRST: "compress auto: trying the plain hook in 16-bit lanes, then every bucket on iwp, per-bucket "
                   "methods, a window of steps each; those counted more than once where their steps, counted, "
                   "could beat the others' fastest"}[plain_when])


def test_the_sparse_option_is_checked():
    with pytest.raises(ValueError, match="sparse"):
        get_compressor("auto:sparse=maybe")


def test_the_bench_says_what_auto_ended_on():
    # rank 0 says the hook at start and again at exit, a trial's outcome once decided, and the buckets
    won = "every bucket on iwp in the compression hook, measured a step: iwp 300 ms, plain hook 420 ms"
    said = ["xagg-client: compress auto: trying every bucket on iwp, per-bucket methods, then the plain hook",
            "xagg-client: 3 of 3 buckets through xagg, 0 through gloo (job 7)",
            f"xagg-client: compress auto: {won}",
            "xagg-client: compress auto: trying every bucket on iwp, per-bucket methods, then the plain hook",
            f"xagg-client: compress auto: {won}",
            "xagg-client: compress auto: bucket0 (2.6M) iwp; 0 change(s)"]
    assert auto_said(said) == f"{won}; bucket0 (2.6M) iwp; 0 change(s)"
    plain = ["xagg-client: compress auto: plain hook, 16-bit lanes (predicted 9 ms)"] * 2
    assert auto_said(plain) == "plain hook, 16-bit lanes (predicted 9 ms)"
    assert auto_said(["xagg-client: 3 of 3 buckets through xagg"]) == ""


def test_the_bench_judges_auto_on_the_steps_past_its_trial():
    # a trial's slow side, then the chosen one: the row is the chosen side's median, as many steps as the others
    steps_ms = [900.0] * 11 + [300.0, 330.0, 310.0]
    assert past_trial_ms(steps_ms, 3) == 310.0
    assert past_trial_ms(steps_ms, 4) == 320.0
    with pytest.raises(ValueError, match="no last 20"):
        past_trial_ms(steps_ms, 20)


def test_the_bench_compares_losses_over_the_same_steps_in_runs_of_different_lengths():
    # auto runs its trial's steps more: its loss is over the steps the others ran last, not its own last
    others = [2.0, 1.8, 1.6, 1.4]
    auto = [2.0, 1.7, 1.5, 1.3, 0.5, 0.4]
    assert window_loss(others, 4, span=2) == pytest.approx(1.5)
    assert window_loss(auto, 4, span=2) == pytest.approx(1.4)
    assert window_loss(others, 4, span=10) == pytest.approx(1.7)      # a short run: all its steps
    with pytest.raises(ValueError, match="no step 5"):
        window_loss(others, 5)


def test_the_bench_times_a_run_to_the_loss_gloo_reached():
    # gloo's window over its last 2 steps is 1.5; a run that trains less a step gets there later
    ms = [100.0, 200.0, 300.0, 400.0, 500.0, 600.0]
    assert time_to_loss([2.0, 1.8, 1.6, 1.4], ms, 1.5, span=2) == (4, 1.0)
    slow = [2.0, 1.9, 1.8, 1.7, 1.45, 1.5]
    assert time_to_loss(slow, ms, 1.5, span=2) == (6, 2.1)      # step 5's window is 1.575: not yet
    assert time_to_loss(slow, ms, 1.4, span=2) is None
    # a plateau: the first step's loss alone is below the target, but no full window is until step 4
    assert time_to_loss([1.4, 1.7, 1.6, 1.3], ms, 1.5, span=2) == (4, 1.0)
    assert time_to_loss([1.0], ms, 1.5, span=3) == (1, 0.1)     # a run shorter than a window: all of it


def test_a_lab_run_names_its_learning_rate_to_the_example_only_when_given():
    from xagg.lab.training import client_command
    cmd = client_command("gloo", "127.0.0.1:1", steps=5, model="deep", optimizer="sgd", lr=0.03)
    script = cmd[cmd.index("--") + 1:]
    assert script[script.index("--lr") + 1] == "0.03" and script[script.index("--optimizer") + 1] == "sgd"
    assert "--lr" not in client_command("gloo", "127.0.0.1:1", steps=5, optimizer="sgd")     # the example's default
