"""The lab: real namespaces, real packets (needs root, as the whole suite does).

Lab names carry this process's pid so parallel runs and other labs coexist.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner
from pyroute2 import IPRoute, netns

from xagg.lab import cluster as labmod
from xagg.cli.main import main
from xagg.lab.cluster import Lab, LabError, LabExists, LabNotFound, LabSpec, parse_rate

TAG = f"t{os.getpid() % 100000}"
PORT = 47000
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def udp(ns: str, port: int = 0) -> socket.socket:
    """A UDP socket living in namespace `ns`, bound to 0.0.0.0:port."""
    s = netns.create_socket(ns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)   # never drop in tests
    s.bind(("0.0.0.0", port))
    s.settimeout(5.0)   # a liveness bound, not a timing assertion
    return s


def recv_until(s: socket.socket, want: set[bytes]) -> set[bytes]:
    got = set()
    while not want <= got:
        got.add(s.recvfrom(2048)[0])
    return got


def drain(s: socket.socket, idle: float = 1.0) -> int:
    """Datagrams still arriving, until the socket is idle for `idle` s."""
    n = 0
    s.settimeout(idle)
    try:
        while True:
            s.recvfrom(2048)
            n += 1
    except TimeoutError:
        return n
    finally:
        s.settimeout(5.0)


@pytest.fixture(scope="module")
def lab():
    spec = LabSpec(name=TAG, workers=3, aggregators=1, rate="1gbit", rate_of={"w2": "200mbit"})
    labmod.destroy(TAG)
    the_lab = Lab(spec).up()
    try:
        yield the_lab
    finally:
        the_lab.down()
    assert labmod.lab_namespaces(TAG) == []


def test_topology(lab):
    assert [h.name for h in lab.hosts] == ["w0", "w1", "w2", "a0"]
    assert [h.ip for h in lab.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3", "10.77.0.101"]
    assert len({h.mac for h in lab.hosts}) == 4
    assert set(labmod.lab_namespaces(TAG)) == {f"{TAG}-{n}" for n in ("sw", "w0", "w1", "w2", "a0")}
    with IPRoute(netns=lab.switch_ns, flags=0) as sw:
        br = sw.link_lookup(ifname="br0")[0]
        for h in lab.hosts:
            q = 2 if h.kind == "aggregator" else 1
            port = sw.link("get", index=sw.link_lookup(ifname=h.port)[0])[0]
            assert port.get_attr("IFLA_MASTER") == br
            assert port.get_attr("IFLA_NUM_RX_QUEUES") == port.get_attr("IFLA_NUM_TX_QUEUES") == q
            with IPRoute(netns=h.netns, flags=0) as ipr:
                eth = ipr.link("get", index=ipr.link_lookup(ifname="eth0")[0])[0]
                assert eth.get_attr("IFLA_ADDRESS") == h.mac
                assert eth.get_attr("IFLA_OPERSTATE") == "UP"
                assert eth.get_attr("IFLA_MTU") == 1500
                assert eth.get_attr("IFLA_NUM_RX_QUEUES") == eth.get_attr("IFLA_NUM_TX_QUEUES") == q
                (addr,) = ipr.get_addr(index=eth["index"])
                assert addr.get_attr("IFA_ADDRESS") == h.ip
                assert addr.get_attr("IFA_BROADCAST") == "10.77.0.255"
                lo = ipr.link("get", index=ipr.link_lookup(ifname="lo")[0])[0]
                assert lo.get_attr("IFLA_OPERSTATE") in ("UP", "UNKNOWN")
    # XDP_TX from an aggregator's eth0 needs NAPI (GRO) on its switch port
    r = lab.exec("switch", ["ethtool", "-k", "a0"], capture_output=True, text=True, check=True)
    assert "generic-receive-offload: on" in r.stdout


def test_unicast_every_pair(lab):
    socks = {h.name: udp(h.netns, PORT) for h in lab.hosts}
    try:
        for src in lab.hosts:
            for dst in lab.hosts:
                if src is not dst:
                    socks[src.name].sendto(f"{src.name}>{dst.name}".encode(), (dst.ip, PORT))
        for dst in lab.hosts:
            want = {f"{s.name}>{dst.name}".encode() for s in lab.hosts if s is not dst}
            assert recv_until(socks[dst.name], want) == want
    finally:
        for s in socks.values():
            s.close()


def test_broadcasts_reach_every_other_host(lab):
    socks = {h.name: udp(h.netns, PORT + 1) for h in lab.hosts}
    try:
        for src in lab.hosts:
            for dst in (lab.broadcast, "255.255.255.255"):
                socks[src.name].sendto(f"{src.name}>{dst}".encode(), (dst, PORT + 1))
        for h in lab.hosts:
            want = {f"{s.name}>{d}".encode() for s in lab.hosts if s is not h
                    for d in (lab.broadcast, "255.255.255.255")}
            assert want <= recv_until(socks[h.name], want)
    finally:
        for s in socks.values():
            s.close()


def test_exec_and_spawn_run_in_the_host_namespace(lab):
    r = lab.exec("w1", ["ip", "-o", "-4", "addr", "show", "dev", "eth0"],
                 capture_output=True, text=True)
    assert r.returncode == 0 and "10.77.0.2/24" in r.stdout and "brd 10.77.0.255" in r.stdout
    assert lab.exec("w1", [sys.executable, "-c", "raise SystemExit(7)"]).returncode == 7
    p = lab.spawn("a0", [sys.executable, "-c", "import os; print(os.stat('/proc/self/ns/net').st_ino)"],
                  stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=30)
    assert int(out) == os.stat(f"/run/netns/{TAG}-a0").st_ino
    lab.spawn("a0", ["sleep", "300"])   # left running: the fixture's down() must stop it


def test_shaping_both_directions(lab):
    for h in lab.hosts:
        want = 200_000_000 if h.name == "w2" else 1_000_000_000
        assert lab.qdisc_rates(h) == (want, want)
    # queue sizes: 1 Gbit/s -> 125 KB bucket, + 1.25 MB queue (room for 64 KB bursts)
    with IPRoute(netns=lab.host("w0").netns, flags=0) as ipr:
        (q,) = [q for q in ipr.get_qdiscs(index=ipr.link_lookup(ifname="eth0")[0])
                if q.get_attr("TCA_KIND") == "tbf"]
        parms = q.get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")
        assert parms["limit"] == 125_000 + 1_250_000
    lab.set_rate("300mbit", ["w1"])
    assert lab.qdisc_rates("w1") == (300_000_000, 300_000_000)
    lab.set_rate(None, ["w1"])
    assert lab.qdisc_rates("w1") == (None, None)
    lab.set_rate("1gbit", ["w1"])
    assert Lab.load(TAG).host("w1").rate == 1_000_000_000   # state file follows


def test_loss_drops_about_the_right_fraction(lab):
    w0, w1, a0 = lab.host("w0"), lab.host("w1"), lab.host("a0")
    rx, ctl = udp(a0.netns, PORT + 2), udp(a0.netns, PORT + 3)
    tx = udp(w0.netns)
    try:
        lab.set_loss(5, hosts=["w0"], udp_port=PORT + 2)
        assert "out:5%" in {r["name"]: r for r in lab.status()}["w0"]["loss"]
        for i in range(2000):
            tx.sendto(b"%d" % i, (a0.ip, PORT + 2))   # no EPERM: the drop is silent
        for i in range(200):
            tx.sendto(b"%d" % i, (a0.ip, PORT + 3))   # another port: not lossy
        assert len(recv_until(ctl, {b"%d" % i for i in range(200)})) == 200
        lost = 2000 - drain(rx)
        assert 20 <= lost <= 240, lost                 # 5% of 2000 = 100

        # "in": what a0 sends to w1 is lost, what w1 sends is not
        lab.set_loss(0, hosts=["w0"])
        lab.set_loss(50, hosts=["w1"], direction="in")
        rx1, tx1 = udp(w1.netns, PORT + 4), udp(a0.netns)
        for i in range(400):
            tx1.sendto(b"x", (w1.ip, PORT + 4))
        for i in range(100):
            rx1.sendto(b"%d" % i, (a0.ip, PORT + 3))
        assert len(recv_until(ctl, {b"%d" % i for i in range(100)})) == 100
        got = drain(rx1)
        assert 100 <= got <= 300, got
        rx1.close(), tx1.close()
    finally:
        lab.set_loss(0, hosts=[h.name for h in lab.hosts], direction="both")
        rx.close(), ctl.close(), tx.close()
    assert lab.loss == {}
    r = lab.exec("switch", ["nft", "list", "tables"], capture_output=True, text=True, check=True)
    assert "xagg_lab" not in r.stdout


def test_two_labs_coexist(lab):
    other = Lab(LabSpec(name=TAG + "b", workers=1, aggregators=1))   # same subnet, own switch
    with other:
        a, b = udp(other.host("w0").netns, PORT), udp(other.host("a0").netns, PORT)
        a.sendto(b"hello", (other.host("a0").ip, PORT))
        assert b.recvfrom(64)[0] == b"hello"
        a.close(), b.close()
        assert len(labmod.lab_namespaces(TAG)) == 5 and len(labmod.lab_namespaces(TAG + "b")) == 3
    assert labmod.lab_namespaces(TAG + "b") == [] and other.down() == []   # idempotent
    assert len(labmod.lab_namespaces(TAG)) == 5
    test_unicast_every_pair(lab)   # the first lab is untouched


def test_existing_lab_is_refused(lab):
    with pytest.raises(LabExists, match=f"xagg lab down --name {TAG}"):
        Lab(LabSpec(name=TAG, workers=1)).up()
    assert len(labmod.lab_namespaces(TAG)) == 5


def test_down_after_crash():
    name = TAG + "c"
    code = ("import os, sys, time; from xagg.lab.cluster import Lab, LabSpec\n"
            "lab = Lab(LabSpec(name=sys.argv[1], workers=2, rate='100mbit')).up()\n"
            "pid = lab.spawn('w0', ['sleep', '300'], stdout=-3, stderr=-3).pid\n"
            "ns = os.stat(f'/run/netns/{sys.argv[1]}-w0').st_ino\n"
            "while os.stat(f'/proc/{pid}/ns/net').st_ino != ns:   # `ip netns exec` got there\n"
            "    time.sleep(0.01)\n"
            "print(pid, flush=True)\n"
            "os._exit(3)  # crash: no down()\n")
    r = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    pid = int(r.stdout)
    assert (labmod.STATE_DIR / f"{name}.json").exists() and len(labmod.lab_namespaces(name)) == 4
    assert labmod.alive(pid)
    crashed = Lab.load(name)
    assert crashed.host("w1").rate == 100_000_000
    assert len(crashed.down()) == 4
    assert labmod.lab_namespaces(name) == [] and not (labmod.STATE_DIR / f"{name}.json").exists()
    assert not labmod.alive(pid)   # the process left in the lab was stopped
    assert crashed.down() == []


def test_down_without_state_file():
    name = TAG + "d"
    Lab(LabSpec(name=name, workers=1, aggregators=0)).up()
    (labmod.STATE_DIR / f"{name}.json").unlink()
    with pytest.raises(LabNotFound):
        Lab.load(name)
    assert name in labmod.list_labs()
    assert sorted(Lab(LabSpec(name=name)).down()) == [f"{name}-sw", f"{name}-w0"]
    assert labmod.lab_namespaces(name) == []


def test_cli_up_status_exec_down():
    name = TAG + "e"
    cli = [sys.executable, "-m", "xagg.cli.main", "lab"]
    run = lambda *a: subprocess.run(cli + list(a), capture_output=True, text=True)  # noqa: E731
    try:
        r = run("up", "--name", name, "-w", "2", "--rate", "500mbit", "--rate-of", "a0=2gbit")
        assert r.returncode == 0, r.stderr
        assert "w1" in r.stdout and "10.77.0.101" in r.stdout and "2gbit" in r.stdout
        r = run("up", "--name", name)
        assert r.returncode == 1 and f"xagg lab down --name {name}" in r.stderr
        r = run("exec", "--name", name, "w1", "--", "ip", "-o", "-4", "addr", "show", "eth0")
        assert r.returncode == 0 and "10.77.0.2/24" in r.stdout
        assert run("exec", "--name", name, "w0", "--", "false").returncode == 1
        r = run("status", "--name", name, "--json")
        hosts = {h["name"]: h for h in json.loads(r.stdout)["hosts"]}
        assert hosts["w0"]["rate"] == "500mbit" and hosts["a0"]["state"] == "up"
        assert run("loss", "--name", name, "3", "--host", "w1").returncode == 0
        assert Lab.load(name).loss == {"w1": {"out": [3.0, None]}}
        r = run("down", "--name", name)
        assert r.returncode == 0 and "removed 4 namespaces" in r.stdout
    finally:
        labmod.destroy(name)
    assert labmod.lab_namespaces(name) == []


def test_cli_errors_and_help(monkeypatch):
    runner = CliRunner()
    r = runner.invoke(main, ["lab", "up", "--help"])
    assert r.exit_code == 0 and "--rate-of w7=200mbit" in r.output
    r = runner.invoke(main, ["lab", "up", "--name", TAG + "f", "--rate", "fast"])
    assert r.exit_code == 1 and "bad rate 'fast'" in r.output
    r = runner.invoke(main, ["lab", "up", "--name", TAG + "f", "--rate-of", "h2=1gbit"])
    assert r.exit_code == 1 and "unknown host 'h2'" in r.output
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = runner.invoke(main, ["lab", "up", "--name", TAG + "f"])
    assert r.exit_code == 1 and "needs root" in r.output
    assert labmod.lab_namespaces(TAG + "f") == []


@pytest.mark.parametrize("text,bps", [("1gbit", 10**9), ("200mbit", 2 * 10**8), ("500kbit", 5 * 10**5),
                                      ("1.5Gbit", 15 * 10**8), ("100m", 10**8), ("1000000", 10**6),
                                      (2_000_000, 2 * 10**6), (None, None), ("none", None)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("bad", ["fast", "1mbps", "-5mbit", "10", "40gbit"])
def test_parse_rate_rejects(bad):
    with pytest.raises(LabError, match=repr(bad).replace(".", r"\.")):
        parse_rate(bad)


def test_spec_validation():
    for kw, msg in [({"workers": 0}, "worker"), ({"name": "a-b"}, "lab name"),
                    ({"workers": 101}, "overlap"), ({"aggregators": 200}, "do not fit"),
                    ({"subnet": "10.77.0.0/33"}, "subnet"), ({"loss_percent": 150}, "loss")]:
        with pytest.raises(LabError, match=msg):
            LabSpec(**kw).validate()
