"""The AF_XDP exchange on real veths in a lab, against xaggd's XDP
aggregator: sums equal to the bit to the UDP path's, every result read from
the RX ring, and the UDP path (with the reason) wherever AF_XDP cannot run:
the queue held by another socket, no capabilities, packets too large for a
frame."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xagg.client import Client, xsk
from xagg.client.config import ClientConfig, XaggError
from xagg.client.exchange_afxdp import TX_ENV
from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect, start_xagg
from xagg.lab.traffic import check_sums

SIZES = [1, 257, 1_000_003]

# make setup installs libxdp-dev, so as root a library that does not build is
# a failure of every test here (with the build's message), never a skip
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(scope="module", autouse=True)
def built():
    xsk.load()


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"ax{os.getpid() % 100000}", workers=3, aggregators=1)) as lab:
        yield lab


@pytest.fixture(scope="module")
def aggs(lab):
    with Aggregators(lab, "xdp", max_slots=65536) as a:
        yield a


def outputs(d: Path) -> dict:
    return {f.name: np.load(f) for f in sorted(d.glob("*.npy"))}


@pytest.mark.parametrize("fanout,tx", [("unicast", ""), ("unicast", "ring"), ("bcast", "ring")])
def test_sums_equal_the_udp_paths_and_come_through_the_ring(lab, aggs, fanout, tx, tmp_path, monkeypatch):
    """tx "": veth is copy mode, so requests leave through the UDP socket;
    "ring": from the TX ring."""
    monkeypatch.setenv(TX_ENV, tx)
    runs = {}
    for path in ("udp", "afxdp"):
        d = tmp_path / path
        d.mkdir()
        reports = collect(start_xagg(lab, aggs, SIZES, rounds=2, fanout=fanout, n_workers=3, out_dir=str(d),
                                     seed=3, path=path)[1], timeout=300)
        check_sums(d, 3, 2, SIZES, seed=3)
        runs[path] = (outputs(d), [r["stats"] for r in reports])
    (udp, udp_stats), (ax, ax_stats) = runs["udp"], runs["afxdp"]
    assert udp.keys() == ax.keys() and all(np.array_equal(udp[k], ax[k]) for k in udp)
    assert [s["path"] for s in udp_stats] == ["udp"] * 3
    for s in ax_stats:
        assert s["path"] == "afxdp" and s["path_reason"].startswith("eth0 queue 0, copy mode"), s
        info = s["extra"]["afxdp"]
        # every result came through the RX ring (none through the socket)
        assert info["rx_frames"] >= s["results"] > 0
        assert info["tx_ring"] == (tx == "ring") and info["tx_invalid_descs"] == 0
        # the ring's sends are kicked: the kernel sent only when told to
        assert (info["kicks"] > 0) == (tx == "ring")


HOLD = """
import ctypes, socket, sys
from xagg.client import Client, xsk
dll, obj = xsk.load()
err = ctypes.create_string_buffer(512)
p = dll.xagg_xsk_open(b"eth0", socket.if_nametoindex("eth0"), 0, obj.encode(), socket.htons(9), bytes(42), 1,
                      2048, 1, err, len(err))
print("held" if p else err.value.decode(), flush=True)
sys.stdin.read()
"""


def spawn_worker(lab, aggs, job, w, n, out, path="afxdp", wrap=()):
    job_id, cookie = job
    return lab.spawn(f"w{w}", [*wrap, sys.executable, "-m", "xagg.lab.traffic", "--job-id", str(job_id),
                               "--cookie", str(cookie), "--worker", str(w), "--workers", str(n),
                               "--aggregators", aggs.hosts[0].ip, "--sizes", ",".join(map(str, SIZES)),
                               "--rounds", "1", "--vals", str(aggs.vals), "--out", str(out), "--path", path],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def one_job(lab, aggs, n, out, wraps=None, path="afxdp"):
    job = (random.randrange(1, 2**31), random.randrange(2**32))
    aggs.register(*job, n, max(SIZES), "unicast")
    try:
        procs = [spawn_worker(lab, aggs, job, w, n, out, path, wrap=(wraps or {}).get(w, ())) for w in range(n)]
        return {r["worker"]: r["stats"] for r in collect(procs, timeout=300)}
    finally:
        aggs.remove(job[0])


def test_a_held_queue_leaves_the_client_on_udp_and_says_why(lab, aggs, tmp_path):
    holder = lab.spawn("w0", [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        stats = one_job(lab, aggs, 2, tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(30)
    check_sums(tmp_path, 2, 1, SIZES)
    assert stats[0]["path"] == "udp" and "every queue of eth0 (0)" in stats[0]["path_reason"], stats[0]
    assert stats[1]["path"] == "afxdp"


@pytest.mark.parametrize("path", ["afxdp", "auto"])
def test_without_capabilities_the_client_runs_udp_and_says_why(lab, aggs, tmp_path, path):
    drop = ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--"]
    stats = one_job(lab, aggs, 2, tmp_path, wraps={1: drop}, path=path)
    check_sums(tmp_path, 2, 1, SIZES)
    assert stats[1]["path"] == "udp" and "Operation not permitted" in stats[1]["path_reason"], stats[1]
    assert stats[0]["path"] == "afxdp", stats[0]["path_reason"]


def test_jumbo_packets_do_not_fit_a_frame():
    with pytest.raises(xsk.XskUnavailable, match="do not fit one UMEM frame"):
        xsk.frame_size(9000)
    assert xsk.frame_size(1424) == 2048


def test_the_path_setting_is_checked():
    with pytest.raises(XaggError, match="config.path: must be one of udp, afxdp, auto"):
        ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1"], path="dpdk")


TWO = """
import json, sys
from xagg.client import Client, ClientConfig
cfgs = [ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=[sys.argv[1]], path="auto")
        for _ in range(2)]
with Client(cfgs[0]) as a, Client(cfgs[1]) as b:
    print(json.dumps([[c.stats.path, c.stats.path_reason] for c in (a, b)]))
"""


def test_a_second_client_on_the_interface_runs_udp_and_says_why(lab, aggs):
    r = lab.exec("w2", [sys.executable, "-c", TWO, aggs.hosts[0].ip], capture_output=True, text=True, check=True)
    (first, _), (second, why) = json.loads(r.stdout)
    assert first == "afxdp" and second == "udp"
    assert "every queue of eth0 (0) has an AF_XDP socket already" in why


def test_an_aggregator_on_this_host_keeps_the_client_on_udp():
    cfg = ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1"], path="afxdp")
    with Client(cfg) as c:
        assert c.stats.path == "udp" and "an aggregator on this host" in c.stats.path_reason
