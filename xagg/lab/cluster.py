"""The virtual cluster ("lab") that tests, the demo and the benchmarks run on.

Everything lives in network namespaces this module creates; the root namespace
(its interfaces, routes, firewall) is never touched::

    NAME-w0 .. NAME-w{N-1}        NAME-a0 .. NAME-a{M-1}       host namespaces
      eth0 10.77.0.1 ..             eth0 10.77.0.101 ..        (aggregators: multi-queue veth)
        |                             |
    +---w0---------- br0 ------------a0---+                    NAME-sw: switch namespace,
    |  tbf egress     Linux bridge    tbf egress |             one bridge port per host
    |  nft bridge table "xagg_lab" (loss)       |
    +---------------------------------------+

* Shaping (``rate``): a tbf on *both* ends of a host's veth: the host's eth0
  egress (what it sends) and the switch port's egress (what it receives).
  Numbers, e.g. for 1 Gbit/s: bucket = max(rate x ``burst_ms`` (1 ms) =
  125 KB, 16 frames), so a 64 KB burst leaves at line rate; queue =
  bucket + max(rate x ``queue_ms`` (10 ms) = 1.25 MB, 64 frames), which holds
  simultaneous 64 KB bursts from many workers (incast on an aggregator port)
  and exceeds the default socket send buffer (208 KB), so a local sender is
  paced by send-buffer backpressure instead of losing datagrams in tbf.
  tbf's 32-bit rate field caps shaping at 34 Gbit/s; no rate = unshaped.
* Queues: an unshaped end of a link gets pfifo_fast, as a NIC has a qdisc
  (a veth's default is none). A veth that runs its peer's NAPI (XDP there)
  hands frames to a 256-slot ring per queue; full, it stops its queue and
  the frames wait in the qdisc, but with no qdisc it drops them: a burst of
  an aggregator's unicast results (one tc clone per worker) overflowed it.
* Loss (``loss_percent``): ``numgen random`` rules in a bridge-family
  nftables table in the switch namespace, per host port and direction.
  Not in the host's output chain: a drop there makes ``sendto`` fail with
  EPERM (real loss is silent), and it could not drop frames an XDP program
  sends with XDP_TX.  netem is not in our kernel.
* Racks (``racks`` > 1): one bridge per rack (``br0``, ``br1``, ...) and a
  core bridge ``core``, each rack joined to it by a veth pair (``up<r>`` in
  the rack's bridge, ``dn<r>`` in the core) shaped at ``uplink`` on both
  ends, so traffic between racks shares one link each way, as on a real
  top-of-rack uplink. Still one L2 segment and one subnet: addresses and
  broadcast work across racks. Hosts go to racks in contiguous blocks
  (w0, w1 | w2, w3 and a0 | a1 for 2 racks), or as ``rack_of`` says.
* Broadcast: hosts' addresses carry the subnet broadcast, and each host has a
  ``255.255.255.255/32 dev eth0`` route so userspace can send limited
  broadcasts too; the bridge floods both to every other port.
* Multicast: the bridges do no IGMP snooping, but aggregator ports have
  ``mcast_flood off``: multicast reaches workers and uplinks only, as a
  snooping switch forwards a result group that only workers joined. (The
  kernel bridge floods unless it sees a querier, which needs a router.)
* IPv6 is disabled in every lab namespace: no RS/DAD/MLD frames on the links
  to disturb XDP counters or shaped links.
* GRO is on for the switch side of aggregator veths: a veth only accepts
  XDP_TX/redirected frames when its peer runs NAPI (GRO or an XDP program).

A state file (``/run/xagg-lab/NAME.json``) lets another process (``xagg lab
down``) find a lab; ``down`` also works without it, from the namespace names.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

from xagg.wire.rates import format_bps, parse_bps
from xaggd.settings import ROOT_RUN_DIR

STATE_DIR = Path(os.environ.get("XAGG_LAB_STATE_DIR", "/run/xagg-lab"))
XAGGD_RUN_DIR = Path(ROOT_RUN_DIR)     # where the lab's xaggds (named LAB-HOST) keep their files
NETNS_DIR = Path("/run/netns")
DEFAULT_NAME = "xlab"
IFNAME = "eth0"          # the host's interface inside its namespace
BRIDGE = "br0"           # inside the switch namespace (rack r's: f"br{r}")
CORE_BRIDGE = "core"     # joins the racks' bridges when racks > 1
NFT_TABLE = "xagg_lab"   # bridge-family table in the switch namespace
MAX_TBF_BPS = (2**32 - 1) * 8   # tbf's rate field is u32 bytes/s
ETH_OVERHEAD = 14

# Lab names have no '-' so "NAME-<host>" can never match another lab's namespace.
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class LabError(RuntimeError):
    """A lab operation failed; the message says what to do."""


class LabExists(LabError):
    pass


class LabNotFound(LabError):
    pass


def parse_rate(value) -> int | None:
    """Bits/s tbf can shape to, spelled as every rate is (xagg.wire.rates:
    "1gbit", "200mbit", "1.5g", 1000000; None, "" and "none": unshaped)."""
    try:
        bps = parse_bps(value, "rate")
    except ValueError as e:
        raise LabError(str(e).split(": ", 1)[1]) from None
    if bps is None:
        return None
    bps = int(bps)
    if bps < 8000:
        raise LabError(f"bad rate {value!r}: below 8kbit")
    if bps > MAX_TBF_BPS:
        raise LabError(f"bad rate {value!r}: tbf shapes at most 34gbit; omit the rate "
                       "for an unshaped link")
    return bps


@dataclass
class LabSpec:
    """What to build.  Host names: workers w0..w{N-1}, aggregators a0..a{M-1}."""
    workers: int = 2
    aggregators: int = 1
    rate: str | int | None = None           # every host's link (both ways); None = unshaped
    rate_of: dict = field(default_factory=dict)   # per-host overrides {"w2": "200mbit"}
    loss_percent: float = 0.0               # random UDP loss on what workers send
    loss_udp_port: int | None = None        # restrict the loss to this UDP dest port
    name: str = DEFAULT_NAME                # namespaces are NAME-sw, NAME-w0, ...
    subnet: str = "10.77.0.0/24"
    worker_base: int = 1                    # w0 = subnet + 1
    aggregator_base: int = 101              # a0 = subnet + 101
    mtu: int = 1500
    agg_queues: int = 2                     # rx/tx queues of aggregator veths (both ends)
    burst_ms: float = 1.0                   # tbf bucket, in ms at the link rate
    queue_ms: float = 10.0                  # tbf queue beyond the bucket, ms at link rate
    racks: int = 1                          # bridges joined by shaped uplinks
    uplink: str | int | None = None         # each rack's uplink, both ways; None = unshaped
    rack_of: dict = field(default_factory=dict)   # per-host overrides {"a1": 0}

    def host_names(self) -> list[str]:
        return ([f"w{i}" for i in range(self.workers)]
                + [f"a{i}" for i in range(self.aggregators)])

    def rack(self, host: str) -> int:
        """The rack of host "w3"/"a1": ``rack_of``, else contiguous blocks."""
        if host in self.rack_of:
            return self.rack_of[host]
        n = self.workers if host[0] == "w" else self.aggregators
        return int(host[1:]) * self.racks // max(n, 1)

    def validate(self) -> None:
        if not _NAME_RE.match(self.name):
            raise LabError(f"bad lab name {self.name!r}: 1-12 of [a-z0-9], starting with a letter")
        if self.workers < 1 or self.aggregators < 0:
            raise LabError(f"need >= 1 worker and >= 0 aggregators, got "
                           f"{self.workers} and {self.aggregators}")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as e:
            raise LabError(f"bad subnet {self.subnet!r}: {e}") from None
        last = net.num_addresses - 2     # highest usable host offset
        for kind, base, n in (("worker", self.worker_base, self.workers),
                              ("aggregator", self.aggregator_base, self.aggregators)):
            if n and not (1 <= base and base + n - 1 <= last):
                raise LabError(f"{n} {kind}s from offset {base} do not fit in {self.subnet}")
        w = range(self.worker_base, self.worker_base + self.workers)
        a = range(self.aggregator_base, self.aggregator_base + self.aggregators)
        if self.aggregators and set(w) & set(a):
            raise LabError(f"worker and aggregator addresses overlap in {self.subnet}; "
                           "move aggregator_base")
        if not 68 <= self.mtu <= 65535:
            raise LabError(f"bad mtu {self.mtu}")
        if self.agg_queues < 1:
            raise LabError(f"bad agg_queues {self.agg_queues}")
        if not 0 <= self.loss_percent <= 100:
            raise LabError(f"bad loss {self.loss_percent!r}: a percentage 0..100")
        parse_rate(self.rate)
        names = self.host_names()
        for h, r in self.rate_of.items():
            if h not in names:
                raise LabError(f"unknown host {h!r} in rate_of (hosts are "
                               f"{', '.join(names)})")
            parse_rate(r)
        if not isinstance(self.racks, int) or not 1 <= self.racks <= 16:
            raise LabError(f"bad racks {self.racks!r}: 1..16")
        if self.uplink is not None and self.racks == 1:
            raise LabError("an uplink rate needs racks > 1 (one rack has no uplink)")
        parse_rate(self.uplink)
        for h, r in self.rack_of.items():
            if h not in names:
                raise LabError(f"unknown host {h!r} in rack_of (hosts are "
                               f"{', '.join(names)})")
            if not isinstance(r, int) or not 0 <= r < self.racks:
                raise LabError(f"bad rack {r!r} for {h} in rack_of: 0..{self.racks - 1}")


@dataclass
class Host:
    name: str        # "w0", "a1"
    kind: str        # "worker" | "aggregator"
    index: int
    netns: str       # "NAME-w0"
    ip: str
    mac: str
    rate: int | None  # bits/s, None = unshaped
    ifname: str = IFNAME   # inside netns
    port: str = ""   # the switch-side veth, inside the switch namespace
    rack: int = 0    # whose bridge the port is on


def _mac_for(ip: str) -> str:
    # Locally administered, derived from the IP: deterministic and readable.
    return "02:78:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(ip).packed)


def need_root() -> None:
    """LabError unless we are root (namespaces, veth, tc and nftables need it)."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, veth, tc, nftables); "
                       "run it with sudo")


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not path:
        raise LabError(f"'{name}' not found; install it (apt-get install "
                       f"{ {'ip': 'iproute2', 'bridge': 'iproute2'}.get(name, name)})")
    return path


def _ns_run(ns: str, argv: list[str], input: str | None = None) -> None:
    """Run a tool inside namespace `ns` (for what pyroute2 has no API: sysctl, nft, ethtool)."""
    r = subprocess.run([_tool("ip"), "netns", "exec", ns, *argv], input=input,
                       capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"in {ns}: {' '.join(argv)} failed: {r.stderr.strip() or r.stdout.strip()}")


def _ipr(ns: str) -> IPRoute:
    # flags=0: never (re)create a namespace by merely opening it.
    return IPRoute(netns=ns, flags=0)


def _idx(ipr: IPRoute, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise LabError(f"no interface {ifname} in {ipr.status.get('netns')}")
    return found[0]


def _ns_inode(ns: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / ns).st_ino
    except FileNotFoundError:
        return None


def lab_namespaces(name: str) -> list[str]:
    """Every existing namespace that belongs to lab `name` (switch last)."""
    pat = re.compile(rf"^{re.escape(name)}-(sw|[wa]\d+)$")
    found = sorted(n for n in netns.listnetns() if pat.match(n))
    return sorted(found, key=lambda n: n.endswith("-sw"))


def list_labs() -> list[str]:
    """Names of labs with a state file or leftover namespaces."""
    names = {p.stem for p in STATE_DIR.glob("*.json")} if STATE_DIR.is_dir() else set()
    pat = re.compile(r"^([a-z][a-z0-9]{0,11})-sw$")
    names |= {m.group(1) for n in netns.listnetns() if (m := pat.match(n))}
    return sorted(names)


def _pids_in(inodes: set[int]) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{d}/ns/net").st_ino in inodes:
                pids.append(int(d))
        except OSError:
            pass
    return pids


def _kill_in_namespaces(nss: list[str], grace: float = 2.0) -> None:
    """Stop processes left inside the lab (xaggd, workers): a process keeps a
    namespace and its veth alive after the name is gone."""
    inodes = {i for i in map(_ns_inode, nss) if i is not None}
    pids = _pids_in(inodes) if inodes else []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.02)
        if not pids:
            return


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for its parent to reap it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def destroy(name: str) -> list[str]:
    """Remove everything of lab `name`: its processes, namespaces (and with
    them veths, bridge, qdiscs, nft tables), state file and its daemons'
    saved jobs.  Idempotent; needs
    no state file.  Returns the namespaces removed."""
    need_root()
    nss = lab_namespaces(name)
    _kill_in_namespaces(nss)
    for ns in nss:
        try:
            netns.remove(ns)
        except FileNotFoundError:
            pass
    (STATE_DIR / f"{name}.json").unlink(missing_ok=True)
    _remove_daemon_state(name)
    return nss


def _remove_daemon_state(name: str) -> None:
    """The job lists its xaggds saved (experiment.py names them LAB-HOST):
    a later lab of the same name would restore their jobs."""
    pat = re.compile(rf"^{re.escape(name)}-[wa]\d+\.jobs\.json(\.tmp)?$")
    try:
        files = os.listdir(XAGGD_RUN_DIR)
    except FileNotFoundError:
        return
    for f in files:
        if pat.match(f):
            (XAGGD_RUN_DIR / f).unlink(missing_ok=True)


def _tbf_sizes(bps: int, spec: LabSpec) -> tuple[int, int]:
    """(bucket, limit) in bytes; see the module docstring for the numbers."""
    rate = bps / 8
    frame = spec.mtu + ETH_OVERHEAD
    burst = max(int(rate * spec.burst_ms / 1000), 16 * frame)
    limit = burst + max(int(rate * spec.queue_ms / 1000), 64 * frame)
    return burst, limit


def _shape(ipr: IPRoute, ifname: str, bps: int | None, spec: LabSpec) -> None:
    idx = _idx(ipr, ifname)
    try:
        ipr.tc("del", index=idx, handle=0, parent=0xFFFFFFFF)   # root qdisc, if any
    except NetlinkError:
        pass
    if bps is not None:
        burst, limit = _tbf_sizes(bps, spec)
        ipr.tc("add", "tbf", idx, handle=0x10000, rate=bps // 8, burst=burst, limit=limit)
    else:       # a queue to wait in when the peer's ring is full (module docstring)
        ipr.tc("add", "pfifo_fast", idx, handle=0x10000)


def _read_tbf(ipr: IPRoute, ifname: str) -> int | None:
    """The shaping rate (bits/s) the kernel holds on `ifname`, None if unshaped."""
    idx = _idx(ipr, ifname)
    for q in ipr.get_qdiscs(index=idx):
        if q.get_attr("TCA_KIND") == "tbf" and q["parent"] == 0xFFFFFFFF:
            return q.get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")["rate"] * 8
    return None


def _qdisc_drops(ipr: IPRoute, ifname: str) -> int:
    """Packets the qdiscs on ``ifname`` dropped (a tbf's or pfifo's queue overflowing).
    Not clsact's: xaggd's tc fan-out drops each result after cloning it."""
    total = 0
    for q in ipr.get_qdiscs(index=_idx(ipr, ifname)):
        st = q.get_attr("TCA_STATS")
        if st and q.get_attr("TCA_KIND") != "clsact":
            total += st["drop"]
    return total


def _link_drops(ipr: IPRoute, ifname: str) -> int:
    """Frames ``ifname`` could not hand to its peer (a veth: the peer's
    ring or the CPU's backlog full, an XDP_TX frame without room). Only tx:
    the peer counts some of the same frames in its rx_dropped, and both
    ends are read."""
    st = ipr.link("get", index=_idx(ipr, ifname))[0].get_attr("IFLA_STATS64")
    return st["tx_dropped"] if st else 0


def _udp_drops(snmp: str) -> int:
    """UDP datagrams a socket buffer had no room for, from /proc/net/snmp."""
    rows = [line.split()[1:] for line in snmp.splitlines() if line.startswith("Udp:")]
    if len(rows) < 2:
        return 0
    d = dict(zip(rows[0], rows[1]))
    return int(d.get("RcvbufErrors", 0)) + int(d.get("SndbufErrors", 0))


class Lab:
    """A virtual cluster.  Use as a context manager, or up()/down()::

        with Lab(LabSpec(workers=3, rate="1gbit", rate_of={"w2": "200mbit"})) as lab:
            print(lab.exec("w0", ["ping", "-c1", lab.host("a0").ip]).returncode)
            p = lab.spawn("a0", ["python", "-m", "http.server"])
    """

    def __init__(self, spec: LabSpec | None = None, **kw):
        self.spec = spec if spec is not None else LabSpec(**kw)
        self.spec.validate()
        net = ipaddress.IPv4Network(self.spec.subnet)
        self.prefixlen = net.prefixlen
        self.broadcast = str(net.broadcast_address)
        self.hosts: list[Host] = []
        for kind, base, n, p in (("worker", self.spec.worker_base, self.spec.workers, "w"),
                                 ("aggregator", self.spec.aggregator_base,
                                  self.spec.aggregators, "a")):
            for i in range(n):
                name, ip = f"{p}{i}", str(net.network_address + base + i)
                self.hosts.append(Host(name, kind, i, f"{self.spec.name}-{name}", ip,
                                       _mac_for(ip), self._rate_for(name), port=name,
                                       rack=self.spec.rack(name)))
        # loss rules: {host: {"out"|"in": [percent, udp_port]}}
        self.loss: dict[str, dict[str, list]] = {}
        self._procs: list[subprocess.Popen] = []
        self._origin = {"pid": os.getpid(), "created": time.time()}   # who built it

    # -- naming ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def switch_ns(self) -> str:
        return f"{self.name}-sw"

    @property
    def workers(self) -> list[Host]:
        return [h for h in self.hosts if h.kind == "worker"]

    @property
    def aggregators(self) -> list[Host]:
        return [h for h in self.hosts if h.kind == "aggregator"]

    def host(self, host: str | Host) -> Host:
        if isinstance(host, Host):
            return host
        for h in self.hosts:
            if h.name == host or h.netns == host:
                return h
        raise LabError(f"no host {host!r} in lab {self.name} (hosts: "
                       f"{', '.join(h.name for h in self.hosts)})")

    def _rate_for(self, name: str) -> int | None:
        return parse_rate(self.spec.rate_of.get(name, self.spec.rate))

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.name}.json"

    # -- life cycle -------------------------------------------------------------
    @staticmethod
    def exists(name: str) -> bool:
        return (STATE_DIR / f"{name}.json").exists() or bool(lab_namespaces(name))

    def up(self) -> "Lab":
        need_root()
        _tool("ip")
        if self.exists(self.name):
            raise LabExists(f"lab {self.name!r} already exists; run "
                            f"`xagg lab down --name {self.name}` first")
        self._save(state="building")   # a crash from here on leaves a trail for down
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self._save(state="up")
        return self

    def _build(self) -> None:
        spec, sw = self.spec, self.switch_ns
        for ns in [sw] + [h.netns for h in self.hosts]:
            netns.create(ns)
            # Before any link exists, so new devices inherit it.
            _ns_run(ns, [_tool("sysctl"), "-q", "-e", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                         "net.ipv6.conf.default.disable_ipv6=1"])
        # A switch runs no host firewall: where br_netfilter is loaded (it is
        # here) its per-netns default would pass every bridged frame through
        # iptables hooks, 7% of the machine in an unshaped all-reduce's profile.
        # The lab's loss rules are an nft bridge table, which needs no br_netfilter.
        _ns_run(sw, [_tool("sysctl"), "-q", "-e", "-w", "net.bridge.bridge-nf-call-iptables=0",
                     "net.bridge.bridge-nf-call-ip6tables=0", "net.bridge.bridge-nf-call-arptables=0"])
        with _ipr(sw) as s:
            s.link("set", index=_idx(s, "lo"), state="up")
            bridges = [self._add_bridge(s, f"br{r}") for r in range(spec.racks)]
            if spec.racks > 1:
                self._join_racks(s)
            for h in self.hosts:
                q = spec.agg_queues if h.kind == "aggregator" else 1
                with _ipr(h.netns) as ipr:
                    # Created from inside the host ns with the peer born in the switch
                    # ns: no device ever appears in the root namespace.
                    ipr.link("add", ifname=IFNAME, kind="veth", address=h.mac, mtu=spec.mtu,
                             num_tx_queues=q, num_rx_queues=q,
                             peer={"ifname": h.port, "net_ns_fd": sw, "mtu": spec.mtu,
                                   "num_tx_queues": q, "num_rx_queues": q})
                    idx = _idx(ipr, IFNAME)
                    ipr.addr("add", index=idx, address=h.ip, prefixlen=self.prefixlen,
                             broadcast=self.broadcast)
                    ipr.link("set", index=_idx(ipr, "lo"), state="up")
                    ipr.link("set", index=idx, state="up")
                    ipr.route("add", dst="255.255.255.255/32", oif=idx, scope=253)  # link
                    _shape(ipr, IFNAME, h.rate, spec)
                s.link("set", index=_idx(s, h.port), master=bridges[h.rack], state="up")
                _shape(s, h.port, h.rate, spec)
        for h in self.aggregators:
            _ns_run(sw, [_tool("bridge"), "link", "set", "dev", h.port, "mcast_flood", "off"])
            self.take_xdp_tx(h)
        if spec.loss_percent:
            self.set_loss(spec.loss_percent, udp_port=spec.loss_udp_port, _save=False)
        self._wait_carrier()

    def take_xdp_tx(self, host: str | Host) -> None:
        """Make the switch port of ``host`` take the frames its XDP program
        sends (XDP_TX): done for aggregators at build, and for a worker host
        when it aggregates too (experiment.Aggregators)."""
        h = self.host(host)
        _ns_run(self.switch_ns, [_tool("ethtool"), "-K", h.port, "gro", "on"])
        # GRO alone did not make the switch port take XDP_TX frames on
        # 6.18 (they were dropped); an XDP program there always does.
        from xagg.lab.xdp_pass import attach_pass
        attach_pass(h.port, self.switch_ns)

    @staticmethod
    def _add_bridge(s: IPRoute, name: str) -> int:
        # STP off: ports forward at once; no snooping: multicast floods like broadcast.
        s.link("add", ifname=name, kind="bridge", br_stp_state=0,
               br_forward_delay=0, br_mcast_snooping=0)
        idx = _idx(s, name)
        s.link("set", index=idx, state="up")
        return idx

    def _join_racks(self, s: IPRoute) -> None:
        """Each rack's bridge to the core bridge by one veth pair, shaped at
        the uplink rate on both ends (rack -> core on up<r>, core -> rack on
        dn<r>). A tree, so no loops and STP can stay off."""
        core = self._add_bridge(s, CORE_BRIDGE)
        bps = parse_rate(self.spec.uplink)
        for r in range(self.spec.racks):
            up, dn = f"up{r}", f"dn{r}"
            s.link("add", ifname=up, kind="veth", mtu=self.spec.mtu,
                   peer={"ifname": dn, "mtu": self.spec.mtu})
            s.link("set", index=_idx(s, up), master=_idx(s, f"br{r}"), state="up")
            s.link("set", index=_idx(s, dn), master=core, state="up")
            _shape(s, up, bps, self.spec)
            _shape(s, dn, bps, self.spec)

    def set_uplink(self, rate) -> None:
        """Shape every rack's uplink (both directions) to ``rate``; None = unshaped."""
        if self.spec.racks == 1:
            raise LabError(f"lab {self.name} has one rack: no uplink to shape")
        bps = parse_rate(rate)
        with _ipr(self.switch_ns) as s:
            for r in range(self.spec.racks):
                _shape(s, f"up{r}", bps, self.spec)
                _shape(s, f"dn{r}", bps, self.spec)
        self.spec.uplink = rate
        self._save()

    def uplink_rates(self) -> list[tuple[int | None, int | None]]:
        """Per rack, (rack -> core, core -> rack) shaping in bits/s, read back
        from the kernel; [] for a one-rack lab."""
        if self.spec.racks == 1:
            return []
        with _ipr(self.switch_ns) as s:
            return [(_read_tbf(s, f"up{r}"), _read_tbf(s, f"dn{r}"))
                    for r in range(self.spec.racks)]

    def uplink_bytes(self) -> list[tuple[int, int]]:
        """Per rack, bytes (rack -> core, core -> rack) its uplink has
        carried since the lab came up; [] for a one-rack lab."""
        if self.spec.racks == 1:
            return []
        out = []
        with _ipr(self.switch_ns) as s:
            for r in range(self.spec.racks):
                # up<r> transmits into the core; its peer dn<r> transmits into the rack
                st = [s.link("get", index=_idx(s, n))[0].get_attr("IFLA_STATS64")
                      for n in (f"up{r}", f"dn{r}")]
                out.append((st[0]["tx_bytes"], st[1]["tx_bytes"]))
        return out

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        # veth carrier comes up asynchronously; wait so the first packet is not lost.
        deadline = time.monotonic() + timeout
        for h in self.hosts:
            with _ipr(h.netns) as ipr:
                while True:
                    link = ipr.link("get", index=_idx(ipr, IFNAME))[0]
                    if link.get_attr("IFLA_OPERSTATE") == "UP":
                        break
                    if time.monotonic() > deadline:
                        raise LabError(f"{h.name}: {IFNAME} did not come up")
                    time.sleep(0.01)

    def down(self) -> list[str]:
        """Stop what spawn() started, remove all namespaces of this lab and its
        state file.  Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        return destroy(self.name)

    def __enter__(self) -> "Lab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- state file -----------------------------------------------------------
    def _save(self, state: str = "up") -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"spec": dataclasses.asdict(self.spec), "state": state,
                                   **self._origin, "loss": self.loss}, indent=1))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, name: str = DEFAULT_NAME) -> "Lab":
        """The lab `name` as recorded by the process that built it."""
        try:
            d = json.loads((STATE_DIR / f"{name}.json").read_text())
        except FileNotFoundError:
            raise LabNotFound(f"no lab {name!r} (no {STATE_DIR}/{name}.json); "
                              f"`xagg lab status` lists labs") from None
        lab = cls(LabSpec(**d["spec"]))
        lab.loss = d.get("loss", {})
        lab._origin = {"pid": d.get("pid"), "created": d.get("created")}
        return lab

    # -- processes ------------------------------------------------------------
    def argv_in(self, host: str | Host, argv) -> list[str]:
        """`argv` prefixed to run inside the host's namespace ("switch" = the bridge's)."""
        ns = self.switch_ns if host in ("switch", "sw") else self.host(host).netns
        if isinstance(argv, str):
            argv = shlex.split(argv)
        return [_tool("ip"), "netns", "exec", ns, *argv]

    def exec(self, host: str | Host, argv, **popen_kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(argv) inside the host's namespace."""
        return subprocess.run(self.argv_in(host, argv), **popen_kwargs)

    def spawn(self, host: str | Host, argv, **popen_kwargs) -> subprocess.Popen:
        """subprocess.Popen(argv) inside the host's namespace; down() stops it."""
        p = subprocess.Popen(self.argv_in(host, argv), **popen_kwargs)
        self._procs.append(p)
        return p

    # -- link emulation -------------------------------------------------------
    def set_rate(self, rate, hosts=None) -> None:
        """Shape the hosts' links (both directions) to `rate`; None = unshaped."""
        bps = parse_rate(rate)
        for h in map(self.host, hosts if hosts is not None else self.hosts):
            with _ipr(h.netns) as ipr:
                _shape(ipr, IFNAME, bps, self.spec)
            with _ipr(self.switch_ns) as s:
                _shape(s, h.port, bps, self.spec)
            h.rate = bps
            self.spec.rate_of[h.name] = rate
        self._save()

    def set_loss(self, percent: float, hosts=None, udp_port: int | None = None,
                 direction: str = "out", _save: bool = True) -> None:
        """Drop `percent` % of UDP frames at random on the hosts' switch ports.

        direction "out": frames the host sends; "in": frames delivered to it
        (XDP_TX results included); "both".  hosts default to the workers;
        udp_port restricts it to one destination port; percent 0 removes it.
        Resolution 0.01 %.  Drops are silent, as on a real lossy link.
        """
        if not 0 <= percent <= 100:
            raise LabError(f"bad loss {percent!r}: a percentage 0..100")
        dirs = {"out": ["out"], "in": ["in"], "both": ["out", "in"]}.get(direction)
        if dirs is None:
            raise LabError(f"bad direction {direction!r}: out, in or both")
        for h in map(self.host, hosts if hosts is not None else self.workers):
            for d in dirs:
                if percent:
                    self.loss.setdefault(h.name, {})[d] = [percent, udp_port]
                else:
                    self.loss.get(h.name, {}).pop(d, None)
        self.loss = {h: v for h, v in self.loss.items() if v}
        _ns_run(self.switch_ns, [_tool("nft"), "-f", "-"], input=self._nft_script())
        if _save:
            self._save()

    def _nft_script(self) -> str:
        rules = []
        for host, dirs in sorted(self.loss.items()):
            for d, (pct, port) in sorted(dirs.items()):
                match = f'{"iifname" if d == "out" else "oifname"} "{self.host(host).port}"'
                l4 = f"udp dport {int(port)}" if port else "meta l4proto udp"
                rules.append(f"    {match} {l4} numgen random mod 10000 < "
                             f"{round(pct * 100)} counter drop")
        # "add; delete; add" replaces the table atomically and works when absent.
        return (f"table bridge {NFT_TABLE}\ndelete table bridge {NFT_TABLE}\n"
                + (f"table bridge {NFT_TABLE} {{\n  chain forward {{\n"
                   f"    type filter hook forward priority 0; policy accept;\n"
                   + "\n".join(rules) + "\n  }\n}\n" if rules else ""))

    # -- inspection -----------------------------------------------------------
    def qdisc_rates(self, host: str | Host) -> tuple[int | None, int | None]:
        """(egress, ingress) shaping rates in bits/s, read back from the kernel:
        egress = the host's eth0, ingress = its switch port."""
        h = self.host(host)
        with _ipr(h.netns) as ipr:
            up = _read_tbf(ipr, IFNAME)
        with _ipr(self.switch_ns) as s:
            down = _read_tbf(s, h.port)
        return up, down

    def drops_of(self, h: Host) -> dict[str, int]:
        """``drops()`` of one host."""
        with _ipr(self.switch_ns) as sw, _ipr(h.netns) as ipr:
            queue = _qdisc_drops(ipr, IFNAME) + _qdisc_drops(sw, h.port)
            link = _link_drops(ipr, IFNAME) + _link_drops(sw, h.port)
        snmp = self.exec(h, ["cat", "/proc/net/snmp"], capture_output=True, text=True).stdout
        return {"queue": queue, "link": link, "socket": _udp_drops(snmp)}

    def drops(self) -> dict[str, dict[str, int]]:
        """Every place a packet can be lost, per host, counted since the lab
        came up: ``queue`` (the qdiscs at both ends of its link: tbf or
        pfifo_fast), ``link`` (driver drops at either end of its veth, XDP_TX
        rings included) and ``socket`` (UDP buffers of its namespace)."""
        return {h.name: self.drops_of(h) for h in self.hosts}

    @staticmethod
    def drops_between(before: dict, after: dict) -> dict[str, int]:
        """Drops by kind over all hosts between two ``drops()`` readings."""
        kinds = ("queue", "link", "socket")
        return {k: sum(after[h][k] - before.get(h, {}).get(k, 0) for h in after) for k in kinds}

    def status(self) -> list[dict]:
        """One row per host, from the kernel where it can be read."""
        have = set(lab_namespaces(self.name))
        rows = []
        for h in self.hosts:
            row = {"name": h.name, "kind": h.kind, "netns": h.netns, "ip": h.ip,
                   "mac": h.mac, "rate": format_bps(h.rate, unshaped="-"), "state": "missing",
                   "rack": h.rack,
                   "loss": " ".join(f"{d}:{p:g}%" + (f"@{port}" if port else "")
                                    for d, (p, port) in self.loss.get(h.name, {}).items())
                   or "-"}
            if h.netns in have and self.switch_ns in have:
                try:
                    with _ipr(h.netns) as ipr:
                        link = ipr.link("get", index=_idx(ipr, IFNAME))[0]
                        row["state"] = link.get_attr("IFLA_OPERSTATE").lower()
                        row["mac"] = link.get_attr("IFLA_ADDRESS")
                    up, down = self.qdisc_rates(h)
                    row["rate"] = (format_bps(up, unshaped="-") if up == down
                                   else f"{format_bps(up, unshaped='-')} up/{format_bps(down, unshaped='-')} down")
                    row["drops"] = " ".join(f"{k}:{v}" for k, v in self.drops_of(h).items() if v) or "-"
                except (LabError, NetlinkError, OSError) as e:
                    row["state"] = f"broken ({e})"
            rows.append(row)
        return rows
