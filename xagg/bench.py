"""`make bench`: every benchmark of the project, one table each, as ratios
against the peer measured in the same run. Writes bench-out/bench.json.

Sections: xdp (test-run cost of the program), allreduce (lab: xagg vs
gloo vs the userspace twin), compress (compression methods), train (DDP
step time). `--only xdp,allreduce` picks sections, `--quick` shrinks them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("XAGG_BENCH_OUT", "bench-out"))


def bench_xdp(quick: bool) -> dict:
    from .loader import ProgramConfig, XaggProgram
    from .xdpbench import measure, measure_parallel
    chunks = 256 if quick else 2048
    rows = {}
    for lock in (False, True):
        prog = XaggProgram(ProgramConfig(max_slots=8 * chunks + 64, lock=lock))
        one = measure(prog, n_workers=4, n_chunks=chunks, rounds=2, cpu=0)
        both = measure_parallel(prog, n_workers=4, n_chunks=chunks, rounds=2)
        name = "multi-queue safe (spin lock)" if lock else "single-queue (no lock)"
        rows[name] = {"ns_per_packet": one["ns_per_packet"], "mpps_per_core": one["mpps"],
                      "mpps_2_cores": both["mpps_total"]}
    print("\n== XDP program, BPF_PROG_TEST_RUN, 256 x int32 per packet, 4 workers ==")
    print(f"{'variant':32} {'ns/pkt':>8} {'Mpps/core':>10} {'Mpps 2 cores':>13}")
    for name, r in rows.items():
        print(f"{name:32} {r['ns_per_packet']:8.0f} {r['mpps_per_core']:10.2f} {r['mpps_2_cores']:13.2f}")
    twin = measure_twin(n_chunks=chunks // 4)
    rows["userspace twin (python)"] = twin
    print(f"{'userspace twin (python)':32} {twin['ns_per_packet']:8.0f} {twin['mpps_per_core']:10.2f}")
    best = rows["multi-queue safe (spin lock)"]["mpps_per_core"]
    print(f"XDP (multi-queue safe) / userspace twin, per core: {best / twin['mpps_per_core']:.0f}x")
    print("(each packet timed by the kernel in its own test-run call: includes ~100-130 ns of "
          "test-run overhead per call, see README)")
    return rows


def measure_twin(n_chunks: int) -> dict:
    """The same packet sequence through the userspace twin's state machine
    (no sockets: its best case)."""
    from .frames import split_frame
    from .job import JobSpec
    from .twin import TwinAggregator
    from .xdpbench import workload
    job = JobSpec(job_id=1, cookie=1, n_workers=4, n_chunks=n_chunks,
                  worker_ips=[f"10.77.0.{w + 1}" for w in range(4)])
    twin = TwinAggregator()
    twin.set_job(job)
    pkts = [(split_frame(f)["payload"], (f"10.77.0.{i % 4 + 1}", 40000 + i % 4))
            for i, f in enumerate(workload(job, n_chunks, 2, twin.vals))]
    t0 = time.perf_counter()
    for p, src in pkts:
        twin.handle(p, src)
    ns = (time.perf_counter() - t0) / len(pkts) * 1e9
    return {"ns_per_packet": ns, "mpps_per_core": 1e3 / ns}


SECTIONS = {"xdp": bench_xdp}


def register(name: str, fn) -> None:
    SECTIONS[name] = fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="make bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = ap.parse_args(argv)
    _load_optional_sections()
    names = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    OUT.mkdir(exist_ok=True)
    results = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": os.uname().nodename}
    for n in names:
        t0 = time.perf_counter()
        results[n] = SECTIONS[n](args.quick)
        print(f"[{n}: {time.perf_counter() - t0:.0f}s]", flush=True)
    (OUT / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {OUT / 'bench.json'}")
    return 0


def _load_optional_sections() -> None:
    """Sections that live in other modules register themselves on import."""
    import importlib.util
    for mod in ("xagg.bench_lab", "xagg.bench_compress", "xagg.bench_train"):
        if importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod)
    # run as `python -m xagg.bench`, this module is __main__ and the
    # sections registered themselves with the imported xagg.bench
    from xagg import bench as imported
    SECTIONS.update(imported.SECTIONS)


if __name__ == "__main__":
    sys.exit(main())
