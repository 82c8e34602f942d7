"""xaggd for real: root, the bcc-compiled program, a veth pair inside two
network namespaces this module creates (and deletes), the daemon as a
subprocess. Nothing touches the machine's own interfaces.

    netns xdtPIDa: xd0 10.98.0.1  <-- veth -->  netns xdtPIDb: xd1 10.98.0.2
                   (xaggd attaches here)                     (test traffic)

Compiling the program costs seconds, so one daemon (A, started with
--netns) serves most tests and starts compiling while the userspace test
runs; the crash test then kills it and starts B (via `ip netns exec`),
which must replace the program A left behind.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pyroute2 import netns
from veth_pair import veth_pair

from xagg.client import Client, ClientConfig
from xagg.client.fixedpoint import tolerance
from xagg.wire import chunks
from xagg.wire.control import ControlClient, ControlError
from xagg.wire.proto import C, make_packets, max_vals
from xaggd.dataplane.attach import (
    TC_PRIO,
    XDP_FLAGS_DRV_MODE,
    attach,
    ifindex,
    iproute,
    set_xdp,
    xdp_attached,
    xdp_program,
)
from xagg.wire.syscalls import prog_load

XAGGD = str(Path(sys.executable).parent / "xaggd")
TAG = f"xdt{os.getpid() % 100000}"
NS_A, NS_B = f"{TAG}a", f"{TAG}b"
IF_A, IF_B = "xd0", "xd1"
IP_A, IP_B = "10.98.0.1", "10.98.0.2"
NAME = f"{TAG}"
TOKEN = "test-token-0123456789abcdef"
MAX_SLOTS = 400
READY_S = 180          # generous: compiling competes with whatever else runs
XDP_PASS_INSNS = bytes.fromhex("b700000002000000" "9500000000000000")     # r0 = XDP_PASS; exit
TC_OK_INSNS = bytes.fromhex("b700000000000000" "9500000000000000")        # r0 = TC_ACT_OK; exit


# -- plumbing ----------------------------------------------------------------------
def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True)


def wait_for(cond, what, limit=30.0):
    """Poll until cond() is truthy (state that changes asynchronously)."""
    end = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


class Daemon:
    def __init__(self, run_dir: Path, log: Path, argv: list[str], name: str = NAME):
        self.run_dir, self.log_path, self.name = run_dir, log, name
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv + ["--name", name, "--run-dir", str(run_dir)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.control = str(run_dir / f"{name}.sock")

    def client(self, **kw) -> ControlClient:
        return ControlClient(self.control, **kw)

    def ready(self) -> dict:
        end = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"xaggd exited with {self.proc.returncode}:\n{self.text()}")
            try:
                with self.client(timeout=5) as c:
                    return c.status()
            except ControlError:
                if time.monotonic() > end:
                    raise AssertionError(f"xaggd not ready after {READY_S}s:\n{self.text()}") from None
                time.sleep(0.1)

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def cli(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([XAGGD, *args, "--name", self.name, "--run-dir", str(self.run_dir)],
                              capture_output=True, text=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xaggd")


@pytest.fixture(scope="module")
def token_file(run_dir):
    p = run_dir / "token"
    p.write_text(TOKEN + "\n")
    p.chmod(0o600)
    return str(p)


@pytest.fixture(scope="module")
def veth():
    with veth_pair((NS_A, IF_A, IP_A), (NS_B, IF_B, IP_B)):
        yield


@pytest.fixture(scope="module", autouse=True)
def daemon_a(veth, run_dir, token_file):
    """Started when the module starts, so it compiles while the first test runs."""
    d = Daemon(run_dir, run_dir / "a.log",
               [XAGGD, "start", "--iface", IF_A, "--netns", NS_A, "--max-slots", str(MAX_SLOTS),
                "--max-jobs", "4", "--listen", "127.0.0.1:0", "--token-file", token_file,
                "--vals", "256",        # these tests size packets at 256 (the MTU would give 358)
                "--metrics", "127.0.0.1:0"])
    yield d
    d.kill()


@pytest.fixture
def a(daemon_a):
    daemon_a.ready()
    return daemon_a


def job_req(job_id, elements, **kw):
    return {"job_id": job_id, "cookie": 0xC0FFEE, "max_elements": elements, "n_workers": 2, **kw}


def slots_for(elements):
    return 2 * chunks.capacity(elements, 256, [1.0])[0]


# -- userspace: a real allreduce through two daemons ------------------------------------
def test_userspace_daemons_serve_an_allreduce_over_two_aggregators(run_dir):
    weights = [2.0, 1.0]
    sizes = [1, 300, 20_000]
    daemons = [Daemon(run_dir, run_dir / f"u{k}.log",
                      [XAGGD, "start", "--userspace", "--bind", "127.0.0.1", "--port", "0",
                       "--memory", "8M"], name=f"{NAME}u{k}") for k in range(2)]
    try:
        ports = [d.ready()["port"] for d in daemons]
        assert all(d.ready()["backend"] == "userspace" for d in daemons)
        aggs = [{"addr": f"127.0.0.1:{p}", "weight": w} for p, w in zip(ports, weights)]
        for k, d in enumerate(daemons):
            with d.client() as c:
                r = c.register(31, cookie=5, max_elements=max(sizes), workers=["127.0.0.1"] * 2,
                               fanout="unicast", aggregators=aggs, agg_index=k)
                assert r["job"]["n_chunks"] == chunks.capacity(max(sizes), 256, weights)[k]
        out, errors = {}, []

        def worker(wid):
            try:
                cfg = ClientConfig(job_id=31, cookie=5, worker_id=wid, n_workers=2, fanout="unicast",
                                   aggregators=[f"127.0.0.1:{p}" for p in ports], weights=weights,
                                   timeout=30)
                with Client(cfg) as cl:
                    out[wid] = [cl.allreduce(np.random.default_rng(10 * wid + n).standard_normal(n)
                                             .astype(np.float32)) for n in sizes]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i, n in enumerate(sizes):
            xs = [np.random.default_rng(10 * w + n).standard_normal(n).astype(np.float32) for w in range(2)]
            want = np.sum(np.array(xs, np.float64), axis=0)
            tol = tolerance(max(float(np.abs(x).max()) for x in xs), 2)
            for w in range(2):
                assert np.max(np.abs(out[w][i] - want)) <= tol
            assert np.array_equal(out[0][i], out[1][i])
        for d in daemons:
            with d.client() as c:
                st = c.stats()
            assert st["counters"]["completed"] > 0 and st["counters"]["malformed"] == 0
            assert st["jobs"]["31"]["completed"] == st["counters"]["completed"]
        assert "userspace mode" in daemons[0].text()
    finally:
        for d in daemons:
            d.kill()
    assert [d.proc.returncode for d in daemons] == [0, 0]


def test_the_unix_socket_answers_while_the_tcp_port_is_flooded(run_dir, token_file):
    """Hundreds of idle connections to the TCP control port: at most
    --max-connections are served (a thread each), every one that does not
    authenticate is closed at the deadline, and the Unix socket keeps answering."""
    d = Daemon(run_dir, run_dir / "flood.log",
               [XAGGD, "start", "--userspace", "--bind", "127.0.0.1", "--port", "0", "--memory", "1M",
                "--listen", "127.0.0.1:0", "--token-file", token_file, "--max-connections", "16"],
               name=f"{NAME}f")
    idle = []
    try:
        port = int(d.ready()["listen"].rsplit(":", 1)[1])
        threads = lambda: int(next(line.split()[1] for line in open(f"/proc/{d.proc.pid}/status")  # noqa: E731
                                   if line.startswith("Threads:")))
        base = threads()
        for _ in range(400):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for _ in range(5):
            with d.client(timeout=30) as c:
                assert c.status()["name"] == f"{NAME}f"
        assert threads() <= base + 16
        # every one closed by the daemon, none kept: refused at once as busy,
        # or (the few it served) at the AUTH deadline; each says which
        said = []
        for s in idle:
            s.settimeout(60)                             # a liveness bound: the deadline is 5 s
            f = s.makefile("rb")
            said.append(json.loads(f.readline())["error"])
            assert f.readline() == b""
        busy = "busy: too many unauthenticated connections from this address; try again later"
        deadline = "auth: no AUTH line within 5s"
        assert set(said) <= {busy, deadline} and said.count(busy) > 0, set(said)
        with ControlClient(f"127.0.0.1:{port}", token=TOKEN) as c:
            assert c.status()["name"] == f"{NAME}f"
        log = d.text()
        assert 0 < log.count("refused") + log.count("sent no AUTH line") <= 12
    finally:
        for s in idle:
            s.close()
        d.kill()
    assert d.proc.returncode == 0


# -- the XDP daemon ----------------------------------------------------------------------
def test_status_shows_attached_interface_and_mode(a):
    r = a.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["running"] and st["backend"] == "xdp" and st["attached"]
    assert (st["iface"], st["netns"], st["mode"]) == (IF_A, NS_A, "driver")     # veth: native XDP
    assert st["memory"]["max_slots"] == MAX_SLOTS and st["uptime_s"] > 0 and st["pid"] == a.proc.pid
    assert xdp_attached(IF_A, NS_A) == "xdp"
    # `ip link add ... type veth` allocates a queue per CPU but uses one: no lock needed
    assert st["slot_lock"] == "off (one RX queue in driver mode: XDP runs on one CPU at a time)"
    # the build's packet rate, measured at start (the planner's packet capacity)
    assert st["rx_queues"] == 1 and 1e5 < st["pps_per_queue"] < 1e8, st
    r = a.cli("status")
    assert "Mpps per core (measured at start) x 1 RX queue(s)" in r.stdout
    assert r.returncode == 0 and f"XDP on {IF_A} (netns {NS_A}), driver mode, attached" in r.stdout
    assert "slot lock:  off (one RX queue" in r.stdout
    # the Unix socket is root's alone
    assert oct(os.stat(a.control).st_mode & 0o777) == "0o600"


def test_register_over_the_unix_socket(a):
    with a.client() as c:
        r = c.register(1, cookie=7, max_elements=5000, workers=[IP_B, ""])
        assert r["created"] and r["port"] == 9977 and r["vals"] == 256
        job = r["job"]
        assert job["n_chunks"] == chunks.capacity(5000, 256, [1.0])[0] and job["n_slots"] == slots_for(5000)
        assert [j["job_id"] for j in c.list_jobs()] == [1]
        again = {"job_id": 1, "cookie": 7, "max_elements": 5000, "workers": [IP_B, ""]}
        assert c.register(again)["created"] is False      # the request-dict form, idempotent
        with pytest.raises(ControlError, match="already registered with other parameters"):
            c.register(1, cookie=8, max_elements=5000, n_workers=2)
        c.remove(1)
        assert c.list_jobs() == []


def tcp_exchange(port, lines, closes=True):
    """Send raw request lines on one TCP connection; their responses, and
    (``closes``) what follows them: b"" when the daemon closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        f = s.makefile("rb")
        out = []
        for line in lines:
            s.sendall(line + b"\n")
            resp = f.readline()
            if not resp:
                break
            out.append(json.loads(resp))
        if closes:
            out.append(f.readline())
        return out


def test_tcp_control_authenticates_each_connection_first(a):
    port = int(a.ready()["listen"].rsplit(":", 1)[1])
    reg = json.dumps({"op": "register", **job_req(2, 1000)}).encode()
    no_auth = tcp_exchange(port, [reg, b'{"op": "list"}'])
    assert no_auth[0] == {"ok": False, "error": no_auth[0]["error"]}
    assert no_auth[0]["error"].startswith("auth: the first line") and no_auth[1] == b""   # closed
    old_style = tcp_exchange(port, [json.dumps({"op": "list", "token": TOKEN}).encode()])
    assert old_style[0]["error"].startswith("auth: the first line") and old_style[1] == b""
    wrong = tcp_exchange(port, [b"AUTH " + (TOKEN[:-1] + "x").encode()])
    assert wrong[0]["error"] == "auth: wrong token" and wrong[1] == b""
    with a.client() as c:
        assert c.list_jobs() == []                       # nothing was registered
    resp = tcp_exchange(port, [b"AUTH " + TOKEN.encode(), b'{"op": "list"}', b'{"op": "list"}'],
                        closes=False)
    assert resp[0] == {"ok": True, "role": "admin"} and resp[1]["ok"] and resp[2]["ok"]   # stays open
    with ControlClient(f"127.0.0.1:{port}", token=TOKEN) as c:
        assert c.register(2, cookie=1, max_elements=1000, n_workers=2)["created"]
        assert c.remove(2)["freed_slots"] == slots_for(1000)
    with ControlClient(f"127.0.0.1:{port}") as c, pytest.raises(ControlError, match="token: .* needs a token"):
        c.status()
    assert "refused: wrong token" in a.text()


def test_malformed_requests_are_refused_naming_the_field(a):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(a.control)
        f = s.makefile("rb")

        def ask(line):
            s.sendall(line + b"\n")
            return json.loads(f.readline())
        assert ask(b"this is not json")["error"].startswith("request: not valid JSON")
        assert ask(b'{"op": "register", "job_id": 3, "cookie": 1, "max_elements": "big", "n_workers": 2}'
                   )["error"].startswith("max_elements: must be a positive integer, got 'big'")
        assert ask(b'{"op": "register", "job_id": 3, "cookie": 1, "max_elements": 9, "workers": ["1.2.3.x"]}'
                   )["error"] == "workers[0]: not an IPv4 address: '1.2.3.x'"
        assert ask(b'{"op": "register", "job_id": 3, "cookie": 1, "max_elements": 9, "n_workers": 1025}'
                   )["error"].startswith("n_workers: 1025 workers, this aggregator takes at most 1024")
        assert ask(b'{"op": "resize", "job_id": 3, "max_elements": 9}')["error"].startswith("job_id: no job 3")
        assert ask(b'{"op": "status", "verbose": true}')["error"].startswith("verbose: unknown field for status")
        ok = ask(b'{"op": "list", "id": "x1"}')          # still serving; the id is echoed
        assert ok["ok"] and ok["id"] == "x1" and ok["jobs"] == []


def test_jobs_share_memory_and_remove_frees_it(a):
    with a.client() as c:
        free = c.status()["memory"]["free_slots"]
        assert free == MAX_SLOTS
        j1 = c.register(11, **{k: v for k, v in job_req(11, 30_000).items() if k != "job_id"})["job"]
        j2 = c.register(12, **{k: v for k, v in job_req(12, 12_000).items() if k != "job_id"})["job"]
        r1 = range(j1["slot_base"], j1["slot_base"] + j1["n_slots"])
        r2 = range(j2["slot_base"], j2["slot_base"] + j2["n_slots"])
        assert not set(r1) & set(r2) and j1["job_index"] != j2["job_index"]
        left = MAX_SLOTS - j1["n_slots"] - j2["n_slots"]
        big = 256 * 100                                  # 100 + 1 meta chunks -> 202 slots
        assert left < slots_for(big) <= j1["n_slots"]
        with pytest.raises(ControlError) as e:
            c.register(13, cookie=1, max_elements=big, n_workers=2)
        msg = str(e.value)
        assert f"needs {slots_for(big)} slots" in msg and f"but {left} slots" in msg and "are free" in msg
        assert [j["job_id"] for j in c.list_jobs()] == [11, 12]
        assert c.remove(11)["memory"]["free_slots"] == left + j1["n_slots"]
        j3 = c.register(13, cookie=1, max_elements=big, n_workers=2)["job"]
        assert j3["slot_base"] == 0 and j3["job_index"] == j1["job_index"]     # reused
        st = c.status()
        assert {j["job_id"] for j in st["jobs"]} == {12, 13}
        assert st["memory"]["used_slots"] == j2["n_slots"] + j3["n_slots"]
        # resize: the job keeps its index; reset: a new generation
        rs = c.resize(12, 6000)["job"]
        assert rs["job_index"] == j2["job_index"] and rs["n_slots"] == slots_for(6000)
        assert c.reset(12)["resets"] == 1
        for j in (12, 13):
            c.remove(j)
        assert c.status()["memory"]["free_slots"] == MAX_SLOTS


def sender_in(ns):
    """A UDP socket living in network namespace ``ns``."""
    netns.pushns(ns)
    try:
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    finally:
        netns.popns()


def test_stats_count_real_packets(a):
    with a.client() as c:
        c.register(21, cookie=99, max_elements=3 * 256, workers=[IP_B, ""])
        before = c.stats()
        ones = np.ones((3, 256), np.int32)
        pk = lambda **kw: make_packets(job_id=21, cookie=99, round_=0, **kw).tobytes()  # noqa: E731
        with sender_in(NS_B) as s:
            for w, chunks in ((0, [0, 1, 2]), (1, [0])):
                for ch in chunks:
                    s.sendto(pk(worker_id=w, chunks=np.array([ch]), values=ones[:1]), (IP_A, 9977))
            s.sendto(make_packets(job_id=22, cookie=99, worker_id=0, round_=0, chunks=np.array([0]),
                                  values=ones[:1]).tobytes(), (IP_A, 9977))
            s.sendto(make_packets(job_id=21, cookie=98, worker_id=0, round_=0, chunks=np.array([0]),
                                  values=ones[:1]).tobytes(), (IP_A, 9977))
        delta = lambda st: {k: v - before["counters"][k] for k, v in st["counters"].items()}  # noqa: E731
        st = wait_for(lambda: (lambda s: s if sum(v for k, v in delta(s).items() if k != "passed") >= 6
                               else None)(c.stats()), "6 xagg packets counted")
        d = delta(st)
        assert {k: d[k] for k in ("aggregated", "completed", "unknown_job", "bad_cookie")} == \
            {"aggregated": 3, "completed": 1, "unknown_job": 1, "bad_cookie": 1}
        assert st["jobs"]["21"] == {"aggregated": 4, "completed": 1, "retransmits": 0, "dropped": 0,
                                    "bytes_aggregated": 4 * 256 * 4}
        assert st["packets"] - before["packets"] == 6
        r = a.cli("stats", "--json", "--interval", "0.2", "--job", "21")
        assert r.returncode == 0, r.stderr
        js = json.loads(r.stdout)
        assert js["jobs"]["21"]["aggregated"] == 4 and "packets_per_s" in js["rates"]
        assert set(js["rates"]["counters_per_s"]) == set(js["counters"])
        r = a.cli("stats", "--interval", "0.1")
        assert r.returncode == 0 and "aggregated" in r.stdout and "xagg packets:" in r.stdout
        c.remove(21)


def test_a_frame_for_another_aggregator_of_the_job_is_dropped_and_counted(a):
    """A daemon-registered job knows which of its aggregators this is: chunk 0
    of aggregator 1 is not this one's chunk 0 (verdict wrong_agg)."""
    with a.client() as c:
        c.register(23, cookie=99, max_elements=4 * 256, workers=[IP_B, ""],
                   aggregators=[f"{IP_A}:9977", "10.98.0.9:9977"], agg_index=0)
        before = c.stats()
        one = np.ones((1, 256), np.int32)
        pk = lambda **kw: make_packets(job_id=23, cookie=99, worker_id=0, round_=0,  # noqa: E731
                                       chunks=np.array([0]), values=one, n_aggs=2, **kw).tobytes()
        with sender_in(NS_B) as s:
            s.sendto(pk(agg_id=1), (IP_A, 9977))          # aggregator 1's chunk 0
            s.sendto(pk(agg_id=0), (IP_A, 9977))          # ours
        delta = lambda st: {k: v - before["counters"][k] for k, v in st["counters"].items()}  # noqa: E731
        st = wait_for(lambda: (lambda s: s if delta(s)["wrong_agg"] + delta(s)["aggregated"] >= 2
                               else None)(c.stats()), "2 xagg packets counted")
        assert delta(st)["wrong_agg"] == 1 and delta(st)["aggregated"] == 1
        assert st["jobs"]["23"]["aggregated"] == 1
        c.remove(23)


def test_a_worker_on_the_aggregators_own_address_needs_the_slot_lock(a):
    """A worker on the aggregator host sums through the program from its own
    CPU (client/local.py), beside the NIC's: without the lock the job is
    refused, saying how to fix it (with it, tests/test_local_agg.py)."""
    with a.client() as c, pytest.raises(ControlError, match=r"workers\[1\]: 10.98.0.1 is this "
                                                          r"aggregator's own address, and the slot lock "
                                                          r"is off .* restart xaggd with --lock on"):
        c.register(24, cookie=99, max_elements=256, workers=[IP_B, IP_A])
    with a.client() as c:
        assert all(j["job_id"] != 24 for j in c.list_jobs())


def test_metrics_show_the_xdp_attach_mode_and_every_verdict(a):
    import urllib.request

    from xagg.wire.proto import VERDICTS
    with a.client() as c:
        st = c.status()
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{st['metrics']}/metrics", timeout=10) as r:
        samples = {(s.name, tuple(s.labels.values())): s.value
                   for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    assert samples[("xagg_dataplane_info", ("xdp",))] == 1 and st["mode"] == "driver"
    assert samples[("xagg_dataplane_mode", ("driver",))] == 1
    assert samples[("xagg_dataplane_mode", ("generic",))] == 0
    assert all(("xagg_packets_total", (v,)) in samples for v in VERDICTS)
    assert samples[("xagg_healthy", ())] == 1


def test_a_second_daemon_on_the_same_name_is_refused(a, run_dir):
    r = subprocess.run([XAGGD, "start", "--userspace", "--port", "0", "--name", NAME,
                        "--run-dir", str(run_dir)], capture_output=True, text=True)
    assert r.returncode == 1 and f"xaggd {NAME} is already running (pid {a.proc.pid})" in r.stderr
    # another instance must not take the interface from a live one
    r = subprocess.run([XAGGD, "start", "--iface", IF_A, "--netns", NS_A, "--name", NAME + "x",
                        "--run-dir", str(run_dir)], capture_output=True, text=True)
    assert r.returncode == 1 and f"is served by xaggd {NAME} (pid {a.proc.pid}), which is running" in r.stderr
    r = a.cli("cleanup", "--iface", IF_A, "--netns", NS_A)
    assert r.returncode == 1 and "is running" in r.stderr
    assert xdp_attached(IF_A, NS_A) == "xdp"


def test_values_per_packet_are_bounded_by_the_interfaces_mtu(run_dir):
    """The config accepts up to jumbo frames; the interface's real MTU decides."""
    r = subprocess.run([XAGGD, "start", "--iface", IF_B, "--netns", NS_B, "--vals", "400", "--name", NAME + "m",
                        "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "program.vals=400: must be 1..358 (what fits a 1500-byte MTU)" in r.stderr
    assert xdp_attached(IF_B, NS_B) is None


def test_values_per_packet_default_to_what_the_mtu_takes(run_dir):
    from xaggd.config import Config
    cfg = Config.resolve({"iface": IF_B, "netns": NS_B, "run_dir": str(run_dir)}, env={})
    assert cfg.vals == max_vals(1500) == 358 and cfg.source("vals") == "default"
    assert Config.resolve({"userspace": True, "run_dir": str(run_dir)}, env={}).vals == C.XAGG_VALS


def test_crash_restart_replaces_the_stale_program_and_sigterm_detaches(a, run_dir):
    with a.client() as c:
        c.register(41, cookie=1, max_elements=1000, n_workers=2)
    a.proc.send_signal(signal.SIGKILL)                   # the crash: no finally, no detach
    a.proc.wait()
    assert xdp_attached(IF_A, NS_A) == "xdp"             # left behind
    r = a.cli("status")
    assert r.returncode == 3 and "is not running (stale pid file" in r.stderr

    b = Daemon(run_dir, run_dir / "b.log",
               ["ip", "netns", "exec", NS_A, XAGGD, "start", "--iface", IF_A,
                "--max-slots", str(MAX_SLOTS)])
    try:
        st = b.ready()
        # a fresh program, and the jobs A had, installed again from the run dir's list
        assert st["attached"] and [(j["job_id"], j["max_elements"]) for j in st["jobs"]] == [(41, 1000)]
        assert "restored 1 of 1 saved jobs" in b.text()
        assert "replacing a stale xagg program on xd0" in b.text()
        assert "stale pid file" in b.text()
        with b.client() as c:
            j = c.register(41, cookie=1, max_elements=1000, n_workers=2)["job"]
            assert j["slot_base"] == 0 and c.stats()["jobs"]["41"]["aggregated"] == 0
        r = b.cli("stop")                                # SIGTERM, then waits for the detach
        assert r.returncode == 0, r.stderr
        assert f"{IF_A} has no XDP program attached" in r.stdout
        assert b.proc.wait(30) == 0
        assert xdp_attached(IF_A, NS_A) is None
        assert "detached xagg from xd0" in b.text()
        assert not (run_dir / f"{NAME}.pid").exists() and not (run_dir / f"{NAME}.sock").exists()
        r = b.cli("status")
        assert r.returncode == 3 and "is not running" in r.stderr
    finally:
        b.kill()


def test_cleanup_detaches_what_a_dead_daemon_left(veth, run_dir):
    """On the traffic side's interface, which no daemon of this module
    uses: what a killed xaggd leaves there, whichever tests ran before."""
    name = f"{NAME}c"
    cleanup = lambda: subprocess.run([XAGGD, "cleanup", "--iface", IF_B, "--netns", NS_B,  # noqa: E731
                                      "--name", name, "--run-dir", str(run_dir)], capture_output=True, text=True)
    xdp_fd = prog_load(6, XDP_PASS_INSNS, "xagg_xdp")      # stand-ins for xagg's two programs
    tc_fd = prog_load(3, TC_OK_INSNS, "xagg_tc_fanout")
    attach(IF_B, xdp_fd, tc_fd, netns=NS_B)
    os.close(xdp_fd)                                       # as a killed xaggd leaves them: attached,
    os.close(tc_fd)                                        # held by no process
    (run_dir / f"{name}.pid").write_text("999999\n")
    r = cleanup()
    assert r.returncode == 0, r.stderr
    assert "removed stale pid file" in r.stdout and "detached 'xagg_xdp'" in r.stdout
    assert xdp_attached(IF_B, NS_B) is None
    r = cleanup()
    assert r.returncode == 0 and "no XDP program attached" in r.stdout


def test_a_daemon_detaches_only_its_own_program_and_notices_a_replacement(run_dir, tmp_path):
    """Two daemons, one interface: a second one is refused whatever its run
    dir; a program that replaced ours (or a tc filter gone) is noticed, jobs
    are refused, and neither stop nor cleanup removes another's program."""
    d = Daemon(run_dir, run_dir / "d.log",
               [XAGGD, "start", "--iface", IF_A, "--netns", NS_A, "--max-slots", str(MAX_SLOTS), "--vals", "256"],
               name=f"{NAME}d")
    other = None
    try:
        ours = d.ready()["prog_id"]
        r = subprocess.run([XAGGD, "start", "--iface", IF_A, "--netns", NS_A, "--name", "other",
                            "--run-dir", str(tmp_path / "other")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and f"pid {d.proc.pid}" in r.stderr and "which is running" in r.stderr, r.stderr
        assert xdp_program(IF_A, NS_A)["id"] == ours
        with d.client() as c:
            c.register(51, cookie=1, max_elements=1000, n_workers=2)
            sh("ip", "netns", "exec", NS_A, "tc", "filter", "del", "dev", IF_A, "ingress", "pref", str(TC_PRIO))
            with pytest.raises(ControlError, match="data plane: .*tc fan-out filter"):
                c.register(52, cookie=1, max_elements=1000, n_workers=2)
            assert "tc fan-out filter" in c.status()["health"]
        other = prog_load(6, XDP_PASS_INSNS, "xagg_xdp")       # another program takes the interface
        with iproute(NS_A) as ipr:
            set_xdp(ipr, ifindex(ipr, IF_A, NS_A), other, XDP_FLAGS_DRV_MODE)
        theirs = xdp_program(IF_A, NS_A)["id"]
        with d.client() as c:
            with pytest.raises(ControlError, match=f"data plane: .*replaced by prog id {theirs}"):
                c.register(53, cookie=1, max_elements=1000, n_workers=2)
            with pytest.raises(ControlError, match="data plane: "):
                c.resize(51, 2000)
        r = d.cli("stop")
        assert r.returncode == 0, r.stderr + r.stdout
        assert xdp_program(IF_A, NS_A)["id"] == theirs                  # not detached by us
        assert f"not ours (prog id {theirs}): left attached (ours was prog id {ours})" in d.text()
        assert "detached xagg from" not in d.text()
        r = d.cli("cleanup", "--iface", IF_A, "--netns", NS_A)          # held by a live process: left
        assert r.returncode == 1 and f"in use by pid {os.getpid()}" in r.stderr, r.stderr + r.stdout
        assert xdp_program(IF_A, NS_A)["id"] == theirs
        os.close(other)
        other = None
        r = d.cli("cleanup", "--iface", IF_A, "--netns", NS_A)          # now nobody's: removed
        assert r.returncode == 0 and f"detached 'xagg_xdp' (prog id {theirs})" in r.stdout, r.stderr
        assert xdp_attached(IF_A, NS_A) is None
    finally:
        d.kill()
        if other is not None:
            os.close(other)


def test_one_queue_without_driver_mode_is_rebuilt_with_the_lock(run_dir):
    """An ifb device has one RX queue and no driver-mode XDP: the lock-free
    build auto picks for one queue is refused there, and the daemon rebuilds
    with the lock for generic mode, where XDP runs on any CPU."""
    sh("ip", "netns", "exec", NS_B, "ip", "link", "add", "xifb0", "type", "ifb")
    d = Daemon(run_dir, run_dir / "dummy.log",
               [XAGGD, "start", "--iface", "xifb0", "--netns", NS_B, "--max-slots", "64", "--vals", "256"],
               name=f"{NAME}q")
    try:
        st = d.ready()
        assert st["mode"] == "generic" and st["slot_lock"] == "on (generic mode runs XDP on any CPU)", st
        assert "rebuilding with the slot lock for generic mode" in d.text()
    finally:
        d.kill()
        sh("ip", "netns", "exec", NS_B, "ip", "link", "del", "xifb0")
