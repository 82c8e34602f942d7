"""Every setting of `xaggd start`, declared once.

One row per setting: its name (the TOML key; ``XAGGD_NAME`` upper-cased in
the environment; ``--name`` with dashes as a flag), how a raw value is
parsed, its default, its help text and the check its value must pass.
``Config`` (config.py) takes its dataclass fields from this table and the
CLI (cli.py) its flags, so a new setting is one new row.

A check sees the setting's value and the whole configuration, and returns
why the value cannot be used, or None. Rules between settings that are not
one setting's range (memory vs max_slots, a token file for --listen) stand
in ``Config.validate``.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from xagg.wire.addresses import split_host_port
from xagg.wire.proto import JUMBO_MTU, MAX_VALS, C, max_vals

ENV_PREFIX = "XAGGD_"
MODES = ("auto", "driver", "generic")
LOCKS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_MEMORY = 256 << 20
MAX_SLOTS = 1 << 26
UNIX_PATH_MAX = 108             # sun_path, with its terminating NUL
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)
_SIZE_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.I)
_DURATION_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


# -- parsers: a flag's, variable's or key's raw value -> the value -----------
# A ValueError's message says what the value must look like.
def parse_size(value) -> int:
    """256M, 1G, 512KiB, 1048576 -> bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 256M, 1G or 1048576")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError("expected a size like 256M, 1G or 1048576")
    return int(float(m.group(1)) * _SIZE_UNIT[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def parse_duration(value) -> float:
    """90, 90s, 10m, 1.5h, 1d -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like 90s, 10m or 1h")
    if isinstance(value, (int, float)):
        return float(value)
    m = _DURATION_RE.match(str(value))
    if not m:
        raise ValueError("expected a duration like 90s, 10m or 1h")
    return float(m.group(1)) * _DURATION_UNIT[m.group(2).lower()]


def parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false (1/0, yes/no)")


def parse_int(value) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip(), 0)
    except ValueError:
        raise ValueError("expected an integer") from None


def parse_str(value) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def parse_lower(value) -> str:
    return parse_str(value).lower()


def parse_hostport(value: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """"0.0.0.0:9979", ":9979", "9979" -> (host, port)."""
    try:
        host, p = split_host_port(value, default_host=default_host)
    except ValueError as e:
        raise ValueError(f"{e} (e.g. 0.0.0.0:9979; port 0: any free port)") from None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (expected HOST:PORT, e.g. 0.0.0.0:9979)") from None
    return host, p


ROOT_RUN_DIR = "/run/xaggd"


def default_run_dir() -> str:
    if os.geteuid() == 0:
        return ROOT_RUN_DIR
    base = os.environ.get("XDG_RUNTIME_DIR")
    return f"{base}/xaggd" if base else f"/tmp/xaggd-{os.geteuid()}"


# -- checks: (value, config) -> why the value cannot be used, or None --------
def in_range(lo: int, hi: int, why: str = "") -> Callable:
    def check(value, cfg):
        return None if lo <= value <= hi else f"must be {lo}..{hi}" + (f" ({why})" if why else "")
    return check


def udp_port_problem(port: int, any_port_ok: bool) -> str | None:
    """The port rule, for the daemon's setting and for a program built
    without one (dataplane/program.py): 0 binds any free port, which only a
    socket (the userspace aggregator) can."""
    if 0 <= port < 65536 and (port or any_port_ok):
        return None
    return "must be a UDP port, 1..65535 (0, any free port, only with userspace)"


def _vals(vals, cfg):
    if 0 <= vals <= MAX_VALS:
        return None
    return (f"must be 1..{MAX_VALS} (a packet must fit the interface's MTU; "
            f"{max_vals()} fit 1500 bytes), or 0 for what the MTU takes")


def _instance_name(name, cfg):
    return None if _NAME_RE.match(name) else "letters, digits, '.', '_' or '-', at most 64"


def _absolute(path, cfg):
    return None if os.path.isabs(path) else "must be an absolute path"


def _socket_path(path, cfg):
    if not os.path.isabs(path):
        return "must be an absolute path"
    if len(path.encode()) >= UNIX_PATH_MAX:
        return f"a Unix socket path must be under {UNIX_PATH_MAX} bytes"
    return None


def _ipv4(addr, cfg):
    try:
        ipaddress.IPv4Address(addr)
    except ValueError:
        return "must be an IPv4 address"
    return None


def _lease(seconds, cfg):
    return None if seconds >= 0 else "must be a duration (10m), or 0 for never"


def _hostport(value, cfg):
    try:
        parse_hostport(value)
    except ValueError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[Any], Any]
    default: Any                  # a function: called for each Config (a default that depends on the host)
    help: str
    metavar: str | None = None
    shown_default: str | None = None    # how --help shows the default, where not str(default)
    choices: tuple = ()
    check: Callable[[Any, Any], str | None] | None = None
    off_flag: str | None = None         # a boolean's "false" flag, where not --no-NAME
    reloadable: bool = False            # SIGHUP applies a new value; the rest takes a restart

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def annotation(self) -> str:
        kind = {parse_int: "int", parse_size: "int", parse_bool: "bool",
                parse_duration: "float"}.get(self.parse, "str")
        return kind if self.default is not None else f"{kind} | None"

    @property
    def help_text(self) -> str:
        """The flag's help with its default, as --help prints it."""
        shown = self.shown_default
        if shown is None and self.default not in (None, False) and not callable(self.default):
            shown = str(self.default)
        return f"{self.help} [default: {shown}]." if shown else f"{self.help}."

    def problem(self, value, cfg) -> str | None:
        """Why ``value`` cannot be used; None when it can, or is unset (None)."""
        if value is None:
            return None
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return self.check(value, cfg) if self.check else None


# In the order `xaggd start --help` lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting("iface", parse_str, None, "Interface to attach to (eth0). Required unless --userspace",
            metavar="IFACE"),
    Setting("netns", parse_str, None, "Network namespace holding IFACE (the control sockets stay in this "
            "process's namespace)", metavar="NS"),
    Setting("port", parse_int, C.XAGG_PORT, "UDP port workers send to", metavar="PORT",
            check=lambda port, cfg: udp_port_problem(port, cfg.userspace)),
    Setting("memory", parse_size, DEFAULT_MEMORY, "Memory for chunk slots (256M, 1G, ...): decides how many "
            "jobs and elements fit", metavar="SIZE", shown_default=f"{DEFAULT_MEMORY >> 20}M"),
    Setting("max_slots", parse_int, None, "Size the slot pool in slots instead of --memory (2 slots per "
            "chunk held)", metavar="N", check=in_range(2, MAX_SLOTS)),
    Setting("max_jobs", parse_int, C.XAGG_MAX_JOBS, "Jobs served at once", metavar="N",
            check=in_range(1, 4096)),
    Setting("max_workers", parse_int, C.XAGG_MAX_WORKERS, f"Workers per job, <= {64 * C.XAGG_SET_WORDS}",
            metavar="N", check=in_range(1, 64 * C.XAGG_SET_WORDS,
                                        f"a slot's contributor set holds {64 * C.XAGG_SET_WORDS}")),
    Setting("vals", parse_int, 0, "int32 values per packet; clients learn it when they register",
            metavar="N", check=_vals,
            shown_default=f"as many as the interface MTU takes: {max_vals(1500)} at 1500, "
                          f"{max_vals(JUMBO_MTU)} at {JUMBO_MTU}; {C.XAGG_VALS} userspace"),
    Setting("mode", parse_str, "auto", "XDP attach mode; auto tries driver, then generic", choices=MODES),
    Setting("lock", parse_str, "auto", "Per-slot spin lock, which makes the sums safe when several CPUs run "
            "XDP at once (one per RX queue). auto leaves it out only where the interface has one RX queue "
            "and XDP runs in driver mode; off trusts you that it does", choices=LOCKS),
    Setting("control", parse_str, None, "Unix control socket, mode 0600", metavar="PATH",
            shown_default="RUN_DIR/NAME.sock", check=_socket_path),
    Setting("listen", parse_str, None, "Also accept control over TCP (needs --token-file). Without "
            "--tls-cert the tokens and cookies cross the network in clear: give a certificate, or listen "
            "only on a network you trust", metavar="HOST:PORT", check=_hostport),
    Setting("tls_cert", parse_str, None, "Serve --listen over TLS with this PEM certificate (chain); "
            "clients verify it against their CA file (xaggd status --control-ca)", metavar="FILE"),
    Setting("tls_key", parse_str, None, "The PEM private key of --tls-cert, where the certificate file "
            "does not hold it", metavar="FILE"),
    Setting("token_file", parse_str, None, "Admin token for TCP control (>= 16 characters): every op on "
            "every job. SIGHUP re-reads it", metavar="FILE", reloadable=True),
    Setting("client_token_file", parse_str, None, "Client token for TCP control: register jobs, then "
            "manage only those (each job's own token). SIGHUP re-reads it", metavar="FILE",
            reloadable=True),
    Setting("metrics", parse_str, None, "Serve Prometheus metrics at http://HOST:PORT/metrics (verdicts, "
            "per-job counters, slots, mode)", metavar="HOST:PORT", shown_default="off", check=_hostport),
    Setting("job_lease", parse_duration, 600.0, "Remove a job that has had neither packets nor "
            "requests from its registrant (register, resize, reset, keepalive) for this long, giving its "
            "slots back (90s, 10m, 1h; 0: never)", metavar="DURATION", shown_default="10m",
            check=_lease, reloadable=True),
    Setting("max_connections", parse_int, 64, "TCP control connections at once", metavar="N",
            check=in_range(1, 4096)),
    Setting("userspace", parse_bool, False, "Aggregate in Python (xaggd.dataplane.userspace) instead of "
            "XDP: for hosts without root or kernel headers", off_flag="--xdp"),
    Setting("bind", parse_str, "0.0.0.0", "Address the userspace aggregator binds", metavar="IP",
            check=_ipv4),
    Setting("name", parse_str, "xaggd", "Instance name: RUN_DIR/NAME.pid, RUN_DIR/NAME.sock",
            metavar="NAME", check=_instance_name),
    Setting("run_dir", parse_str, default_run_dir, "Directory for pid files and sockets", metavar="DIR",
            shown_default="/run/xaggd as root, else $XDG_RUNTIME_DIR/xaggd", check=_absolute),
    Setting("state_dir", parse_str, None, "Directory for the jobs kept across restarts (NAME.jobs.json); "
            "xaggd.service gives /var/lib/xaggd, which outlives the run dir", metavar="DIR",
            shown_default="RUN_DIR", check=_absolute),
    Setting("log_level", parse_lower, "info", "How much the daemon logs (SIGHUP applies a new one)",
            choices=LOG_LEVELS, reloadable=True),
    Setting("replace_foreign", parse_bool, False, "Replace another tool's XDP program on IFACE"),
    Setting("xdp_meta", parse_bool, True, "IFACE's driver supports XDP metadata, which unicast fan-out "
            "needs; --no-xdp-meta refuses unicast jobs",
            shown_default="assumed, and refused once a completion shows otherwise"),
)

BY_NAME = {s.name: s for s in SETTINGS}
