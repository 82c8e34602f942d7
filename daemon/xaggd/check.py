"""`xaggd check`: can this host aggregate in its kernel? Each step says
what it checked and, on failure, how to fix it. Exit 0 only if all pass."""
from __future__ import annotations

import os
import platform
import sys
import time

import numpy as np

from xagg.wire.fanout import Fanout
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import JUMBO_MTU, make_packets, max_vals
from xaggd.dataplane.cost import measure
from xaggd.dataplane.frames import split_frame, udp_frame
from xaggd.dataplane.program import ProgramConfig, XaggProgram, preflight
from xagg.wire.syscalls import XDP_TX, prog_test_run
from xaggd.dataplane.userspace import UserspaceAggregator


class Checker:
    def __init__(self, out=sys.stdout):
        self.out = out
        self.failed = 0

    def step(self, title, fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception as e:  # every failure is reported, none aborts the run
            self.failed += 1
            print(f"  FAIL  {title}: {e}", file=self.out)
            return None
        print(f"  ok    {title}{': ' + detail if detail else ''} ({time.perf_counter() - t0:.1f}s)",
              file=self.out)
        return True


def main(bench_chunks: int = 512) -> int:
    ck = Checker()
    state = {}
    print("xagg preflight", file=ck.out)

    def kernel():
        rel = platform.release()
        major, minor = (int(x) for x in rel.split(".")[:2])
        if (major, minor) < (5, 15):
            raise RuntimeError(f"kernel {rel} is older than 5.15 (bpf_spin_lock in XDP, bounded loops)")
        if os.geteuid() != 0:
            raise RuntimeError("not root: run `sudo xaggd check`")
        return f"Linux {rel}, root"

    def toolchain():
        preflight()
        return f"bcc importable, headers at /lib/modules/{platform.release()}/build"

    def compile_verify():
        state["prog"] = XaggProgram(ProgramConfig(vals=max_vals(), max_slots=4 * bench_chunks + 64))
        return f"xagg_xdp and xagg_tc_fanout accepted by the verifier (MTU 1500, {max_vals()} values/packet)"

    def compile_jumbo():
        state["jumbo"] = XaggProgram(ProgramConfig(vals=max_vals(JUMBO_MTU), mtu=JUMBO_MTU,
                                                   max_slots=4 * bench_chunks + 64))
        return (f"multi-buffer build for MTU {JUMBO_MTU} ({max_vals(JUMBO_MTU)} values/packet) "
                "accepted with BPF_F_XDP_HAS_FRAGS")

    def differential(prog):
        spec = JobSpec(job_id=1, cookie=42, n_workers=3, n_chunks=4, fanout=Fanout.BCAST,
                       worker_ips=["10.77.0.1", "10.77.0.2", "10.77.0.3"])
        prog.set_job(spec, slot_base=0, job_index=0)
        reference = UserspaceAggregator(vals=prog.config.vals)
        reference.set_job(spec)
        rng = np.random.default_rng(7)
        n = 0
        for rnd in range(3):
            for chunk in range(4):
                for w in list(range(3)) + [0]:          # last one: a retransmission
                    cookie = 43 if rng.random() < 0.1 else 42
                    p = make_packets(job_id=1, cookie=cookie, worker_id=w, round_=rnd,
                                     chunks=np.array([chunk]),
                                     values=rng.integers(-2**20, 2**20, (1, prog.config.vals),
                                                         dtype=np.int32)).tobytes()
                    src = (f"10.77.0.{w + 1}", 40000 + w)
                    run = prog_test_run(prog.xdp_fn.fd, udp_frame(p, src_ip=src[0], sport=src[1]))
                    verdict, replies = reference.handle(p, src)
                    kernel_out = split_frame(run.data)["payload"] if run.action == XDP_TX else None
                    reference_out = replies[0].payload if replies else None
                    if kernel_out != reference_out:
                        raise RuntimeError(f"the kernel program and the userspace aggregator disagree "
                                           f"on packet {n} ({verdict})")
                    n += 1
        return f"{n} crafted packets through BPF_PROG_TEST_RUN match the userspace aggregator"

    def speed(prog):
        r = measure(prog, n_workers=4, n_chunks=bench_chunks, rounds=2, job_index=1)
        return (f"{r['ns_per_packet']:.0f} ns/packet = {r['mpps']:.2f} Mpps = {r['gbps_payload']:.1f} Gbit/s of "
                f"payload per core ({prog.config.vals} values/packet, multi-queue safe build)")

    for title, fn in (("kernel and privileges", kernel), ("bcc and kernel headers", toolchain),
                      ("compile and verify the XDP program", compile_verify)):
        if not ck.step(title, fn):
            break
    if "prog" in state:
        ck.step("in-kernel sums equal the userspace aggregator's", lambda: differential(state["prog"]))
        ck.step("throughput (test-run), MTU 1500", lambda: speed(state["prog"]))
        if ck.step("compile and verify the jumbo-frame build", compile_jumbo):
            ck.step("jumbo sums equal the userspace aggregator's", lambda: differential(state["jumbo"]))
            ck.step(f"throughput (test-run), MTU {JUMBO_MTU}", lambda: speed(state["jumbo"]))
    print("all checks passed" if not ck.failed else f"{ck.failed} check(s) failed", file=ck.out)
    return 0 if not ck.failed else 1


if __name__ == "__main__":
    sys.exit(main())
