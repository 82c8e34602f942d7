"""Compile and load the xagg data plane with bcc, and own its maps.

The flow follows bcc's tools: build, load, attach (attach.py), run, detach
in ``finally``. Errors a user can act on are raised as ``LoaderError`` with
the command or cause that fixes them.
"""
from __future__ import annotations

import logging
import os
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

from xagg.wire.jobspec import WIDE_BLOCK, JobSpec, block_bits, first_block, is_wide, set_words
from xagg.wire.proto import BPF_DIR, VERDICTS, C
from xaggd.dataplane import LoaderError, caps
from xaggd.dataplane.attach import attach
from xaggd.settings import BY_NAME, udp_port_problem
from xagg.wire.syscalls import BPF_F_XDP_HAS_FRAGS, BPF_PROG_TYPE_XDP, BPF_XDP, prog_load

log = logging.getLogger("xaggd.dataplane")

# The largest MTU whose frames a driver hands to XDP in one buffer: veth's
# limit for a program without BPF_F_XDP_HAS_FRAGS is a 4 KiB page less XDP
# headroom and skb_shared_info (3,506 bytes); most NIC drivers are similar.
LINEAR_MAX_MTU = 3500


@dataclass(frozen=True)
class ProgramConfig:
    """Compile-time specialisation (bcc -D flags)."""
    vals: int = C.XAGG_VALS
    max_workers: int = C.XAGG_MAX_WORKERS
    max_jobs: int = C.XAGG_MAX_JOBS
    max_slots: int = C.XAGG_MAX_SLOTS
    port: int = C.XAGG_PORT
    lock: bool = True
    mtu: int = 1500           # of the aggregator's link: bounds vals (one frame per packet)
    frags: bool | None = None  # multi-buffer build; None: when the MTU needs it

    @property
    def multi_buffer(self) -> bool:
        return self.mtu > LINEAR_MAX_MTU if self.frags is None else self.frags

    def validate(self) -> "ProgramConfig":
        from xagg.wire.proto import max_vals
        # the daemon's settings were checked by their own rules (settings.py);
        # a program built without them (tests, the bench) is checked by the same
        problems = {
            "vals": None if 1 <= self.vals <= max_vals(self.mtu) else
            f"must be 1..{max_vals(self.mtu)} (what fits a {self.mtu}-byte MTU)",
            **{name: BY_NAME[name].problem(getattr(self, name), self)
               for name in ("max_workers", "max_jobs", "max_slots")},
            "port": udp_port_problem(self.port, any_port_ok=False),
        }
        for name, why in problems.items():
            if why:
                raise LoaderError(f"program.{name}={getattr(self, name)!r}: {why}")
        return self

    def cflags(self) -> list[str]:
        return [f"-I{BPF_DIR}", f"-DXAGG_VALS={self.vals}", f"-DXAGG_MAX_WORKERS={self.max_workers}",
                f"-DXAGG_MAX_JOBS={self.max_jobs}", f"-DXAGG_MAX_SLOTS={self.max_slots}",
                f"-DXAGG_PORT={self.port}", f"-DXAGG_LOCK={int(self.lock)}",
                f"-DXAGG_FRAGS={int(self.multi_buffer)}",
                "-Wno-unused-value", "-Wno-pointer-sign", "-Wno-compare-distinct-pointer-types"]

    @property
    def slot_bytes(self) -> int:
        from xagg.wire.proto import slot_bytes
        return slot_bytes(self.vals)


@dataclass(frozen=True)
class LoadedFn:
    """A program loaded outside bcc: what callers use of bcc's own handle."""
    name: str
    fd: int


def _import_bcc():
    try:
        from bcc import BPF  # noqa: WPS433 (optional dependency)
        return BPF
    except ImportError as e:
        raise LoaderError(
            "bcc is not importable: install Debian's python3-bpfcc and run `make setup` "
            f"(it links bcc into the venv). ({e})") from None


def preflight(netns: str | None = None) -> None:
    """Raise LoaderError for the things that stop any XDP program loading
    (attaching in ``netns``, where given)."""
    lack = caps.missing(netns=bool(netns))
    if lack:
        raise LoaderError(f"XDP needs {' + '.join(lack)}" + (" (--netns enters another namespace)" if
                                                             "CAP_SYS_ADMIN" in lack else "")
                          + ", which this process lacks: run it as root, give its user these capabilities "
                          "(daemon/xaggd.service does), or use the userspace aggregator "
                          "(`xaggd start --userspace`).")
    _import_bcc()
    kdir = f"/lib/modules/{os.uname().release}"
    if not os.path.exists(f"{kdir}/build/include"):
        raise LoaderError(f"kernel headers missing: {kdir}/build does not exist. "
                          "Run `make setup` (installs linux-headers-amd64 and links it there).")


def ip_to_be32(ip: str) -> int:
    """An IPv4 address as the u32 the kernel stores (network byte order)."""
    return int.from_bytes(socket.inet_aton(ip), "little") if ip else 0


class XaggProgram:
    """The compiled data plane and its maps. One per aggregator interface."""

    def __init__(self, config: ProgramConfig = ProgramConfig()):
        self.config = config.validate()
        preflight()
        BPF = _import_bcc()
        self._BPF = BPF
        src = (BPF_DIR / "xagg_xdp.c").read_bytes()
        try:
            self.bpf = BPF(text=src, cflags=self.config.cflags())
        except Exception as e:  # bcc raises bare Exception on compile errors
            raise LoaderError(f"compiling bpf/xagg_xdp.c failed: {e}") from None
        self._own_fd = None
        if self.config.multi_buffer:
            self.xdp_fn = self._load_multi_buffer("xagg_xdp")
        else:
            self.xdp_fn = self._load("xagg_xdp", BPF.XDP)
        self.tc_fn = self._load("xagg_tc_fanout", BPF.SCHED_CLS)
        self.jobs = self.bpf[b"jobs"]
        self.workers = self.bpf[b"workers"]
        self.children = self.bpf[b"children"]
        self.slots = self.bpf[b"slots"]
        self.counters_map = self.bpf[b"counters"]
        self.job_stats_map = self.bpf[b"job_stats"]
        self._gen = 0
        self._job_at = {}           # job_index -> (job_id, agg key) installed there

    def _load(self, name: str, kind):
        # bcc writes the verifier log straight to fd 2; keep it so the error
        # can show its tail (the reason) instead of pages of register state
        with tempfile.TemporaryFile() as logf:
            saved = os.dup(2)
            os.dup2(logf.fileno(), 2)
            try:
                return self.bpf.load_func(name.encode(), kind)
            except Exception as e:
                os.dup2(saved, 2)
                logf.seek(0)
                tail = logf.read().decode(errors="replace").strip().splitlines()[-12:]
                raise LoaderError(f"the kernel verifier rejected {name}: {e}\n"
                                  "verifier log (tail):\n  " + "\n  ".join(tail)) from None
            finally:
                os.dup2(saved, 2)
                os.close(saved)

    def _load_multi_buffer(self, name: str) -> "LoadedFn":
        """bcc 0.26's load_func cannot pass BPF_F_XDP_HAS_FRAGS, so the
        bytecode bcc compiled (map fds already in it) is loaded directly."""
        insns = self.bpf.dump_func(name.encode())
        try:
            fd = prog_load(BPF_PROG_TYPE_XDP, insns, name, prog_flags=BPF_F_XDP_HAS_FRAGS,
                           expected_attach_type=BPF_XDP, log_size=1 << 24)
        except OSError as e:
            raise LoaderError(f"the kernel refused multi-buffer XDP program {name} ({e}); "
                              f"multi-buffer XDP needs Linux 5.18+, or use an MTU <= {LINEAR_MAX_MTU}"
                              ) from None
        self._own_fd = fd
        return LoadedFn(name, fd)

    def close(self) -> None:
        """Release the program and its maps (after detaching)."""
        if self._own_fd is not None:
            os.close(self._own_fd)
            self._own_fd = None
        self.bpf.cleanup()

    # -- jobs -------------------------------------------------------------
    def job_key(self, job_id: int, agg: int = C.XAGG_AGG_MAIN):
        """The `jobs` map key of a job's main entry, or of its child entry
        for aggregator ``agg``'s chunk range."""
        return self.jobs.Key(job_id=job_id, agg_id=agg)

    @staticmethod
    def entry_of(spec: JobSpec) -> tuple[int, int]:
        """(job_id, agg key) of the entry ``spec`` installs."""
        return spec.job_id, spec.agg_id if spec.is_child else C.XAGG_AGG_MAIN

    def set_job(self, spec: JobSpec, *, slot_base: int, job_index: int) -> None:
        """Install or replace a job entry (its main one, or a child entry
        when ``spec.parent_ip`` is set). Its slots reset lazily (new generation)."""
        spec.validate(self.config.max_workers)
        if not 0 <= job_index < self.config.max_jobs:
            raise LoaderError(f"job_index {job_index} outside 0..{self.config.max_jobs - 1}")
        if slot_base + spec.n_slots > self.config.max_slots:
            raise LoaderError(f"job {spec.job_id} needs slots {slot_base}..{slot_base + spec.n_slots} "
                              f"but the program has {self.config.max_slots}")
        if spec.is_child and not spec.parent_mac:
            raise LoaderError(f"job {spec.job_id}: a child entry sends its partials from XDP and "
                              "needs the next hop's MAC towards its parent (parent_mac)")
        entry = self.entry_of(spec)
        old = self._job_at.get(job_index)
        if old is not None and old != entry:
            self.remove_job(*old)
        self._job_at[job_index] = entry
        # a wide child's workers send only through it; its bit stands for them
        behind = sum(m for _, m in spec.children if is_wide(m))
        wide = sum(1 << i for i, (_, m) in enumerate(spec.children) if is_wide(m))
        # rows past n_workers are never read: their bits are outside full_set
        for wid in range(spec.n_workers):
            w = self.workers.Leaf()
            w.ip = w.addr = ip_to_be32(spec.worker_ip(wid))     # pinned: never learned
            w.behind = behind >> wid & 1
            self.workers[self.workers.Key(job_index * self.config.max_workers + wid)] = w
        for i in range(C.XAGG_MAX_CHILDREN):
            c = self.children.Leaf()
            if i < len(spec.children):
                ip, mask = spec.children[i]
                c.ip = c.addr = ip_to_be32(ip)
                if is_wide(mask):
                    c.block, c.mask, c.n = WIDE_BLOCK, 1 << i, bin(mask).count("1")
                else:
                    c.block, c.mask = block_bits(mask)
            self.children[self.children.Key(job_index * C.XAGG_MAX_CHILDREN + i)] = c
        self._gen = (self._gen + 1) & 0xFFFFFFFF or 1
        j = self.jobs.Leaf()
        j.cookie, j.gen, j.slot_base, j.n_chunks = spec.cookie, self._gen, slot_base, spec.n_chunks
        j.full_set[:] = set_words(spec.full_mask) + [wide]
        j.n_full = bin(spec.full_mask).count("1")
        j.job_index, j.n_workers = job_index, spec.n_workers
        j.up_block, j.wide = first_block(spec.mask), is_wide(spec.mask)
        j.bcast_ip = ip_to_be32(spec.bcast_ip)
        j.result_port = socket.htons(spec.result_port)
        j.fanout = spec.fanout.value
        j.agg_id, j.n_aggs = spec.agg_id, spec.n_aggs
        j.n_children = len(spec.children)
        if spec.is_child:
            j.parent_ip = ip_to_be32(spec.parent_ip)
            j.parent_port = socket.htons(spec.parent_port)
            j.parent_mac[:] = list(bytes.fromhex(spec.parent_mac.replace(":", "")))
        self.jobs[self.job_key(*entry)] = j
        self.job_stats_map.clearitem(self.job_stats_map.Key(job_index))

    def remove_job(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> None:
        """Remove a job's main entry, or its child entry for aggregator ``agg``."""
        self._job_at = {i: e for i, e in self._job_at.items() if e != (job_id, agg)}
        try:
            del self.jobs[self.job_key(job_id, agg)]
        except KeyError:
            pass

    # -- reading state ----------------------------------------------------
    def job(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> dict | None:
        try:
            j = self.jobs[self.job_key(job_id, agg)]
        except KeyError:
            return None
        out = {f: getattr(j, f) for f, _ in j._fields_}
        out["parent_mac"] = bytes(j.parent_mac)
        out["full_set"] = [int(w) for w in j.full_set]
        return out

    def counters(self) -> dict[str, int]:
        """Per-verdict counters summed over CPUs."""
        return {name: int(self.counters_map.sum(self.counters_map.Key(i)).value)
                for i, name in enumerate(VERDICTS)}

    def job_stats(self, job_index: int) -> dict[str, int]:
        per_cpu = self.job_stats_map[self.job_stats_map.Key(job_index)]
        out = {f: 0 for f, _ in self.job_stats_map.sLeaf._fields_}
        for cpu_val in per_cpu:
            for f in out:
                out[f] += getattr(cpu_val, f)
        return out

    def slot(self, index: int) -> dict:
        s = self.slots[self.slots.Key(index)]
        return {"gen": s.gen, "round": s.round, "done": s.done, "count": s.count,
                # the workers' words; the last holds wide children, by row
                "mask": sum(int(w) << 64 * i for i, w in enumerate(s.set[:C.XAGG_SET_WORDS])),
                "wide_children": int(s.set[C.XAGG_SET_WORDS]), "vals": list(s.vals)}

    # -- attaching --------------------------------------------------------
    @contextmanager
    def attached(self, ifname: str, netns: str | None = None, mode: str = "auto",
                 unicast: bool = True):
        """Attach XDP (and the tc fan-out) to ``ifname``; always detach."""
        att = attach(ifname, self.xdp_fn.fd, self.tc_fn.fd if unicast else None, netns=netns, mode=mode)
        try:
            yield att
        finally:
            att.detach()
