"""What runs leave behind is removed: `xagg lab down` takes its daemons'
saved job lists with it, and xagg-client prunes old run directories."""
from __future__ import annotations

import os

import pytest

from xagg.lab import cluster
from xagg.torch import cli as client_cli

NOW = 2_000_000_000.0           # the clock value the pruning is asked at
DAY = 86400


def test_old_client_run_directories_are_pruned(tmp_path):
    runs = tmp_path / "xagg-client-0"
    runs.mkdir()
    keep = client_cli.KEEP_RUNS
    made = []
    for i in range(keep + 6):            # the oldest first
        d = runs / f"20260101-0000{i:02d}-{100 + i}"
        d.mkdir()
        (d / "rank0.json").write_text("{}")
        made.append(d)
    for i, d in enumerate(made):         # beyond KEEP_RUNS: 3 untouched for days, 2 written this hour
        age = (10 - i) * DAY if i < 4 else (len(made) - i) * 60
        os.utime(d, (NOW - age, NOW - age))
    current = made[0]                    # the run starting now, however old its name looks
    (runs / "latest").symlink_to(made[-1].name)
    gone = client_cli.prune_runs(str(runs), str(current), now=NOW)
    assert sorted(gone) == sorted(str(d) for d in made[1:4])
    assert all(not d.exists() for d in made[1:4]) and current.exists()
    assert all(d.exists() for d in made[4:]) and (runs / "latest").is_symlink()
    assert client_cli.prune_runs(str(runs), str(current), now=NOW) == []
    assert client_cli.prune_runs(str(tmp_path / "none"), str(current), now=NOW) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="lab down needs root")
def test_lab_down_removes_its_daemons_saved_jobs(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "XAGGD_RUN_DIR", tmp_path)
    monkeypatch.setattr(cluster, "STATE_DIR", tmp_path / "labs")
    name = f"lo{os.getpid() % 100000}"
    mine = [f"{name}-a0.jobs.json", f"{name}-w1.jobs.json", f"{name}-a12.jobs.json.tmp"]
    others = [f"{name}x-a0.jobs.json", f"{name}-a0-b.jobs.json", f"{name}-a0.pid", "xaggd.jobs.json",
              f"other-{name}-a0.jobs.json"]
    for f in mine + others:
        (tmp_path / f).write_text("{}")
    assert cluster.destroy(name) == []          # no namespaces, still the state
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(others)
