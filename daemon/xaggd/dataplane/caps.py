"""Whether this process may load and attach the XDP data plane: a question
of capabilities, not of uid 0, so that xaggd can run as a user of its own
(daemon/xaggd.service gives it these as ambient capabilities).

What each one is for, as tried with the daemon under setpriv:

    CAP_BPF        create the maps and load the programs
    CAP_PERFMON    the verifier's pointer arithmetic (without it: "pointer
                   arithmetic ... prohibited for !root")
    CAP_NET_ADMIN  load XDP and tc programs, attach them to the interface

CAP_SYS_ADMIN stands in for CAP_BPF and CAP_PERFMON (the kernel accepts it
for both). ``--netns`` needs CAP_SYS_ADMIN as well: entering another network
namespace (setns) takes it.
"""
from __future__ import annotations

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

NEEDED = {"CAP_BPF": CAP_BPF, "CAP_PERFMON": CAP_PERFMON, "CAP_NET_ADMIN": CAP_NET_ADMIN}
SYS_ADMIN_COVERS = ("CAP_BPF", "CAP_PERFMON")


def effective(status_path: str = "/proc/self/status") -> int:
    """The effective capability set, as a bit mask."""
    with open(status_path) as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def has(mask: int, cap: int) -> bool:
    return bool(mask >> cap & 1)


def missing(mask: int | None = None, netns: bool = False) -> list[str]:
    """The capabilities the XDP data plane needs that ``mask`` (default: this
    process's effective set) lacks, by name; [] when it may go ahead."""
    mask = effective() if mask is None else mask
    sys_admin = has(mask, CAP_SYS_ADMIN)
    lack = [name for name, cap in NEEDED.items()
            if not has(mask, cap) and not (sys_admin and name in SYS_ADMIN_COVERS)]
    if netns and not sys_admin:
        lack.append("CAP_SYS_ADMIN")
    return lack
