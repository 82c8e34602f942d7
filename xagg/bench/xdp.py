"""`make bench` section "xdp": the XDP program's cost per packet in
BPF_PROG_TEST_RUN (the MTU-1500 build and the multi-buffer build for MTU
9000, each single-queue and multi-queue-safe, one and two cores), next to
the userspace aggregator on the same packet sequence."""
from __future__ import annotations

import time

from xagg.wire.fanout import Fanout
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import JUMBO_MTU, max_vals
from xaggd.dataplane.cost import measure, measure_parallel, workload
from xaggd.dataplane.frames import split_frame
from xaggd.dataplane.program import ProgramConfig, XaggProgram
from xaggd.dataplane.userspace import UserspaceAggregator


def run(quick: bool) -> dict:
    chunks = 256 if quick else 1024
    rows = {}
    for mtu in (1500, JUMBO_MTU):
        vals = max_vals(mtu)
        for lock in (False, True):
            prog = XaggProgram(ProgramConfig(vals=vals, mtu=mtu, max_slots=8 * chunks + 64, lock=lock))
            one = measure(prog, n_workers=4, n_chunks=chunks, rounds=2, cpu=0)
            both = measure_parallel(prog, n_workers=4, n_chunks=chunks, rounds=2)
            prog.close()
            name = (f"MTU {mtu}, {vals} vals, " + ("multi-buffer, " if prog.config.multi_buffer else "")
                    + ("spin lock" if lock else "no lock (1 queue)"))
            rows[name] = {"mtu": mtu, "vals": vals, "lock": lock, "ns_per_packet": one["ns_per_packet"],
                          "mpps_per_core": one["mpps"], "mpps_2_cores": both["mpps_total"],
                          "gbps_payload_per_core": one["gbps_payload"]}
    print("\n== XDP program, BPF_PROG_TEST_RUN, 4 workers ==")
    print(f"{'variant':52} {'ns/pkt':>8} {'Mpps/core':>10} {'Gbit/s/core':>12} {'Mpps 2 cores':>13}")
    for name, r in rows.items():
        print(f"{name:52} {r['ns_per_packet']:8.0f} {r['mpps_per_core']:10.2f} {r['gbps_payload_per_core']:12.1f} "
              f"{r['mpps_2_cores']:13.2f}")
    py = measure_userspace(n_chunks=chunks // 4)
    rows["userspace aggregator (python)"] = py
    print(f"{'userspace aggregator (python), 256 vals':52} {py['ns_per_packet']:8.0f} {py['mpps_per_core']:10.2f} "
          f"{py['gbps_payload_per_core']:12.1f}")
    best = rows[f"MTU 1500, {max_vals(1500)} vals, spin lock"]
    print(f"XDP (multi-queue safe, MTU 1500) / userspace aggregator, payload per core: "
          f"{best['gbps_payload_per_core'] / py['gbps_payload_per_core']:.0f}x")
    print("(each packet timed by the kernel in its own test-run call: includes ~100-130 ns of "
          "test-run overhead per call, see README)")
    return rows


def measure_userspace(n_chunks: int) -> dict:
    """The same packet sequence through the userspace aggregator's state
    machine (no sockets: its best case)."""
    job = JobSpec(job_id=1, cookie=1, n_workers=4, n_chunks=n_chunks, fanout=Fanout.BCAST,
                  worker_ips=[f"10.77.0.{w + 1}" for w in range(4)])
    agg = UserspaceAggregator()
    agg.set_job(job)
    pkts = [(split_frame(f)["payload"], (f"10.77.0.{i % 4 + 1}", 40000 + i % 4))
            for i, f in enumerate(workload(job, n_chunks, 2, agg.vals))]
    t0 = time.perf_counter()
    for p, src in pkts:
        agg.handle(p, src)
    ns = (time.perf_counter() - t0) / len(pkts) * 1e9
    return {"ns_per_packet": ns, "mpps_per_core": 1e3 / ns, "gbps_payload_per_core": agg.vals * 32 / ns}
