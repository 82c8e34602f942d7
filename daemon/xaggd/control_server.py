"""The control API's servers: the protocol of xagg.wire.control over a Unix
socket (local, root or the daemon's own user) or TCP (remote, the shared
token on every request).

``Dispatcher`` turns one request line into one response and knows nothing
about sockets; ``UnixControlServer`` and ``TcpControlServer`` carry lines to
it, one thread per connection.
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

from xagg.wire.control import ALWAYS_ALLOWED, MAX_LINE, OPS
from xaggd.jobs import RequestError

log = logging.getLogger("xaggd.control")


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
            extra = sorted(set(req) - allowed - ALWAYS_ALLOWED)
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
