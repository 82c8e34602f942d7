"""The raw bpf(2) commands xagg uses, through ctypes: the one place that
calls the syscall.

bcc 0.26 wraps none of these, and calling the syscall directly avoids a
dependency on a particular libbpf soname. Attribute layouts are the members
of ``union bpf_attr`` (include/uapi/linux/bpf.h) each command reads.

    prog_test_run   BPF_PROG_TEST_RUN: a crafted frame through a loaded program,
                    no network (packet tests, ``xaggd check``, the cost measurement)
    prog_load       BPF_PROG_LOAD of raw instructions: a few hand-written ones, or
                    bcc's bytecode with the flags bcc 0.26 cannot pass (multi-buffer XDP)
    prog_name       BPF_PROG_GET_FD_BY_ID + BPF_OBJ_GET_INFO_BY_FD: who is attached
    prog_id         BPF_OBJ_GET_INFO_BY_FD: the kernel's id of a program we hold
    prog_fd_by_id   BPF_PROG_GET_FD_BY_ID: a new fd for a loaded program
    map_lookup      BPF_MAP_LOOKUP_ELEM: one value of a map we were handed (a worker
                    reading its own host's aggregator's slots, client/local.py)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

SYS_BPF = 321           # x86_64
BPF_MAP_LOOKUP_ELEM = 1
BPF_PROG_LOAD = 5
BPF_PROG_TEST_RUN = 10
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_TYPE_XDP = 6

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def bpf(cmd: int, attr: ctypes.Structure | ctypes.Array, what: str) -> int:
    """bpf(cmd, &attr, sizeof attr); OSError naming ``what`` on failure."""
    rc = _libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed: {os.strerror(err)}")
    return rc


# -- BPF_PROG_TEST_RUN ----------------------------------------------------------
class _TestRunAttr(ctypes.Structure):
    # the anonymous `test` member
    _fields_ = [
        ("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32), ("_pad", ctypes.c_uint32),
    ]


@dataclass
class RunResult:
    action: int         # XDP_* verdict
    data: bytes         # the frame as the program left it
    duration_ns: int    # kernel-measured mean time per repetition


class XdpMd(ctypes.Structure):
    """struct xdp_md: a test run's context (only ingress_ifindex is ours to set)."""
    _fields_ = [("data", ctypes.c_uint32), ("data_end", ctypes.c_uint32), ("data_meta", ctypes.c_uint32),
                ("ingress_ifindex", ctypes.c_uint32), ("rx_queue_index", ctypes.c_uint32),
                ("egress_ifindex", ctypes.c_uint32)]


def prog_test_run(prog_fd: int, frame: bytes, repeat: int = 1, out_size: int | None = None,
                  ingress_ifindex: int = 0, meta: bytes = b"") -> RunResult:
    """Run ``prog_fd`` once (or ``repeat`` times) on ``frame``. A program
    loaded with BPF_F_XDP_HAS_FRAGS gets a frame longer than a page as a
    multi-buffer one (the kernel puts the tail in fragments). With
    ``ingress_ifindex`` (an interface of the caller's network namespace that
    runs XDP) the frame is as if it arrived there; with ``meta``, as if the
    driver had put that XDP metadata before it."""
    out_size = out_size or max(4096, len(meta) + len(frame) + 512)
    data = bytes(meta) + bytes(frame)
    inbuf = ctypes.create_string_buffer(data, len(data))
    outbuf = ctypes.create_string_buffer(out_size)
    attr = _TestRunAttr(prog_fd=prog_fd, data_size_in=len(data), data_size_out=out_size,
                        data_in=ctypes.addressof(inbuf), data_out=ctypes.addressof(outbuf),
                        repeat=repeat)
    if ingress_ifindex or meta:
        ctx = XdpMd(data=len(meta), data_end=len(data), ingress_ifindex=ingress_ifindex)
        attr.ctx_in, attr.ctx_size_in = ctypes.addressof(ctx), ctypes.sizeof(ctx)
    bpf(BPF_PROG_TEST_RUN, attr, "BPF_PROG_TEST_RUN")
    return RunResult(attr.retval, outbuf.raw[:attr.data_size_out], attr.duration)


# -- BPF_PROG_LOAD ----------------------------------------------------------------
BPF_F_XDP_HAS_FRAGS = 1 << 5    # prog_flags: the program copes with multi-buffer frames
BPF_XDP = 37                    # enum bpf_attach_type: expected_attach_type of such a program


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
                ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
                ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("prog_name", ctypes.c_char * 16),
                ("prog_ifindex", ctypes.c_uint32), ("expected_attach_type", ctypes.c_uint32),
                ("_rest", ctypes.c_uint8 * 64)]


def prog_load(prog_type: int, insns: bytes, name: str, *, prog_flags: int = 0,
              expected_attach_type: int = 0, log_size: int = 0) -> int:
    """fd of a program made of raw ``insns`` (8 bytes each); the caller closes it.
    With ``log_size`` a rejection's OSError ends with the verifier log's tail."""
    ibuf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    logbuf = ctypes.create_string_buffer(log_size) if log_size else None
    attr = _ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(ibuf),
                         license=ctypes.addressof(lic), prog_name=name.encode()[:15],
                         prog_flags=prog_flags, expected_attach_type=expected_attach_type)
    if logbuf is not None:
        attr.log_level, attr.log_size, attr.log_buf = 1, log_size, ctypes.addressof(logbuf)
    try:
        return bpf(BPF_PROG_LOAD, attr, f"loading BPF program {name!r}")
    except OSError as e:
        if logbuf is None:
            raise
        tail = logbuf.value.decode(errors="replace").strip().splitlines()[-12:]
        raise OSError(e.errno, f"{e.strerror}; verifier log (tail):\n  " + "\n  ".join(tail)) from None


# -- who is attached ----------------------------------------------------------------
def prog_fd_by_id(prog_id: int) -> int:
    """A new fd for loaded program ``prog_id`` (the caller closes it); OSError if gone."""
    return bpf(BPF_PROG_GET_FD_BY_ID, (ctypes.c_uint32 * 4)(prog_id, 0, 0, 0), "BPF_PROG_GET_FD_BY_ID")


def _prog_info(fd: int) -> bytes:
    info = ctypes.create_string_buffer(256)          # struct bpf_prog_info
    req = (ctypes.c_uint64 * 2)(fd | (256 << 32), ctypes.addressof(info))
    bpf(BPF_OBJ_GET_INFO_BY_FD, req, "BPF_OBJ_GET_INFO_BY_FD")
    return info.raw


def prog_id(fd: int) -> int:
    """The kernel's id of the program behind ``fd`` (what netlink reports as attached)."""
    return int.from_bytes(_prog_info(fd)[4:8], "little")            # __u32 id after __u32 type


def prog_name(prog_id: int) -> str | None:
    """The name of loaded BPF program ``prog_id`` (None if it cannot be read)."""
    try:
        fd = prog_fd_by_id(prog_id)
    except OSError:
        return None
    try:
        return _prog_info(fd)[64:80].split(b"\0", 1)[0].decode(errors="replace")   # name[16] at 64
    except OSError:
        return None
    finally:
        os.close(fd)


# -- maps ---------------------------------------------------------------------------
class _MapElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def map_lookup(map_fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value under ``key`` (``value_size`` bytes), or None where there is none."""
    kbuf = ctypes.create_string_buffer(bytes(key), len(key))
    vbuf = ctypes.create_string_buffer(value_size)
    attr = _MapElemAttr(map_fd=map_fd, key=ctypes.addressof(kbuf), value=ctypes.addressof(vbuf))
    try:
        bpf(BPF_MAP_LOOKUP_ELEM, attr, "BPF_MAP_LOOKUP_ELEM")
    except OSError as e:
        if e.errno == 2:        # ENOENT
            return None
        raise
    return vbuf.raw
