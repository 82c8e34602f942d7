"""Shared fixtures. Kernel tests need root, bcc and headers: in CI we have
all three, so a missing one is a failure with the loader's own message,
never a skip."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# examples/ is not a package: its scripts are imported by name (train_digits);
# on sys.path before the ranks that tests spawn inherit it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C, make_packets
from xaggd.dataplane.frames import udp_frame
from xagg.wire.syscalls import prog_test_run


@pytest.fixture(scope="session")
def xdp_program():
    from xaggd.dataplane.program import ProgramConfig, XaggProgram
    return XaggProgram(ProgramConfig(max_slots=4096, max_jobs=8))


class Harness:
    """Crafted packets for one job, fed through BPF_PROG_TEST_RUN."""

    _next_job = 100

    def __init__(self, prog, n_workers=3, n_chunks=8, fanout="bcast", job_index=0, slot_base=0, **kw):
        Harness._next_job += 1
        self.prog = prog
        self.spec = JobSpec(job_id=Harness._next_job, cookie=0xC0FFEE, n_workers=n_workers,
                            n_chunks=n_chunks, fanout=fanout,
                            worker_ips=[self.ip(w) for w in range(n_workers)], **kw)
        self.slot_base = slot_base
        prog.set_job(self.spec, slot_base=slot_base, job_index=job_index)

    @staticmethod
    def ip(w):
        return f"10.77.0.{w + 1}"

    def payload(self, w, rnd, chunk, values, **kw):
        kw.setdefault("job_id", self.spec.job_id)
        kw.setdefault("cookie", self.spec.cookie)
        vals = np.broadcast_to(np.asarray(values, np.int32), (C.XAGG_VALS,))[None]
        return make_packets(worker_id=w, round_=rnd, chunks=np.array([chunk]), values=vals, **kw).tobytes()

    def frame(self, w, rnd, chunk, values, src_ip=None, frame_kw=None, **kw):
        return udp_frame(self.payload(w, rnd, chunk, values, **kw), src_ip=src_ip or self.ip(w),
                         sport=40000 + w, **(frame_kw or {}))

    def send(self, w, rnd, chunk, values, **kw):
        return prog_test_run(self.prog.xdp_fn.fd, self.frame(w, rnd, chunk, values, **kw))

    def mask(self, chunk, rnd=0):
        """Contributors summed in this job's slot (0 if the slot is another job's)."""
        s = self.prog.slot(self.slot_base + chunk * 2 + (rnd & 1))
        return s["mask"] if s["gen"] == self.prog.job(self.spec.job_id)["gen"] else 0

    def counters(self):
        return self.prog.counters()


@pytest.fixture
def harness(xdp_program):
    def make(**kw):
        return Harness(xdp_program, **kw)
    return make
