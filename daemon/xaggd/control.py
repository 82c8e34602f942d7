"""The control API: newline-delimited JSON over a Unix socket (local, root
only) or TCP (remote, shared token on every request).

One request per line, one response per line, in order::

    {"op": "register", "job_id": 7, "cookie": 99, "workers": ["10.0.0.1", "10.0.0.2"],
     "max_elements": 25000000}
    -> {"ok": true, "created": true, "job": {...}, "memory": {...}, "port": 9977, "vals": 256}
    {"op": "remove", "job_id": 8}
    -> {"ok": false, "error": "job_id: no job 8 on this aggregator (registered: 7)"}

Ops and their fields (* = required):

    register  *job_id, *cookie (u32), *max_elements (largest gradient, elements),
              workers (one IPv4 per worker id, "" = any source) or n_workers,
              fanout ("bcast" | "unicast", default bcast), bcast_ip, result_port,
              aggregators ([{"addr": "HOST:PORT", "weight": W}], default: this one alone),
              agg_index (which of them this daemon is, default 0), vals (must match),
              replace (true: re-register with other parameters)
              -> created, job, memory, port, vals
    resize    *job_id, max_elements, aggregators, agg_index -> job, memory
    reset     *job_id -> job                 (new generation: partial sums and stats cleared)
    remove    *job_id -> job_id, freed_slots, freed_bytes, memory
    list      -> jobs, memory
    stats     job_id -> time, uptime_s, backend, vals, counters {verdict: packets},
              packets, bytes_aggregated, jobs {"ID": {aggregated, completed, retransmits,
              dropped, bytes_aggregated}}
    status    -> name, pid, backend, iface, netns, mode, attached, port, prog_id, vals,
              max_workers, uptime_s, started_at, control, listen, health, memory, jobs

``job``: job_id, job_index, the register fields, n_workers, n_chunks (this
aggregator's share, xagg.plan.capacity), slot_base, n_slots (2 per chunk),
memory_bytes, registered_at, resets. ``memory``: max_slots, used_slots,
free_slots, largest_free_slots, slot_bytes, memory_bytes, free_bytes,
max_jobs, jobs.

Every request may carry ``"id"`` (echoed back). Unknown fields are errors.
Errors start with the field they are about ("workers[1]: not an IPv4
address: ..."). Over TCP every request must carry ``"token"``; a request
that fails to authenticate (or is not JSON) gets its error and the
connection is closed.

``ControlClient`` is the Python side, used by the torch client and the lab.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time

from .jobs import REGISTER_FIELDS, RESIZE_FIELDS, RequestError

log = logging.getLogger("xaggd.control")

MAX_LINE = 1 << 20
DEFAULT_CONTROL = "/run/xaggd/xaggd.sock"

# op -> (required fields, optional fields); "op", "id" and "token" are always allowed
OPS = {
    "register": ({"job_id", "cookie", "max_elements"}, REGISTER_FIELDS),
    "resize": ({"job_id"}, RESIZE_FIELDS),
    "reset": ({"job_id"}, {"job_id"}),
    "remove": ({"job_id"}, {"job_id"}),
    "list": (set(), set()),
    "stats": (set(), {"job_id"}),
    "status": (set(), set()),
}
_ALWAYS = {"op", "id", "token"}


class ControlError(RuntimeError):
    """The daemon refused a request (``.response`` holds its answer), or
    could not be reached."""

    def __init__(self, message: str, response: dict | None = None):
        super().__init__(message)
        self.response = response or {}


class DaemonUnavailable(ControlError):
    """Nothing answers at the control address."""


# -- server side ------------------------------------------------------------
class Dispatcher:
    """Turns one request line into one response; knows nothing about sockets."""

    def __init__(self, daemon):
        self.daemon = daemon          # server.Server: .jobs, .backend, status()/stats()

    def handle_line(self, line: bytes, token: str | None, peer: str) -> tuple[dict, bool]:
        """(response, close_connection)."""
        rid = None
        op = None
        try:
            try:
                req = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                # over TCP nothing unauthenticated is worth keeping open
                return self._err(f"request: not valid JSON ({e}); send one JSON object per line",
                                 None), token is not None
            if not isinstance(req, dict):
                return self._err(f"request: must be a JSON object, got {type(req).__name__}",
                                 None), token is not None
            rid = req.get("id")
            if token is not None:
                given = req.get("token")
                if not isinstance(given, str) or not given:
                    log.warning("control: request without a token from %s refused", peer)
                    return self._err("token: required: every request over TCP must carry the shared token",
                                     rid), True
                if not hmac.compare_digest(given.encode(), token.encode()):
                    log.warning("control: wrong token from %s refused", peer)
                    return self._err("token: wrong token", rid), True
            op = req.get("op")
            if op is None:
                raise RequestError(f"op: missing; one of {', '.join(OPS)}")
            if op not in OPS:
                raise RequestError(f"op: unknown op {op!r}; one of {', '.join(OPS)}")
            required, allowed = OPS[op]
            for f in sorted(required):
                if f not in req:
                    raise RequestError(f"{f}: missing (required by {op})")
            extra = sorted(set(req) - allowed - _ALWAYS)
            if extra:
                raise RequestError(f"{extra[0]}: unknown field for {op} (known: "
                                   f"{', '.join(sorted(allowed)) or 'none'})")
            resp = getattr(self, f"op_{op}")(req)
            resp = {"ok": True, **resp}
        except RequestError as e:
            return self._err(str(e), rid), False
        except Exception as e:  # noqa: BLE001 - a bug or a kernel error: say it, keep serving
            log.exception("control: op %r from %s failed", op, peer)   # never log the line: token
            return self._err(f"internal error: {type(e).__name__}: {e}", rid), False
        if rid is not None:
            resp["id"] = rid
        return resp, False

    @staticmethod
    def _err(msg: str, rid) -> dict:
        r = {"ok": False, "error": msg}
        if rid is not None:
            r["id"] = rid
        return r

    def _job_id(self, req) -> int:
        v = req.get("job_id")
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
            raise RequestError(f"job_id: must be an unsigned 32-bit integer, got {v!r}")
        return v

    # -- ops ----------------------------------------------------------------
    def op_register(self, req):
        d = self.daemon
        job, created = d.jobs.register(req)
        return {"created": created, "job": job.describe(d.jobs.slot_bytes), "memory": d.jobs.memory(),
                "port": d.backend.describe()["port"], "vals": d.config.vals}

    def op_resize(self, req):
        d = self.daemon
        job = d.jobs.resize(req)
        return {"job": job.describe(d.jobs.slot_bytes), "memory": d.jobs.memory()}

    def op_reset(self, req):
        d = self.daemon
        return {"job": d.jobs.reset(self._job_id(req)).describe(d.jobs.slot_bytes)}

    def op_remove(self, req):
        d = self.daemon
        job = d.jobs.remove(self._job_id(req))
        return {"job_id": job.job_id, "freed_slots": job.n_slots,
                "freed_bytes": job.n_slots * d.jobs.slot_bytes, "memory": d.jobs.memory()}

    def op_list(self, req):
        return {"jobs": self.daemon.jobs.list(), "memory": self.daemon.jobs.memory()}

    def op_stats(self, req):
        job_id = self._job_id(req) if req.get("job_id") is not None else None
        return self.daemon.stats(job_id)

    def op_status(self, req):
        return self.daemon.status()


class _Handler(socketserver.StreamRequestHandler):
    timeout = 3600          # an idle control connection is closed after an hour

    def handle(self):
        srv = self.server
        srv.track(self.connection, True)
        try:
            peer = srv.peer_name(self.connection, self.client_address)
            if not srv.authorised(self.connection, peer):
                self._send({"ok": False, "error": "permission denied: the control socket is for root "
                                                  "and the daemon's own user"})
                return
            while not srv.closing:
                line = self.rfile.readline(MAX_LINE + 1)
                if not line:
                    return
                if len(line) > MAX_LINE:
                    self._send({"ok": False, "error": f"request: longer than {MAX_LINE} bytes"})
                    return
                if not line.strip():
                    continue
                resp, close = srv.dispatcher.handle_line(line, srv.token, peer)
                self._send(resp)
                if close:
                    return
        except OSError:
            return
        finally:
            srv.track(self.connection, False)

    def _send(self, resp: dict) -> None:
        self.wfile.write(json.dumps(resp, default=str).encode() + b"\n")


class _Common:
    daemon_threads = True
    allow_reuse_address = True
    token = None
    closing = False

    def setup_common(self, dispatcher):
        self.dispatcher = dispatcher
        self._conns = set()
        self._conns_lock = threading.Lock()

    def track(self, conn, add):
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def close_all(self):
        self.closing = True
        self.shutdown()
        self.server_close()
        with self._conns_lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve_in_thread(self, name):
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, name=name,
                             daemon=True)
        t.start()
        return t


class UnixControlServer(_Common, socketserver.ThreadingUnixStreamServer):
    """Local control: a 0600 socket, and the peer must be root or our own user."""

    def __init__(self, path: str, dispatcher):
        self.path = path
        self.setup_common(dispatcher)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if os.path.exists(path):
            if _answers(path):
                raise OSError(f"control socket {path} is in use by another running xaggd; "
                              "give this one another --name or --control")
            os.unlink(path)               # left by a crashed daemon
        old = os.umask(0o177)             # created 0600: no window where others can connect
        try:
            super().__init__(path, _Handler)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)

    def peer_name(self, conn, addr):
        pid, uid, _ = self._cred(conn)
        return f"unix pid {pid} uid {uid}"

    @staticmethod
    def _cred(conn):
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)

    def authorised(self, conn, peer):
        uid = self._cred(conn)[1]
        if uid in (0, os.geteuid()):
            return True
        log.warning("control: %s refused (not root)", peer)
        return False

    def close_all(self):
        super().close_all()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class TcpControlServer(_Common, socketserver.ThreadingTCPServer):
    """Remote control: every request carries the shared token."""

    def __init__(self, addr: tuple[str, int], token: str, dispatcher):
        if not token:
            raise ValueError("TCP control needs a token")
        self.token = token
        self.setup_common(dispatcher)
        super().__init__(addr, _Handler)

    def peer_name(self, conn, addr):
        return f"tcp {addr[0]}:{addr[1]}"

    def authorised(self, conn, peer):
        return True                        # per request, by token


def _answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


# -- client side ------------------------------------------------------------
def parse_address(address) -> tuple[int, object]:
    """(socket family, address) for a control address:
    "/run/xaggd/xaggd.sock", "unix:PATH", "HOST:PORT", "tcp:HOST:PORT", (host, port)."""
    if address is None:
        return socket.AF_UNIX, DEFAULT_CONTROL
    if isinstance(address, (tuple, list)):
        return socket.AF_INET, (str(address[0]), int(address[1]))
    s = str(address)
    if s.startswith("unix:"):
        return socket.AF_UNIX, s[5:]
    if s.startswith("tcp:"):
        s = s[4:]
    elif "/" in s:
        return socket.AF_UNIX, s
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"control address {address!r}: expected a socket path or HOST:PORT")
    return socket.AF_INET, (host.strip("[]") or "127.0.0.1", int(port))


class ControlClient:
    """Talk to one xaggd.

    >>> c = ControlClient("/run/xaggd/xaggd.sock")            # local, as root
    >>> c = ControlClient("10.77.0.101:9979", token=open("/etc/xagg/token").read())
    >>> c.register(7, cookie=99, max_elements=25_000_000, workers=["10.77.0.1", "10.77.0.2"],
    ...            aggregators=[{"addr": "10.77.0.101:9977", "weight": 2},
    ...                         {"addr": "10.77.0.102:9977", "weight": 1}], agg_index=0)

    Methods return the daemon's answer without ``ok``; a refusal raises
    ``ControlError`` with the daemon's message (it names the field), an
    unreachable daemon ``DaemonUnavailable``. One connection, reopened once
    if it broke; safe to share between threads.
    """

    def __init__(self, address=None, token: str | None = None, timeout: float = 30.0):
        self.family, self.address = parse_address(address)
        self.token = token.strip() if token else None
        self.timeout = timeout
        self._sock = None
        self._file = None
        self._lock = threading.Lock()

    def __repr__(self):
        return f"ControlClient({self.address!r})"

    # -- plumbing -------------------------------------------------------------
    def _connect(self):
        s = socket.socket(self.family, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.address)
        except OSError as e:
            s.close()
            raise DaemonUnavailable(f"cannot reach xaggd at {self._where()}: {e.strerror or e} "
                                    "(is it running? `xaggd status`)") from None
        self._sock, self._file = s, s.makefile("rb")

    def _where(self):
        return self.address if self.family == socket.AF_UNIX else "%s:%d" % self.address

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self):
        for x in (self._file, self._sock):
            if x is not None:
                try:
                    x.close()
                except OSError:
                    pass
        self._sock = self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def raw(self, req: dict) -> dict:
        """Send one request dict as is; the response dict as is."""
        if self.token is not None and "token" not in req:
            req = {**req, "token": self.token}
        data = json.dumps(req).encode() + b"\n"
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                if fresh:
                    self._connect()
                try:
                    self._sock.sendall(data)
                    line = self._file.readline(MAX_LINE + 1)
                    if not line:
                        raise ConnectionResetError("connection closed by xaggd")
                    resp = json.loads(line)
                    if not resp.get("ok", False) and str(resp.get("error", "")).startswith("token:"):
                        self._close()            # the daemon closes it too
                    return resp
                except (OSError, ValueError) as e:
                    self._close()
                    if fresh or attempt:
                        raise DaemonUnavailable(f"xaggd at {self._where()}: {e}") from None

    def request(self, op: str, **fields) -> dict:
        fields = {k: v for k, v in fields.items() if v is not None}
        resp = self.raw({"op": op, **fields})
        if not resp.get("ok"):
            raise ControlError(resp.get("error", f"xaggd refused {op}"), resp)
        resp.pop("ok")
        return resp

    # -- ops --------------------------------------------------------------------
    def register(self, job_id, *, cookie: int | None = None, max_elements: int | None = None,
                 workers=None, n_workers: int | None = None, fanout: str | None = None,
                 bcast_ip: str | None = None, result_port: int | None = None, aggregators=None,
                 agg_index: int | None = None, vals: int | None = None,
                 replace: bool | None = None) -> dict:
        """Install job ``job_id`` on this aggregator, sized for gradients of up
        to ``max_elements``; returns {"created", "job", "memory", "port", "vals"}.

        ``workers``: one IPv4 address per worker id ("" = any source), or
        give ``n_workers``. ``aggregators``: every aggregator of the job, as
        "HOST:PORT", (addr, weight) or {"addr", "weight"}; ``agg_index``:
        which one this daemon is. Registering the same parameters again is
        a no-op (created: false); other parameters need ``replace=True``.

        ``job_id`` may instead be a whole register request (a dict with
        these keys); keyword arguments given as well override its entries.
        """
        fields = dict(cookie=cookie, max_elements=max_elements, workers=workers, n_workers=n_workers,
                      fanout=fanout, bcast_ip=bcast_ip, result_port=result_port,
                      aggregators=aggregators, agg_index=agg_index, vals=vals, replace=replace)
        if isinstance(job_id, dict):
            req = {k: v for k, v in job_id.items() if k != "op"}
            req.update({k: v for k, v in fields.items() if v is not None})
        else:
            req = {"job_id": job_id, **fields}
        req["aggregators"] = _aggs(req.get("aggregators"))
        return self.request("register", **req)

    def resize(self, job_id: int, max_elements: int | None = None, *, aggregators=None,
               agg_index: int | None = None) -> dict:
        return self.request("resize", job_id=job_id, max_elements=max_elements,
                            aggregators=_aggs(aggregators), agg_index=agg_index)

    def reset(self, job_id: int) -> dict:
        return self.request("reset", job_id=job_id)["job"]

    def remove(self, job_id: int) -> dict:
        return self.request("remove", job_id=job_id)

    def list_jobs(self) -> list[dict]:
        return self.request("list")["jobs"]

    def stats(self, job_id: int | None = None) -> dict:
        return self.request("stats", job_id=job_id)

    def status(self) -> dict:
        return self.request("status")

    def wait_ready(self, timeout: float = 30.0, interval: float = 0.1) -> dict:
        """status(), retried while nothing answers yet (a daemon starting up)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.status()
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(interval)


def _aggs(aggregators):
    if aggregators is None:
        return None
    out = []
    for a in aggregators:
        if isinstance(a, dict):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.append({"addr": str(a[0]), "weight": a[1]} if len(a) == 2 else {"addr": str(a[0])})
        else:
            out.append({"addr": str(a), "weight": 1.0})
    return out
