"""Unicast fan-out refused where the driver gives XDP no metadata, through
the real path: xaggd's program attached to a veth, a completion for a
unicast job whose frame has no room left before it for xagg's metadata
(bpf_xdp_adjust_meta fails in the kernel, as on a driver without metadata
support), the program's no_meta verdict, and the daemon refusing the next
unicast job with the fix while broadcast jobs still register."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from test_daemon import XAGGD, Daemon
from veth_pair import veth_pair

from xagg.wire.control import ControlError
from xagg.wire.proto import make_packets
from xagg.wire.syscalls import XDP_DROP, prog_fd_by_id, prog_test_run
from xaggd.dataplane.frames import udp_frame

TAG = f"xur{os.getpid() % 100000}"
NS, IF, IP = f"{TAG}a", "ur0", "10.97.0.1"
PEER = (f"{TAG}b", "ur1", "10.97.0.2")
WORKERS = ["10.97.0.2", "10.97.0.3"]
# A test run's frame has XDP_PACKET_HEADROOM (256) before it; with this much
# metadata there already, no room remains for xagg's 16 bytes past the
# kernel's struct xdp_frame: adjust_meta fails as on a driver without it
FULL_META = b"\0" * 208


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("xaggd-ur")
    with veth_pair((NS, IF, IP), PEER):
        d = Daemon(run_dir, run_dir / "d.log",
                   [XAGGD, "start", "--iface", IF, "--netns", NS, "--max-slots", "64", "--vals", "256"],
                   name=TAG)
        try:
            yield d
        finally:
            d.kill()


def completion(prog_fd, job, chunk, meta=b""):
    """Both workers' packets for ``chunk`` of round 0; the second completes
    it: its run."""
    for w, ip in enumerate(WORKERS):
        pk = make_packets(job_id=job, cookie=1, worker_id=w, round_=0, chunks=np.array([chunk]),
                          values=np.ones((1, 256), np.int32)).tobytes()
        run = prog_test_run(prog_fd, udp_frame(pk, src_ip=ip, dst_ip=IP), meta=meta if w else b"")
    return run


def test_a_completion_without_metadata_makes_the_daemon_refuse_unicast(daemon):
    st = daemon.ready()
    assert st["mode"] == "driver" and st["unicast_problem"] is None
    fd = prog_fd_by_id(st["prog_id"])
    try:
        with daemon.client() as c:
            c.register(61, cookie=1, max_elements=1000, workers=WORKERS, fanout="unicast")
            before = c.stats()["counters"]
            assert completion(fd, 61, 0).action != XDP_DROP                 # handed to tc, with metadata
            assert c.status()["unicast_problem"] is None
            assert completion(fd, 61, 1, meta=FULL_META).action == XDP_DROP
            counters = c.stats()["counters"]
            assert counters["no_meta"] - before.get("no_meta", 0) == 1, counters
            problem = c.status()["unicast_problem"]
            assert problem == (f"{IF}: its driver has no XDP metadata in driver mode (1 unicast completions "
                               "could not reach tc); register the job with fanout bcast, or restart xaggd "
                               "with --mode generic")
            refusal = "fanout: unicast fan-out cannot work here: " + problem
            with pytest.raises(ControlError, match=f"^{re.escape(refusal)}$"):
                c.register(62, cookie=1, max_elements=1000, workers=WORKERS, fanout="unicast")
            assert c.register(63, cookie=1, max_elements=1000, workers=WORKERS, fanout="bcast")["created"]
    finally:
        os.close(fd)
