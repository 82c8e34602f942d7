"""`xaggd check` for real (root, bcc, the kernel's headers are all here):
every step passes and it exits 0; and with the headers made missing in a
mount namespace of its own, that step fails saying what fixes it, the
steps that need it do not run, and it exits 1."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

XAGGD = str(Path(sys.executable).parent / "xaggd")
STEPS = ["kernel and privileges", "bcc and kernel headers", "compile and verify the XDP program",
         "in-kernel sums equal the userspace aggregator's", "throughput (test-run), MTU 1500",
         "compile and verify the jumbo-frame build", "jumbo sums equal the userspace aggregator's",
         "throughput (test-run), MTU 9000"]


def steps(out: str) -> list[tuple[str, str]]:
    """(ok/FAIL, title) of each step line."""
    rows = []
    for line in out.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word in ("ok", "FAIL"):
            rows.append((word, next(t for t in STEPS if rest.strip().startswith(t))))
    return rows


def test_every_step_passes_and_it_exits_0():
    r = subprocess.run([XAGGD, "check", "--bench-chunks", "64"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert steps(r.stdout) == [("ok", t) for t in STEPS], r.stdout
    assert "match the userspace aggregator" in r.stdout and r.stdout.rstrip().endswith("all checks passed")


def test_missing_headers_fail_their_step_with_the_fix_and_exit_1(tmp_path):
    build = f"/lib/modules/{os.uname().release}/build"
    empty = tmp_path / "no-headers"
    empty.mkdir()
    # an empty directory over the headers, seen by this one process only
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'mount --bind "$1" "$2" && exec "$3" check --bench-chunks 64',
                        "sh", str(empty), build, XAGGD], capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stdout + r.stderr
    assert steps(r.stdout) == [("ok", STEPS[0]), ("FAIL", STEPS[1])], r.stdout
    assert f"kernel headers missing: {os.path.dirname(build)}/build does not exist. Run `make setup`" in r.stdout
    assert r.stdout.rstrip().endswith("1 check(s) failed")
    assert os.path.isdir(f"{build}/include")               # the host's own mount untouched
