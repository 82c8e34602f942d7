"""The daemon process: one data plane, its jobs, its control sockets.

Shaped like uvicorn's Server: ``run()`` = startup, a main loop that watches
a flag, shutdown in ``finally``. Signal handlers only set flags; the main
loop notices and returns, and ``finally`` detaches the program, so SIGTERM,
SIGINT and errors all leave the interface clean. (SIGKILL cannot: the next
start replaces the program a killed daemon left behind.) SIGHUP re-reads
the configuration: the reloadable settings (settings.py) take effect,
anything else is reported as needing a restart. The main loop also checks
the data plane's health and the jobs' leases (lease.py).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat
import threading
import time

from xagg.wire.control import ControlClient, ControlError
from xaggd.auth import Credentials
from xaggd.backends import make_backend
from xaggd.config import Config, ConfigError, who
from xaggd.control_server import Dispatcher, TcpControlServer, UnixControlServer, answers
from xaggd.jobs import JobTable
from xaggd.lease import check_every
from xaggd.metrics import MetricsServer
from xaggd.persist import JobStore
from xaggd.sdnotify import notify
from xaggd.settings import SETTINGS, format_size, parse_hostport

log = logging.getLogger("xaggd")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RELOAD_SIGNAL = signal.SIGHUP
RELOADABLE = tuple(s.name for s in SETTINGS if s.reloadable)
HEALTH_EVERY_S = 5.0


class AlreadyRunning(RuntimeError):
    pass


# -- the run dir and pid files --------------------------------------------------
def secure_run_dir(path: str, setting: str = "run_dir") -> None:
    """Create ``path`` (0755 for root, whose sockets are 0600; 0700 otherwise),
    or check that the one there is a real directory owned by us (or root)
    that nobody else can write to: pid files, sockets and saved jobs are
    trusted from it."""
    try:
        os.makedirs(path, mode=0o755 if os.geteuid() == 0 else 0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"config: {setting}={path!r}: cannot create it: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"config: {setting}={path!r} is a symbolic link; give a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"config: {setting}={path!r} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(f"config: {setting}={path!r} is owned by uid {st.st_uid}, not by this user "
                          f"(uid {os.geteuid()}) or root: someone else could plant files there; "
                          f"remove it or give another --{setting.replace('_', '-')}")
    if st.st_mode & 0o022:
        raise ConfigError(f"config: {setting}={path!r} is writable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): `chmod go-w {path}` or give another "
                          f"--{setting.replace('_', '-')}")


# -- pid files ----------------------------------------------------------------
class PidFile:
    """RUN_DIR/NAME.pid, holding our pid and an exclusive flock for as long
    as we live: the lock, not the pid, says whether the daemon runs (a pid
    can be reused; a lock dies with its process)."""

    def __init__(self, path: str, name: str):
        self.path = path
        self.name = name
        self.fd = None

    def acquire(self) -> None:
        try:                            # never through a link someone planted
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(e.errno, f"pid file {self.path} is a symbolic link: refusing to follow "
                                       "it; remove it") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"pid file {self.path} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunning(f"{who(self.name)} is already running (pid {read_pid(self.path)}); "
                                     f"`xaggd stop --name {self.name}` stops it, or start this one "
                                     "with another --name") from None
            raise
        old = os.read(fd, 64).decode(errors="replace").strip()
        if old and old != str(os.getpid()):
            log.warning("stale pid file %s (pid %s is not running xaggd): taking it over", self.path, old)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)        # while still locked: nobody sees a half-dead file
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def pid_status(path: str) -> tuple[int | None, bool]:
    """(pid in the file, whether a daemon holds it). A file nobody holds is stale."""
    pid = read_pid(path)
    if pid is None and not os.path.exists(path):
        return None, False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return pid, False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return pid, False
    except OSError:
        return pid, True
    finally:
        os.close(fd)


def live_instances(run_dir: str, exclude: str | None = None):
    """(name, pid) of every running xaggd with a pid file in ``run_dir``."""
    try:
        names = sorted(f[:-4] for f in os.listdir(run_dir) if f.endswith(".pid"))
    except OSError:
        return
    for name in names:
        if name == exclude:
            continue
        pid, alive = pid_status(os.path.join(run_dir, f"{name}.pid"))
        if alive:
            yield name, pid


def owner_of(cfg: Config, prog_id: int) -> str | None:
    """Which running sibling daemon attached XDP program ``prog_id``, if any."""
    for name, pid in live_instances(cfg.run_dir, exclude=cfg.name):
        try:
            with ControlClient(os.path.join(cfg.run_dir, f"{name}.sock"), timeout=2.0) as c:
                if c.status().get("prog_id") == prog_id:
                    return f"{who(name)} (pid {pid})"
        except ControlError:
            continue
    return None


# -- the server -----------------------------------------------------------------
class Server:
    def __init__(self, config: Config, reload=None):
        self.config = config
        self.reload_config = reload          # () -> Config: the layers read again (SIGHUP)
        self.should_exit = False
        self.force_exit = False
        self.should_reload = False
        self.started = threading.Event()     # startup finished (for in-process use)
        self.backend = None
        self.jobs: JobTable | None = None
        self.controls = []
        self.started_at = None
        self._t0 = None
        self._health_msg = None
        self.listen_bound = None             # HOST:PORT actually bound (port 0 = any)
        self.metrics = None                  # MetricsServer, with --metrics

    # -- lifecycle -------------------------------------------------------------
    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or ``stop()``). Raises on startup failure."""
        self.install_signal_handlers()
        secure_run_dir(self.config.run_dir)
        if self.config.state_dir != self.config.run_dir:
            secure_run_dir(self.config.state_dir, "state_dir")
        pid = PidFile(self.config.pid_file, self.config.name)
        pid.acquire()
        try:
            self.startup()
            self.started.set()
            notify("READY=1")            # Type=notify: started only now, program attached
            self.main_loop()
        finally:
            notify("STOPPING=1")
            self.shutdown()
            pid.release()
            self.started.set()
            log.info("%s stopped", who(self.config.name))

    def install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return                           # in-process (tests): stop() instead
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self.handle_exit)
        signal.signal(RELOAD_SIGNAL, self.handle_reload)

    def handle_reload(self, sig, frame) -> None:
        self.should_reload = True

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    def stop(self) -> None:
        self.should_exit = True

    def startup(self) -> None:
        cfg = self.config
        self._t0, self.started_at = time.monotonic(), time.time()
        log.info("%s starting (pid %d): %s", who(cfg.name), os.getpid(),
                 "userspace aggregator (no XDP)" if cfg.userspace else
                 f"XDP on {cfg.iface}" + (f" in netns {cfg.netns}" if cfg.netns else ""))
        if os.path.exists(cfg.control) and answers(cfg.control):
            raise OSError(errno.EADDRINUSE, f"control socket {cfg.control} is in use by another running "
                                            "xaggd; give this one another --name or --control")
        self.backend = make_backend(cfg, owner_of=lambda prog_id: owner_of(cfg, prog_id))
        self.backend.start()
        store = JobStore(os.path.join(cfg.state_dir, f"{cfg.name}.jobs.json"))
        self.jobs = JobTable(self.backend, max_slots=cfg.max_slots, max_jobs=cfg.max_jobs,
                             max_workers=cfg.max_workers, vals=cfg.vals, slot_bytes=cfg.slot_bytes,
                             on_change=store.save)
        saved = store.load()
        if saved:                   # before the control sockets: no request races the restore
            self.jobs.restore(saved)
        dispatcher = Dispatcher(self)
        where = [cfg.control]
        if cfg.listen:
            addr = cfg.listen_addr()
            try:
                tcp = TcpControlServer(addr, self.credentials(cfg), dispatcher,
                                       max_connections=cfg.max_connections, tls=cfg.tls_context())
            except OSError as e:
                raise OSError(e.errno, f"listen: cannot bind TCP {addr[0]}:{addr[1]}: {e.strerror}") from None
            self.controls.append(tcp)
            tcp.serve_in_thread("xaggd-control-tcp")
            self.listen_bound = f"{addr[0]}:{tcp.server_address[1]}"
            where.append(f"tcp {self.listen_bound} ({'TLS, ' if cfg.tls_cert else ''}admin token"
                         + (", client token)" if cfg.client_token_file else ")"))
            if not cfg.tls_cert:
                log.warning("TCP control on %s is not encrypted: tokens and cookies cross the network in "
                            "clear; --tls-cert FILE serves it over TLS", self.listen_bound)
        if cfg.metrics:
            addr = parse_hostport(cfg.metrics)
            try:
                self.metrics = MetricsServer(addr, self)
            except OSError as e:
                raise OSError(e.errno, f"metrics: cannot bind TCP {addr[0]}:{addr[1]}: {e.strerror}") from None
            where.append(f"metrics http://{self.metrics.bound}/metrics")
        unix = UnixControlServer(cfg.control, dispatcher)     # last: when it answers, all is up
        self.controls.append(unix)
        unix.serve_in_thread("xaggd-control-unix")
        d = self.backend.describe()
        plane = (f"userspace aggregator on UDP {cfg.bind}:{d['port']}" if cfg.userspace else
                 f"XDP on {cfg.iface} ({d['mode']} mode, slot lock {d['slot_lock']}), UDP port {d['port']}")
        log.info("%s ready: %s; %s for %d slots, %d jobs; control: %s", who(cfg.name), plane,
                 format_size(cfg.memory_bytes), cfg.max_slots, cfg.max_jobs, ", ".join(where))

    def main_loop(self) -> None:
        next_health, next_lease = time.monotonic() + HEALTH_EVERY_S, time.monotonic()
        while not self.should_exit:
            time.sleep(0.1)
            if self.should_reload:
                self.should_reload = False
                self.reload()
            if time.monotonic() >= next_health:
                next_health = time.monotonic() + HEALTH_EVERY_S
                self.check_health()
            every = check_every(self.config.job_lease)
            if every is not None and time.monotonic() >= next_lease:
                next_lease = time.monotonic() + every
                self.check_leases()
        log.info("shutting down (%s)", "forced" if self.force_exit else "signal or stop request")

    def check_health(self) -> str | None:
        """The data plane's problem now (logged when it changes), or None."""
        try:
            msg = self.backend.health()
        except Exception as e:  # noqa: BLE001
            msg = f"health check failed: {e}"
        if msg and msg != self._health_msg:
            log.error("%s", msg)
        elif not msg and self._health_msg:
            log.info("healthy again")
        self._health_msg = msg
        return msg

    def check_leases(self, now: float | None = None) -> list:
        """Remove the jobs whose lease ran out at ``now`` (default: the job
        table's clock); the jobs removed."""
        try:
            return self.jobs.expire(self.config.job_lease, now)
        except Exception as e:  # noqa: BLE001 - a counter read failed: keep serving, try next time
            log.error("lease check failed: %s", e)
            return []

    @property
    def health_message(self) -> str | None:
        """The data plane's problem as the last health check saw it."""
        return self._health_msg

    @staticmethod
    def credentials(cfg: Config) -> Credentials:
        return Credentials(cfg.read_token(), cfg.read_client_token())

    def reload(self) -> None:
        """SIGHUP: read the configuration again; apply what can change live."""
        log.info("SIGHUP: reading the configuration again")
        if self.reload_config is None:
            log.warning("SIGHUP: this daemon was started without its configuration layers; nothing reloaded")
            return
        try:
            new = self.reload_config()
            creds = self.credentials(new) if new.listen and new.token_file else None
        except (ConfigError, OSError) as e:
            log.error("SIGHUP: keeping the running configuration: %s", e)
            return
        old = self.config
        for name in RELOADABLE:
            setattr(old, name, getattr(new, name))
        logging.getLogger().setLevel(getattr(logging, old.log_level.upper(), logging.INFO))
        for c in self.controls:
            if isinstance(c, TcpControlServer) and creds is not None:
                c.set_credentials(creds)
        fixed = sorted(k for k, v in new.as_dict().items()
                       if k not in RELOADABLE and v != getattr(old, k))
        if fixed:
            log.warning("SIGHUP: %s changed; that takes a restart (`xaggd stop`, then start)", ", ".join(fixed))
        log.info("SIGHUP: log level %s; tokens re-read", old.log_level)

    def shutdown(self) -> None:
        for c in self.controls:          # no new requests while we take things down
            try:
                c.close_all()
            except Exception as e:  # noqa: BLE001
                log.warning("closing control socket: %s", e)
        self.controls = []
        if self.metrics is not None:
            try:
                self.metrics.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the metrics endpoint: %s", e)
            self.metrics = None
        if self.backend is not None:
            try:
                self.backend.close()       # detach: the one thing that must happen
            except Exception as e:  # noqa: BLE001
                log.error("detaching failed: %s", e)
            self.backend = None

    # -- what the control API reports -------------------------------------------
    def uptime(self) -> float:
        return time.monotonic() - self._t0 if self._t0 else 0.0

    def status(self) -> dict:
        cfg = self.config
        jobs = self.jobs.list()
        idle = self.jobs.idle_report({j["job_id"]: j["idle_s"] for j in jobs})
        return {"name": cfg.name, "pid": os.getpid(), **self.backend.describe(),
                "vals": cfg.vals, "max_workers": cfg.max_workers,
                "uptime_s": round(self.uptime(), 3), "started_at": self.started_at,
                "control": cfg.control, "listen": self.listen_bound, "tls": bool(cfg.tls_cert),
                "health": self._health_msg, "lease_s": cfg.job_lease, "idle": idle,
                "metrics": self.metrics.bound if self.metrics else None,
                "memory": self.jobs.memory(),
                "jobs": [{k: j[k] for k in ("job_id", "job_index", "n_workers", "max_elements",
                                            "n_chunks", "slot_base", "n_slots", "fanout", "idle_s")}
                         for j in jobs]}

    def stats(self, job_id: int | None = None) -> dict:
        counters = self.backend.counters()
        per_pkt = self.config.vals * 4
        xagg_pkts = sum(v for k, v in counters.items() if k != "passed")
        return {"time": time.monotonic(), "uptime_s": round(self.uptime(), 3),
                "backend": self.backend.kind, "vals": self.config.vals,
                "counters": counters, "packets": xagg_pkts,
                "bytes_aggregated": (counters.get("aggregated", 0) + counters.get("completed", 0)) * per_pkt,
                "jobs": self.jobs.stats(job_id)}
