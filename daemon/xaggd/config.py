"""xaggd's configuration: one dataclass, four layers.

Precedence, highest first: command-line flags > environment (``XAGGD_*``) >
the TOML file (``--config FILE`` or ``XAGGD_CONFIG``) > defaults. Every value
is parsed and checked here, so a bad one is reported once, naming the field,
where it came from and what it must be::

    config: memory='12Q' (from env XAGGD_MEMORY): expected a size like 256M, 1G or 1048576
"""
from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = None

from xagg.wire.proto import JUMBO_MTU, MAX_VALS, C, max_vals, slot_bytes

ENV_PREFIX = "XAGGD_"
MODES = ("auto", "driver", "generic")
LOCKS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_MEMORY = 256 << 20
MIN_TOKEN_CHARS = 16
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)
_SIZE_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field."""


def default_run_dir() -> str:
    if os.geteuid() == 0:
        return "/run/xaggd"
    base = os.environ.get("XDG_RUNTIME_DIR")
    return f"{base}/xaggd" if base else f"/tmp/xaggd-{os.geteuid()}"


def who(name: str) -> str:
    """How messages name an instance: "xaggd", or "xaggd a0" for --name a0."""
    return "xaggd" if name == "xaggd" else f"xaggd {name}"


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


def parse_hostport(value: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """"0.0.0.0:9979", ":9979", "9979" -> (host, port)."""
    s = str(value).strip()
    host, sep, port = s.rpartition(":")
    if not sep:
        host, port = default_host, s
    host = host.strip("[]") or default_host
    try:
        p = int(port)
    except ValueError:
        raise ValueError("expected HOST:PORT, e.g. 0.0.0.0:9979") from None
    if not 0 <= p < 65536:
        raise ValueError(f"port {p} is not 0..65535 (0: any free port)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (expected HOST:PORT, e.g. 0.0.0.0:9979)") from None
    return host, p


# name -> (parser, help). Keys of the TOML file and, upper-cased with the
# XAGGD_ prefix, of the environment. Flags use the same names with dashes.
FIELDS = {
    "name": (parse_str, "instance name: pid file RUN_DIR/NAME.pid, control socket RUN_DIR/NAME.sock"),
    "iface": (parse_str, "interface the XDP program attaches to (required unless userspace)"),
    "netns": (parse_str, "network namespace that holds iface (data plane only)"),
    "port": (parse_int, "UDP port workers send gradients to"),
    "memory": (parse_size, "memory for chunk slots (256M, 1G, ...); sets max_slots"),
    "max_slots": (parse_int, "chunk slots (instead of memory): 2 per chunk held"),
    "max_jobs": (parse_int, "jobs served at once"),
    "max_workers": (parse_int, "workers per job (bitmap width, <= 64)"),
    "vals": (parse_int, "int32 values per packet; 0 (default): as many as the interface MTU takes"),
    "mode": (parse_str, "XDP attach mode: auto, driver or generic"),
    "lock": (parse_str, "per-slot spin lock: auto (off only where one RX queue in driver mode runs "
                        "XDP on one CPU at a time), on, or off"),
    "control": (parse_str, "Unix control socket path"),
    "listen": (parse_str, "HOST:PORT for remote control over TCP (needs token_file)"),
    "token_file": (parse_str, "file holding the admin token for TCP control: every op on every job"),
    "client_token_file": (parse_str, "file holding the client token for TCP control: register jobs, "
                                     "then manage only those (each job's token)"),
    "max_connections": (parse_int, "TCP control connections served at once"),
    "userspace": (parse_bool, "run the userspace aggregator instead of XDP"),
    "bind": (parse_str, "address the userspace aggregator binds"),
    "run_dir": (parse_str, "directory for pid files and control sockets"),
    "log_level": (parse_str, "debug, info, warning or error"),
    "replace_foreign": (parse_bool, "replace an XDP program on iface that is not xagg's"),
    "metrics": (parse_str, "HOST:PORT to serve Prometheus metrics on (GET /metrics); off when unset"),
    "xdp_meta": (parse_bool, "iface's driver supports XDP metadata (bpf_xdp_adjust_meta); "
                             "false: unicast fan-out is refused"),
}


@dataclass
class Config:
    name: str = "xaggd"
    iface: str | None = None
    netns: str | None = None
    port: int = C.XAGG_PORT
    memory: int = DEFAULT_MEMORY
    max_slots: int | None = None          # resolved: memory // slot_bytes unless given
    max_jobs: int = C.XAGG_MAX_JOBS
    max_workers: int = C.XAGG_MAX_WORKERS
    vals: int = 0                         # resolved: what the interface MTU takes
    mode: str = "auto"
    lock: str = "auto"                    # resolved when the program is built (backends.slot_lock)
    control: str | None = None            # resolved: RUN_DIR/NAME.sock
    listen: str | None = None
    token_file: str | None = None
    client_token_file: str | None = None
    max_connections: int = 64
    userspace: bool = False
    bind: str = "0.0.0.0"
    run_dir: str = field(default_factory=default_run_dir)
    log_level: str = "info"
    replace_foreign: bool = False
    metrics: str | None = None            # HOST:PORT of the Prometheus endpoint
    xdp_meta: bool = True                 # false: the driver cannot hand results to tc
    sources: dict = field(default_factory=dict, repr=False, compare=False)

    # -- derived ----------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.vals)     # derived from bpf/xagg_maps.h, no bcc needed

    @property
    def pid_file(self) -> str:
        return os.path.join(self.run_dir, f"{self.name}.pid")

    @property
    def memory_bytes(self) -> int:
        return self.max_slots * self.slot_bytes

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def listen_addr(self) -> tuple[str, int] | None:
        return parse_hostport(self.listen) if self.listen else None

    def read_token(self) -> str:
        return read_token_file(self.token_file, "token_file")

    def read_client_token(self) -> str | None:
        if not self.client_token_file:
            return None
        token = read_token_file(self.client_token_file, "client_token_file")
        if self.token_file and token == self.read_token():
            raise ConfigError(f"config: client_token_file={self.client_token_file!r} holds the same token as "
                              "token_file: the client token must differ from the admin token")
        return token

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("sources")
        return d

    def _auto_vals(self, for_start: bool) -> int:
        """Values per packet from the interface's MTU (one frame per packet);
        the compiled-in default for the userspace aggregator, for
        configurations only being shown, and for an interface that cannot be
        read (starting then fails on it, with the reason)."""
        if for_start and not self.userspace and self.iface:
            from xaggd.dataplane.attach import link_mtu
            try:
                return max_vals(min(link_mtu(self.iface, self.netns), JUMBO_MTU))
            except Exception:  # noqa: BLE001 - reported by the data plane's start
                pass
        return C.XAGG_VALS

    # -- building ---------------------------------------------------------
    @classmethod
    def resolve(cls, flags: dict | None = None, env: dict | None = None,
                file: str | None = None, *, for_start: bool = True) -> "Config":
        """Merge defaults < file < env < flags, parse and validate.

        ``flags`` holds only what the user gave (None = not given).
        ``file`` defaults to ``XAGGD_CONFIG`` from ``env``.
        """
        env = os.environ if env is None else env
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        layers = []                                  # lowest precedence first
        file = file or env.get(ENV_PREFIX + "CONFIG") or None
        if file:
            layers.append(("file", _read_toml(file)))
        env_vals = {k[len(ENV_PREFIX):].lower(): v for k, v in env.items()
                    if k.startswith(ENV_PREFIX) and k != ENV_PREFIX + "CONFIG"}
        unknown = [k for k in env_vals if k not in FIELDS]
        if unknown:
            k = unknown[0]
            raise ConfigError(f"config: unknown environment variable {ENV_PREFIX}{k.upper()}"
                              f"{_suggest(k)} (known: {', '.join(ENV_PREFIX + n.upper() for n in FIELDS)})")
        layers.append(("env", env_vals))
        layers.append(("flag", flags))

        cfg = cls()
        rank = {}
        for rank_i, (kind, values) in enumerate(layers):
            for name, raw in values.items():
                label = {"file": f"{file}: {name}", "env": f"env {ENV_PREFIX}{name.upper()}",
                         "flag": f"--{name.replace('_', '-')}"}[kind]
                parser = FIELDS[name][0]
                try:
                    value = parser(raw)
                except ValueError as e:
                    raise ConfigError(f"config: {name}={raw!r} (from {label}): {e}") from None
                setattr(cfg, name, value)
                cfg.sources[name] = label
                rank.setdefault(name, []).append(rank_i)
        # memory and max_slots say the same thing: the higher layer wins
        if "memory" in rank and "max_slots" in rank:
            m, s = rank["memory"][-1], rank["max_slots"][-1]
            if m == s:
                raise ConfigError(f"config: memory (from {cfg.source('memory')}) and max_slots "
                                  f"(from {cfg.source('max_slots')}) both size the slot pool; give one")
            if m > s:
                cfg.max_slots = None
        cfg.validate(for_start=for_start)
        return cfg

    def validate(self, for_start: bool = True) -> "Config":
        def need(ok, name, why):
            if not ok:
                raise ConfigError(f"config: {name}={getattr(self, name)!r} (from {self.source(name)}): {why}")
        need(_NAME_RE.match(self.name or ""), "name", "letters, digits, '.', '_' or '-', at most 64")
        need(0 <= self.port < 65536 and (self.port or self.userspace), "port",
             "must be a UDP port, 1..65535 (0, any free port, only with userspace)")
        # the interface's own MTU is checked when the program loads
        need(0 <= self.vals <= MAX_VALS, "vals",
             f"must be 1..{MAX_VALS} (a packet must fit the interface's MTU; "
             f"{max_vals()} fit 1500 bytes), or 0 for what the MTU takes")
        if self.vals == 0:
            self.vals = self._auto_vals(for_start)
        need(1 <= self.max_jobs <= 4096, "max_jobs", "must be 1..4096")
        need(1 <= self.max_workers <= 64, "max_workers", "must be 1..64 (the worker bitmap is 64 bits)")
        need(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}")
        need(self.lock in LOCKS, "lock", f"must be one of {', '.join(LOCKS)}")
        need(1 <= self.max_connections <= 4096, "max_connections", "must be 1..4096")
        need(self.log_level.lower() in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        if self.max_slots is None:
            need(self.memory >= 2 * self.slot_bytes, "memory",
                 f"must hold at least 2 slots of {self.slot_bytes} bytes")
            self.max_slots = self.memory // self.slot_bytes
            need(self.max_slots <= 1 << 26, "memory",
                 f"gives {self.max_slots} slots; at most {1 << 26} ({format_size((1 << 26) * self.slot_bytes)})")
        else:
            need(2 <= self.max_slots <= 1 << 26, "max_slots", f"must be 2..{1 << 26}")
            self.memory = self.max_slots * self.slot_bytes
        if self.control is None:
            self.control = os.path.join(self.run_dir, f"{self.name}.sock")
        need(os.path.isabs(self.control), "control", "must be an absolute path")
        need(os.path.isabs(self.run_dir), "run_dir", "must be an absolute path")
        need(len(self.control.encode()) < 108, "control", "a Unix socket path must be under 108 bytes")
        try:
            ipaddress.IPv4Address(self.bind)
        except ValueError:
            need(False, "bind", "must be an IPv4 address")
        for name in ("listen", "metrics"):
            if getattr(self, name):
                try:
                    parse_hostport(getattr(self, name))
                except ValueError as e:
                    need(False, name, str(e))
        if not for_start:
            return self
        if not self.userspace:
            need(bool(self.iface), "iface", "required: the interface to attach to "
                 "(--iface eth0), or run the userspace aggregator (--userspace)")
        if self.listen:
            need(bool(self.token_file), "listen", "remote control needs a shared token: "
                 "add --token-file FILE (no token, no access)")
        if self.client_token_file:
            need(bool(self.token_file), "client_token_file", "needs token_file too: the admin token")
        if self.token_file:
            self.read_token()
            self.read_client_token()
        return self


def read_token_file(path: str, what: str = "token_file") -> str:
    try:
        st = os.stat(path)
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"config: {what}={path!r}: cannot read it: {e.strerror}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"config: {what}={path!r}: the token has {len(token)} characters; use at "
                          f"least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32 > {path}`)")
    if st.st_mode & stat.S_IROTH:
        import logging
        logging.getLogger("xaggd").warning("%s is readable by everyone: `chmod 600 %s`", path, path)
    return token


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, list(FIELDS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _read_toml(path: str) -> dict:
    if tomllib is None:  # pragma: no cover
        raise ConfigError("config: reading a TOML file needs Python 3.11+ (tomllib)")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
    # an optional [xaggd] table, for files shared with other tools
    if set(data) == {"xaggd"} and isinstance(data["xaggd"], dict):
        data = data["xaggd"]
    for k, v in data.items():
        if k not in FIELDS:
            raise ConfigError(f"config: {path}: unknown field {k!r}{_suggest(k)} "
                              f"(known: {', '.join(FIELDS)})")
        if isinstance(v, dict):
            raise ConfigError(f"config: {path}: {k} must be a value, not a table")
    return data
