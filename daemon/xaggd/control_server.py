"""The control API's servers: the protocol of xagg.wire.control over a Unix
socket (local, root or the daemon's own user: admin) or TCP (remote: the
connection's first line authenticates it, xaggd.auth; over TLS where the
daemon has a certificate, otherwise in clear).

``Dispatcher`` turns one request line into one response and knows nothing
about sockets; ``UnixControlServer`` and ``TcpControlServer`` carry lines to
it, one thread per connection. TCP holds at most ``max_connections`` at
once (fewer per peer before they authenticate), reads at most AUTH_MAX
bytes before the ``AUTH`` line, which must come within ``auth_timeout``
seconds, and logs refusals at a bounded rate: a flood of idle or
unauthenticated connections costs a few threads and log lines, and the
Unix socket, served by its own thread, keeps answering.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time

from xagg.wire.control import ALWAYS_ALLOWED, MAX_LINE, OPS
from xaggd.auth import ADMIN, AUTH_MAX, AuthError, Credentials, Session, new_job_token
from xaggd.job_request import RequestError, job_token
from xaggd.loglimit import LogLimiter
from xaggd.settings import BY_NAME

log = logging.getLogger("xaggd.control")
limited = LogLimiter(log)

AUTH_TIMEOUT_S = 5.0        # a TCP connection must authenticate within this
IDLE_TIMEOUT_S = 300.0      # an authenticated connection idle this long is closed


class Dispatcher:
    """Turns one request line into one response; knows nothing about sockets."""

    def __init__(self, daemon):
        self.daemon = daemon          # server.Server: .jobs, .backend, status()/stats()

    def handle_line(self, line: bytes, session: Session) -> dict:
        """The response to one request line from an authenticated ``session``."""
        rid = None
        op = None
        try:
            try:
                req = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                return self._err(f"request: not valid JSON ({e}); send one JSON object per line", None)
            if not isinstance(req, dict):
                return self._err(f"request: must be a JSON object, got {type(req).__name__}", None)
            rid = req.get("id")
            op = req.get("op")
            if op is None:
                raise RequestError(f"op: missing; one of {', '.join(OPS)}")
            if op not in OPS:
                raise RequestError(f"op: unknown op {op!r}; one of {', '.join(OPS)}")
            required, allowed = OPS[op]
            for f in sorted(required):
                if f not in req:
                    raise RequestError(f"{f}: missing (required by {op})")
            extra = sorted(set(req) - allowed - ALWAYS_ALLOWED)
            if extra:
                raise RequestError(f"{extra[0]}: unknown field for {op} (known: "
                                   f"{', '.join(sorted(allowed)) or 'none'})")
            resp = getattr(self, f"op_{op}")(req, session)
            resp = {"ok": True, **resp}
        except RequestError as e:
            return self._err(str(e), rid)
        except Exception as e:  # noqa: BLE001 - a bug or a kernel error: say it, keep serving
            log.exception("control: op %r from %s failed", op, session.peer)   # never log the line
            return self._err(f"internal error: {type(e).__name__}: {e}", rid)
        if rid is not None:
            resp["id"] = rid
        return resp

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
    def _serving(self) -> None:
        """New or bigger jobs only while our program is the one attached."""
        problem = self.daemon.check_health()
        if problem:
            raise RequestError(f"data plane: {problem}")

    def op_register(self, req, session):
        d = self.daemon
        self._serving()
        given = job_token(req)
        fresh = new_job_token() if given is None else None
        job, created = d.jobs.register(req, admin=session.admin, fresh_token=fresh)
        resp = {"created": created, "job": job.describe(d.jobs.slot_bytes), "memory": d.jobs.memory(),
                "port": d.backend.describe()["port"], "vals": d.config.vals, "lease_s": d.config.job_lease}
        token = given if given is not None else (fresh if created else None)
        if token is not None:                 # only to whoever sent it or just got it
            resp["job_token"] = token
        return resp

    def op_resize(self, req, session):
        d = self.daemon
        self._serving()
        job = d.jobs.resize(req, admin=session.admin)
        return {"job": job.describe(d.jobs.slot_bytes), "memory": d.jobs.memory()}

    def op_reset(self, req, session):
        d = self.daemon
        job = d.jobs.reset(self._job_id(req), admin=session.admin, token=job_token(req))
        return {"job": job.describe(d.jobs.slot_bytes)}

    def op_remove(self, req, session):
        d = self.daemon
        job = d.jobs.remove(self._job_id(req), admin=session.admin, token=job_token(req))
        return {"job_id": job.job_id, "freed_slots": job.n_slots,
                "freed_bytes": job.n_slots * d.jobs.slot_bytes, "memory": d.jobs.memory()}

    def op_keepalive(self, req, session):
        d = self.daemon
        job = d.jobs.keepalive(self._job_id(req), admin=session.admin, token=job_token(req))
        return {"job_id": job.job_id, "lease_s": d.config.job_lease}

    def op_list(self, req, session):
        return {"jobs": self.daemon.jobs.list(cookies=session.admin), "memory": self.daemon.jobs.memory()}

    def op_stats(self, req, session):
        job_id = self._job_id(req) if req.get("job_id") is not None else None
        return self.daemon.stats(job_id)

    def op_status(self, req, session):
        return self.daemon.status()

    def op_dataplane(self, req, session):
        """For a worker on this host (client/local.py): the XDP program and its
        slot and job maps, as file descriptors over the Unix socket, so it
        can put its own packets through the program (they never cross the
        interface) and read its chunks' sums where the program keeps them."""
        if not (session.admin and session.local):
            raise RequestError("dataplane: only over the local Unix control socket, as root "
                               "(file descriptors cannot cross TCP)")
        addr, port, netns = req.get("addr"), req.get("port", self.daemon.config.port), req.get("netns")
        if not isinstance(addr, str) or not isinstance(port, int) or isinstance(port, bool):
            raise RequestError(f"addr, port: an IPv4 address and a UDP port, got {addr!r}, {port!r}")
        if not isinstance(netns, int) or isinstance(netns, bool):
            raise RequestError(f"netns: the inode of the worker's network namespace, got {netns!r}")
        try:
            info, fds = self.daemon.backend.dataplane(addr, port, netns)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return {**info, "_fds": fds}


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        srv = self.server
        conn = self.request
        srv.track(conn, True)
        try:
            peer = srv.peer_name(conn, self.client_address)
            session = srv.open_session(conn, peer)
            if session is None:
                return
            conn.settimeout(IDLE_TIMEOUT_S)
            rfile = conn.makefile("rb")
            while not srv.closing:
                line = rfile.readline(MAX_LINE + 1)
                if not line:
                    return
                if len(line) > MAX_LINE:
                    send(conn, {"ok": False, "error": f"request: longer than {MAX_LINE} bytes"})
                    return
                if not line.strip():
                    continue
                resp = srv.dispatcher.handle_line(line, session)
                fds = resp.pop("_fds", None)
                if fds:         # the dataplane op: the program's and maps' fds ride along
                    socket.send_fds(conn, [json.dumps(resp, default=str).encode() + b"\n"], fds)
                else:
                    send(conn, resp)
        except OSError:
            return
        finally:
            srv.track(conn, False)


def send(conn, resp: dict) -> None:
    conn.sendall(json.dumps(resp, default=str).encode() + b"\n")


def read_first_line(conn, limit: int, timeout: float) -> bytes:
    """Up to ``limit`` bytes through the first newline, within ``timeout``
    seconds in all (a byte at a time from a slow peer does not extend it).
    TimeoutError when the deadline passes; b"" when the peer closed."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        conn.settimeout(left)
        chunk = conn.recv(limit - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


class _Common:
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
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
            if answers(path):
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

    def open_session(self, conn, peer):
        uid = self._cred(conn)[1]
        if uid in (0, os.geteuid()):
            return Session(ADMIN, peer, local=True)
        limited.warning("unix refused", "control: %s refused (not root)", peer)
        send(conn, {"ok": False, "error": "permission denied: the control socket is for root and the "
                                          "daemon's own user"})
        return None

    def close_all(self):
        super().close_all()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class TcpControlServer(_Common, socketserver.ThreadingTCPServer):
    """Remote control: each connection authenticates first (xaggd.auth),
    inside TLS when given ``tls`` (a server ssl.SSLContext)."""

    def __init__(self, addr: tuple[str, int], credentials: Credentials, dispatcher, *,
                 max_connections: int = BY_NAME["max_connections"].default, auth_timeout: float = AUTH_TIMEOUT_S,
                 tls=None):
        self.credentials = credentials
        self.tls = tls
        self.max_connections = max_connections
        self.max_pending_per_peer = max(1, max_connections // 4)
        self.auth_timeout = auth_timeout
        self.active = 0                         # connections being served
        self._pending: dict[str, int] = {}      # peer IP -> connections not yet authenticated
        self._pending_conns: dict = {}          # such a connection -> its peer IP
        self._count_lock = threading.Lock()
        self.setup_common(dispatcher)
        super().__init__(addr, _Handler)

    def set_credentials(self, credentials: Credentials) -> None:
        """New tokens (SIGHUP): connections from now on; open ones keep their session."""
        self.credentials = credentials

    # -- the cap: decided in the accepting thread, before any thread starts
    def process_request(self, request, client_address):
        ip = client_address[0]
        with self._count_lock:
            why = ("too many control connections" if self.active >= self.max_connections else
                   "too many unauthenticated connections from this address"
                   if self._pending.get(ip, 0) >= self.max_pending_per_peer else None)
            if why is None:
                self.active += 1
                self._pending[ip] = self._pending.get(ip, 0) + 1
                self._pending_conns[request] = ip
        if why is not None:
            limited.warning("busy", "control: tcp %s refused: %s", ip, why)
            try:
                request.setblocking(False)
                request.send(json.dumps({"ok": False, "error": f"busy: {why}; try again later"}).encode()
                             + b"\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def finish_request(self, request, client_address):
        """In the connection's own thread: the TLS handshake, if any, then
        the handler. The handshake counts against the AUTH deadline and the
        connection stays pending (capped per peer) until it authenticates."""
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(self.auth_timeout)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ValueError) as e:
            limited.warning("tls refused", "control: tcp %s: TLS handshake failed: %s", client_address[0],
                            getattr(e, "reason", None) or e)
            return
        with self._count_lock:                 # the pending entry follows the socket the handler sees
            ip = self._pending_conns.pop(request, None)
            if ip is not None:
                self._pending_conns[conn] = ip
        try:
            super().finish_request(conn, client_address)
        finally:
            with self._count_lock:
                self._authenticated(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _release(self, request):
        with self._count_lock:
            self.active -= 1
            self._authenticated(request)

    def _authenticated(self, request):
        """``request`` no longer counts as pending (idempotent; hold _count_lock)."""
        ip = self._pending_conns.pop(request, None)
        if ip is None:
            return
        n = self._pending.get(ip, 0)
        if n > 1:
            self._pending[ip] = n - 1
        else:
            self._pending.pop(ip, None)

    def peer_name(self, conn, addr):
        return f"tcp {addr[0]}:{addr[1]}"

    def open_session(self, conn, peer):
        """The AUTH line, within the deadline, before any JSON: a Session or None."""
        try:
            try:
                line = read_first_line(conn, AUTH_MAX, self.auth_timeout)
            except TimeoutError:
                limited.warning("auth timeout", "control: %s sent no AUTH line within %gs", peer,
                                self.auth_timeout)
                send(conn, {"ok": False, "error": f"auth: no AUTH line within {self.auth_timeout:g}s"})
                return None
            if not line:
                return None
            try:
                role = self.credentials.authenticate(line)
            except AuthError as e:
                limited.warning("auth refused", "control: %s refused: %s", peer, str(e)[len("auth: "):])
                send(conn, {"ok": False, "error": str(e)})
                return None
            send(conn, {"ok": True, "role": role})
            return Session(role, peer)
        finally:
            with self._count_lock:            # authenticated or gone: no longer pending
                self._authenticated(conn)


def answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
