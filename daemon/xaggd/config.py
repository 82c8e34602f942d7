"""xaggd's configuration: one dataclass, four layers.

Precedence, highest first: command-line flags > environment (``XAGGD_*``) >
the TOML file (``--config FILE`` or ``XAGGD_CONFIG``) > defaults. The
settings, their parsers and checks are the table in settings.py; here they
are merged, parsed and checked, so a bad value is reported once, naming the
field, where it came from and what it must be::

    config: memory='12Q' (from env XAGGD_MEMORY): expected a size like 256M, 1G or 1048576
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = None

from xagg.wire.proto import JUMBO_MTU, C, max_vals, slot_bytes
from xaggd.settings import BY_NAME, ENV_PREFIX, MAX_SLOTS, SETTINGS, format_size, parse_hostport

MIN_TOKEN_CHARS = 16
NETNS_DIR = "/run/netns"        # where `ip netns` keeps named namespaces


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field."""


def who(name: str) -> str:
    """How messages name an instance: "xaggd", or "xaggd a0" for --name a0."""
    return "xaggd" if name == "xaggd" else f"xaggd {name}"


def _settings_as_fields(cls):
    """One dataclass field per row of settings.SETTINGS, ahead of the class's own."""
    cls.__annotations__ = {**{s.name: s.annotation for s in SETTINGS}, **cls.__dict__.get("__annotations__", {})}
    for s in SETTINGS:
        setattr(cls, s.name, field(default_factory=s.default) if callable(s.default) else s.default)
    return cls


@dataclass
@_settings_as_fields
class Config:
    """The settings' values; ``max_slots``, ``vals`` and ``control`` are
    resolved by ``validate`` where not given (from memory, the interface's
    MTU and the run dir)."""
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

    def tls_context(self):
        """The server side of TLS for --listen (an ssl.SSLContext), or None
        without tls_cert; ConfigError naming the file that does not load."""
        if not self.tls_cert:
            return None
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except ssl.SSLError as e:
            name = "tls_key" if self.tls_key else "tls_cert"
            raise self._error(name, f"not a PEM certificate and the private key that matches it "
                                    f"({e.reason or e})") from None
        except OSError as e:
            name = "tls_key" if self.tls_key and e.filename == self.tls_key else "tls_cert"
            raise self._error(name, f"cannot read it: {e.strerror}") from None
        return ctx

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("sources")
        return d

    def _auto_vals(self, for_start: bool) -> int:
        """Values per packet from the interface's MTU (one frame per packet);
        the compiled-in default for the userspace aggregator, for
        configurations only being shown, and for an interface that cannot be
        read (starting then fails on it, with the reason)."""
        # a namespace that is not there is not looked into: opening it would create it
        if for_start and not self.userspace and self.iface and netns_exists(self.netns):
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
        unknown = [k for k in env_vals if k not in BY_NAME]
        if unknown:
            k = unknown[0]
            raise ConfigError(f"config: unknown environment variable {ENV_PREFIX}{k.upper()}"
                              f"{_suggest(k)} (known: {', '.join(s.env for s in SETTINGS)})")
        layers.append(("env", env_vals))
        layers.append(("flag", flags))

        cfg = cls()
        rank = {}
        for rank_i, (kind, values) in enumerate(layers):
            for name, raw in values.items():
                setting = BY_NAME[name]
                label = {"file": f"{file}: {name}", "env": f"env {setting.env}", "flag": setting.flag}[kind]
                try:
                    value = setting.parse(raw)
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

    def _error(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"config: {name}={getattr(self, name)!r} (from {self.source(name)}): {why}")

    def _check(self, name: str) -> None:
        why = BY_NAME[name].problem(getattr(self, name), self)
        if why:
            raise self._error(name, why)

    def validate(self, for_start: bool = True) -> "Config":
        """Each setting's own check (settings.py), then the rules between them."""
        if self.vals == 0:
            self.vals = self._auto_vals(for_start)
        for s in SETTINGS:
            self._check(s.name)
        if self.control is None:            # from name and run_dir, now checked
            self.control = os.path.join(self.run_dir, f"{self.name}.sock")
            self._check("control")
        if self.state_dir is None:
            self.state_dir = self.run_dir
        self._size_slot_pool()
        if not for_start:
            return self

        def need(ok, name, why):
            if not ok:
                raise self._error(name, why)
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
        if self.tls_key:
            need(bool(self.tls_cert), "tls_key", "needs tls_cert: the certificate the key belongs to")
        if self.tls_cert:
            need(bool(self.listen), "tls_cert", "serves TCP control over TLS: give --listen HOST:PORT too")
            self.tls_context()
        return self

    def _size_slot_pool(self) -> None:
        """memory and max_slots, one from the other: slots of ``slot_bytes``."""
        if self.max_slots is not None:
            self.memory = self.max_slots * self.slot_bytes
            return
        if self.memory < 2 * self.slot_bytes:
            raise self._error("memory", f"must hold at least 2 slots of {self.slot_bytes} bytes")
        self.max_slots = self.memory // self.slot_bytes
        if self.max_slots > MAX_SLOTS:
            raise self._error("memory", f"gives {self.max_slots} slots; at most {MAX_SLOTS} "
                                        f"({format_size(MAX_SLOTS * self.slot_bytes)})")


def netns_exists(name: str | None) -> bool:
    """Whether network namespace ``name`` is there (`ip netns`); None: ours."""
    return name is None or os.path.exists(os.path.join(NETNS_DIR, name))


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
        logging.getLogger("xaggd").warning("%s is readable by everyone: `chmod 600 %s`", path, path)
    return token


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, list(BY_NAME), n=1)
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
        if k not in BY_NAME:
            raise ConfigError(f"config: {path}: unknown field {k!r}{_suggest(k)} "
                              f"(known: {', '.join(BY_NAME)})")
        if isinstance(v, dict):
            raise ConfigError(f"config: {path}: {k} must be a value, not a table")
    return data
