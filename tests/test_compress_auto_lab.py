"""``xagg-client run --compress auto`` on a lab: where the per-bucket
methods cannot win (auto's only candidate is int16, which the hook itself
sums in 16-bit lanes) and the link makes bytes the cost (at 100 Mbit/s half
the bytes is plainly faster; unshaped, 32- and 16-bit lanes tie), auto
gives the job the plain hook in 16-bit lanes,
says so at start and at exit, and trains exactly as ``--compress int16``."""
from __future__ import annotations

import os
import re
import statistics

import pytest

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train
from xagg.torch.hook_trial import RACE_EDGE, trial_steps
from xagg.wire.fanout import Fanout


def test_auto_takes_the_plain_hook_where_no_method_can_beat_it():
    with Lab(LabSpec(name=f"asl{os.getpid() % 1000}", workers=4, aggregators=1, rate="100mbit")) as lab, \
            Aggregators(lab, "xdp") as aggs:
        runs = {spec: lab_train(lab, aggs, "xagg", epochs=1, steps=4, fanout=Fanout.BCAST, echo=False,
                                compress=spec) for spec in ("int16", "auto:methods=int16")}
    said = runs["auto:methods=int16"]["said"]
    hook = [ln for ln in said if "compress auto: plain hook, 16-bit lanes" in ln]
    assert len(hook) == 2, said                                     # at start and at exit
    assert not any("bucket0" in ln for ln in said), said            # no compression hook
    assert any(" buckets through xagg, 0 through gloo" in ln for ln in said), said
    # the same sums as --compress int16, so the same model to the last bit of the loss
    assert runs["auto:methods=int16"]["final_loss"] == runs["int16"]["final_loss"]
    # every step's loss is in the summary (the bench compares losses over the same steps)
    assert runs["auto:methods=int16"]["losses"] == runs["int16"]["losses"]
    assert len(runs["int16"]["losses"]) == 4
    assert statistics.fmean(runs["int16"]["losses"]) == pytest.approx(runs["int16"]["final_loss"])


def test_auto_tries_methods_on_whole_steps_and_says_what_won():
    """At 100 Mbit/s the compression hook keeps the job outright; its trial
    (hook_steps=1: each method near the fastest on every bucket, then the
    per-bucket choice, four steps each after the first side's three, and
    at most one race of the fastest two, hook_rounds=2) is decided at the same
    step on every rank, and rank 0 says what won with every side's measured
    step. At their time (sparse=on): counted (their STEPS, the default),
    the plain hook would run after them (tests/test_torch_hook.py)."""
    spec = "auto:methods=rgc+mstopk,hook_steps=1,hook_rounds=2,sparse=on"
    steps = trial_steps(1, 3, 2) + 1
    with Lab(LabSpec(name=f"ast{os.getpid() % 1000}", workers=4, aggregators=1, rate="100mbit")) as lab, \
            Aggregators(lab, "xdp") as aggs:
        r = lab_train(lab, aggs, "xagg", epochs=2, steps=steps, fanout=Fanout.BCAST, echo=False, compress=spec,
                      optimizer="sgd")
    said = [ln.split("compress auto: ", 1)[1] for ln in r["said"] if "compress auto: " in ln]
    assert said[0].startswith("the compression hook, trying every bucket on "), said
    tried = said[0].split("trying ", 1)[1].split(", then per-bucket")[0]
    methods = [m.removeprefix("every bucket on ") for m in tried.split(", ")]
    assert set(methods) <= {"rgc", "mstopk"} and methods, said[0]
    won = [ln for ln in said if "measured a step: " in ln]
    assert len(won) == 2, said                                      # once decided, and again at exit
    took = dict(re.findall(r"(\w[\w -]*?) (\d+) ms", won[0].split("measured a step: ")[1]))
    assert set(took) == {*methods, "per-bucket methods"}, won[0]          # every side's median
    winner = "per-bucket methods" if won[0].startswith("per-bucket") else won[0].split()[3]
    fastest = min(took, key=lambda side: int(took[side]))
    if winner != fastest:       # the fastest side kept the job, or a method within the edge of the per-bucket choice
        assert fastest == "per-bucket methods" and winner in methods, won[0]
        assert int(took[winner]) <= (int(took[fastest]) + 1) * (1 + RACE_EDGE), won[0]     # ms, rounded
        assert won[0].endswith("the pinned method keeps the job"), won[0]
    assert any(ln.startswith("bucket0 ") for ln in said), said      # what each bucket ended on
    assert len(r["losses"]) == steps
