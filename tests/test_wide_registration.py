"""The control plane with 1,024 workers: a real xaggd (XDP on a veth in a
namespace this test makes) registers a 1,024-worker job through its control
socket, with a child aggregator whose workers span blocks, refuses what its
data plane cannot serve naming the field, and sums real packets from all
1,024 worker ids sent over the veth."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from pyroute2 import netns
from veth_pair import veth_pair

from xagg.lab.xdp_pass import attach_pass
from xagg.wire.control import ControlClient, ControlError
from xagg.wire.proto import HDR_SIZE, C, make_packets

XAGGD = str(Path(sys.executable).parent / "xaggd")
NS_A, NS_B = "we-rega", "we-regb"
IF_A, IF_B = "we0", "we1"
IP_A, IP_B = "10.97.0.1", "10.97.0.2"
N = 1024
VALS = 256
READY_S = 180
RESULT_PORT = 9978


def worker_ip(w: int) -> str:
    return f"10.78.{w // 250}.{w % 250 + 1}"


def in_ns(ns, kind=socket.SOCK_DGRAM):
    netns.pushns(ns)
    try:
        return socket.socket(socket.AF_INET, kind)
    finally:
        netns.popns()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("wereg")
    with veth_pair((NS_A, IF_A, IP_A), (NS_B, IF_B, IP_B)):
        attach_pass(IF_B, NS_B)             # a veth takes its peer's XDP_TX frames only with XDP on
        log = open(run_dir / "xaggd.log", "w")
        proc = subprocess.Popen([XAGGD, "start", "--iface", IF_A, "--netns", NS_A, "--max-slots", "400",
                                 "--max-jobs", "4", "--vals", str(VALS), "--name", "wereg",
                                 "--run-dir", str(run_dir)], stdout=log, stderr=subprocess.STDOUT)
        control = str(run_dir / "wereg.sock")
        try:
            end = time.monotonic() + READY_S
            while True:
                assert proc.poll() is None, (run_dir / "xaggd.log").read_text()
                try:
                    with ControlClient(control, timeout=5) as c:
                        c.status()
                    break
                except ControlError:
                    assert time.monotonic() < end, (run_dir / "xaggd.log").read_text()
                    time.sleep(0.2)
            yield control
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def test_a_1024_worker_job_registers_with_a_wide_child(daemon):
    ips = [worker_ip(w) for w in range(N)]
    kids = list(range(100, 300))
    with ControlClient(daemon) as c:
        assert c.status()["max_workers"] == N
        ans = c.register({"job_id": 31, "cookie": 7, "max_elements": 4 * VALS, "workers": ips,
                          "fanout": "bcast", "aggregators": ["10.97.0.1:9977", "10.97.0.3:9977"],
                          "agg_index": 0, "children": [{"addr": "10.97.0.3", "workers": kids}]})
        assert ans["created"]
        job = next(j for j in c.list_jobs() if j["job_id"] == 31)
        assert job["n_workers"] == N and job["workers"] == ips
        assert job["children"] == [{"addr": "10.97.0.3", "workers": sum(1 << w for w in kids)}]
        # unicast would send each result 1,024 times: refused, naming the field
        with pytest.raises(ControlError, match=r"fanout: unicast .* a job of 1024 needs bcast"):
            c.register(32, cookie=7, max_elements=VALS, n_workers=N, fanout="unicast")
        with pytest.raises(ControlError, match=r"n_workers: 1025 workers, this aggregator takes at most 1024"):
            c.register(33, cookie=7, max_elements=VALS, n_workers=N + 1, fanout="bcast")
        c.remove(31)


def test_1024_workers_packets_over_the_veth_make_one_exact_sum(daemon):
    """Every worker id's packet for one chunk, from the other namespace: the
    broadcast result is the exact sum, and a repeat is counted a duplicate."""
    rng = np.random.default_rng(5)
    vals = rng.integers(-5000, 5000, size=(N, VALS), dtype=np.int32)
    with ControlClient(daemon) as c:
        c.register(34, cookie=9, max_elements=VALS, n_workers=N, fanout="bcast", result_port=RESULT_PORT)
        before = c.stats()["counters"]
        with in_ns(NS_B) as s, in_ns(NS_B) as r:
            r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            r.bind(("0.0.0.0", RESULT_PORT))
            r.settimeout(20)
            for w in range(N):
                pk = make_packets(job_id=34, cookie=9, worker_id=w, round_=0, chunks=np.array([0]),
                                  values=vals[w:w + 1]).tobytes()
                s.sendto(pk, (IP_A, C.XAGG_PORT))
                if w == 10:
                    s.sendto(pk, (IP_A, C.XAGG_PORT))      # a duplicate, before the chunk completes
            try:
                data = r.recv(65536)
            except TimeoutError:
                raise AssertionError(f"no result: {c.stats()['counters']} (before: {before})") from None
        got = np.frombuffer(data[HDR_SIZE:], "<i4")
        assert (got == vals.sum(axis=0, dtype=np.int64).astype(np.int32)).all()
        after = c.stats()
        d = {k: after["counters"][k] - before[k] for k in ("aggregated", "completed", "duplicate")}
        assert d == {"aggregated": N - 1, "completed": 1, "duplicate": 1}
        assert after["jobs"]["34"]["completed"] == 1
        c.remove(34)
