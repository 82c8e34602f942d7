"""Racks in the lab: bridges joined by shaped uplinks (real namespaces, real packets).

What crosses a rack's uplink is read from the uplink veths' byte counters,
so the tests check where traffic goes, not how fast.
"""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from pyroute2 import IPRoute

from xagg.lab import cluster as labmod
from xagg.cli.main import main
from xagg.lab.cluster import Lab, LabError, LabSpec

from tests.test_lab import drain, recv_until, udp

TAG = f"r{os.getpid() % 100000}"
PORT = 47100


@pytest.fixture(scope="module")
def lab():
    spec = LabSpec(name=TAG, workers=4, aggregators=2, rate="1gbit", racks=2, uplink="200mbit")
    labmod.destroy(TAG)
    the_lab = Lab(spec).up()
    try:
        yield the_lab
    finally:
        the_lab.down()
    assert labmod.lab_namespaces(TAG) == []


def test_hosts_go_to_racks_in_contiguous_blocks(lab):
    assert {h.name: h.rack for h in lab.hosts} == {"w0": 0, "w1": 0, "w2": 1, "w3": 1,
                                                   "a0": 0, "a1": 1}
    with IPRoute(netns=lab.switch_ns, flags=0) as sw:
        master = {h.name: sw.link("get", index=sw.link_lookup(ifname=h.port)[0])[0]
                  .get_attr("IFLA_MASTER") for h in lab.hosts}
        br = [sw.link_lookup(ifname=f"br{r}")[0] for r in (0, 1)]
    assert master == {"w0": br[0], "w1": br[0], "a0": br[0], "w2": br[1], "w3": br[1], "a1": br[1]}


def test_uplinks_are_shaped_both_ways_and_reshapable(lab):
    assert lab.uplink_rates() == [(200_000_000, 200_000_000)] * 2
    lab.set_uplink("100mbit")
    try:
        assert lab.uplink_rates() == [(100_000_000, 100_000_000)] * 2
        assert Lab.load(TAG).spec.uplink == "100mbit"     # saved for other processes
    finally:
        lab.set_uplink("200mbit")


def _send(lab, src, dst, n=50, size=1000):
    s = udp(lab.host(src).netns)
    r = udp(lab.host(dst).netns, PORT)
    try:
        want = {i.to_bytes(4, "little") * (size // 4) for i in range(n)}
        for d in want:
            s.sendto(d, (lab.host(dst).ip, PORT))
        recv_until(r, want)
    finally:
        s.close()
        r.close()


def test_only_traffic_between_racks_crosses_the_uplinks(lab):
    before = lab.uplink_bytes()
    _send(lab, "w0", "w1")                 # inside rack 0
    mid = lab.uplink_bytes()
    _send(lab, "w0", "w2")                 # rack 0 -> rack 1
    after = lab.uplink_bytes()
    inside = [(u1 - u0, d1 - d0) for (u0, d0), (u1, d1) in zip(before, mid)]
    across = [(u1 - u0, d1 - d0) for (u0, d0), (u1, d1) in zip(mid, after)]
    assert all(u < 50 * 1000 // 2 and d < 50 * 1000 // 2 for u, d in inside), inside
    # rack 0's uplink carried the 50 KB up into the core, rack 1's down into its rack
    assert across[0][0] >= 50 * 1000 and across[1][1] >= 50 * 1000, across
    assert across[0][1] < 50 * 1000 // 2 and across[1][0] < 50 * 1000 // 2, across


def test_broadcast_reaches_every_rack(lab):
    s = udp(lab.host("w0").netns)
    rs = [udp(lab.host(h).netns, PORT + 1) for h in ("w1", "w2", "a1")]
    try:
        s.sendto(b"hello racks", (lab.broadcast, PORT + 1))
        for r in rs:
            assert recv_until(r, {b"hello racks"}) == {b"hello racks"}
            drain(r, idle=0.2)
    finally:
        for x in [s, *rs]:
            x.close()


def test_cli_shows_racks_and_refuses_bad_specs(lab):
    out = CliRunner().invoke(main, ["lab", "status", "--name", TAG])
    assert out.exit_code == 0, out.output
    assert "RACK" in out.output and "rack 1 uplink: 200mbit up, 200mbit down" in out.output
    with pytest.raises(LabError, match="uplink rate needs racks > 1"):
        LabSpec(name="x", uplink="1gbit").validate()
    with pytest.raises(LabError, match="bad rack 2 for a1"):
        LabSpec(name="x", aggregators=2, racks=2, rack_of={"a1": 2}).validate()
    with pytest.raises(LabError, match="unknown host 'a7' in rack_of"):
        LabSpec(name="x", racks=2, rack_of={"a7": 0}).validate()
    bad = CliRunner().invoke(main, ["lab", "up", "--name", "x", "--racks", "2", "--rack-of", "a0"])
    assert bad.exit_code != 0 and "HOST=RACK" in bad.output


def test_rack_of_moves_a_host(lab):
    spec = LabSpec(name="x", workers=4, aggregators=2, racks=2, rack_of={"a1": 0})
    assert [spec.rack(h) for h in spec.host_names()] == [0, 0, 1, 1, 0, 0]


def test_multicast_reaches_workers_and_other_racks_but_no_aggregator(lab):
    """Aggregator ports take no multicast flood (a snooping switch where only
    workers joined the result group): a group datagram from a1 reaches the
    workers of both racks, and no aggregator's link carries it."""
    import socket
    import struct
    from pyroute2 import netns as nsmod
    group, port = "239.77.0.1", PORT + 2
    rs = {}
    for h in ("w0", "w3", "a0"):
        s = udp(lab.host(h).netns, port)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                     struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton(lab.host(h).ip)))
        rs[h] = s
    tx = nsmod.create_socket(lab.host("a1").netns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(lab.host("a1").ip))

    def port_tx(name):
        r = lab.exec("switch", ["cat", f"/sys/class/net/{name}/statistics/tx_bytes"],
                     capture_output=True, text=True)
        return int(r.stdout)
    try:
        before = port_tx("a0")
        want = {bytes([i]) * 1000 for i in range(20)}
        for d in want:
            tx.sendto(d, (group, port))
        for h in ("w0", "w3"):
            assert recv_until(rs[h], want) == want
        assert port_tx("a0") - before < 1000          # not one of the 20 KB
        rs["a0"].settimeout(0.3)
        with pytest.raises(TimeoutError):
            rs["a0"].recvfrom(2048)
    finally:
        for s in [tx, *rs.values()]:
            s.close()
