"""The bench's loss section (xagg.bench.loss) on a real lab, and the sum
check it and the lab tests share (xagg.lab.traffic.check_sums)."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from xagg.bench import loss
from xagg.lab.traffic import WrongSum, check_sums, expected


def test_the_loss_section_resends_only_under_loss_and_checks_every_step(monkeypatch):
    checked = []

    def check(out, workers, rounds, sizes):
        # every worker saved every step's sums, and all of them are checked
        saved = sorted(p.name for p in Path(out).glob("w*_r*_s*.npy"))
        checked.append((workers, rounds, sizes, len(saved)))
        check_sums(out, workers, rounds, sizes)
    monkeypatch.setattr(loss, "check_sums", check)
    r = loss.measure(mb=1, reps=1, rounds=4, rate="1gbit", agg_rate="4gbit", echo=False)
    assert checked == [(4, 4, [250_000], 16)] * 2                                   # lossless, lossy
    assert len(r["steps_ms"]["lossless"]) == len(r["steps_ms"]["lossy"]) == 3      # warm-up dropped
    # 1 MB is ~112 packets per worker each way: at 1% both ways every step
    # loses some of someone's, and each loss shows as resends
    assert r["lossy_resends_per_step"] > 0.5
    assert r["lossless_resends_per_step"] < r["lossy_resends_per_step"]
    # the row's ratios are of the steps reported (timing itself is the bench's)
    base = statistics.median(r["steps_ms"]["lossless"])
    assert r["lossy_median_x"] == pytest.approx(statistics.median(r["steps_ms"]["lossy"]) / base, rel=0.01)
    assert r["lossy_slowest_x"] == pytest.approx(max(r["steps_ms"]["lossy"]) / base, rel=0.01)


def _saved(tmp_path, n, size, seed=0):
    for w in range(n):
        np.save(tmp_path / f"w{w}_r0_s{size}.npy", expected(seed, n, 0, size)[0].astype(np.float32))


def test_check_sums_passes_right_sums_and_names_a_wrong_one(tmp_path):
    _saved(tmp_path, 3, 1000)
    check_sums(tmp_path, 3, 1, [1000])
    bad = np.load(tmp_path / "w2_r0_s1000.npy")
    bad[17] += 1.0
    np.save(tmp_path / "w2_r0_s1000.npy", bad)
    with pytest.raises(WrongSum, match="round 0, size 1000: worker 2's sum is off"):
        check_sums(tmp_path, 3, 1, [1000])


def test_check_sums_refuses_workers_that_disagree_within_the_bound(tmp_path):
    _saved(tmp_path, 2, 1000)
    other = np.load(tmp_path / "w1_r0_s1000.npy")
    other[3] = np.nextafter(other[3], np.float32(np.inf))      # inside the bound, but not worker 0's
    np.save(tmp_path / "w1_r0_s1000.npy", other)
    with pytest.raises(WrongSum, match="worker 1's sum differs from worker 0's"):
        check_sums(tmp_path, 2, 1, [1000])
