"""The control API: newline-delimited JSON over a Unix socket (local, root
only) or TCP (remote: the connection's first line is ``AUTH <token>``).

One request per line, one response per line, in order::

    {"op": "register", "job_id": 7, "cookie": 99, "workers": ["10.0.0.1", "10.0.0.2"],
     "max_elements": 25000000}
    -> {"ok": true, "created": true, "job": {...}, "memory": {...}, "port": 9977, "vals": 256}
    {"op": "remove", "job_id": 8}
    -> {"ok": false, "error": "job_id: no job 8 on this aggregator (registered: 7)"}

Ops and their fields (* = required):

    register  *job_id, *cookie (u32), *max_elements (largest gradient, elements),
              workers (one IPv4 per worker id, "" = any source) or n_workers,
              fanout ("unicast" | "bcast", default unicast), bcast_ip, result_port,
              aggregators ([{"addr": "HOST:PORT", "weight": W}], default: this one alone),
              agg_index (which of them this daemon is, default 0), vals (must match),
              replace (true: re-register with other parameters),
              job_token (the job's credential: bring your own, or get one),
              children ([{"addr": IPv4, "workers": [ids] or mask}]: child aggregators
              that send partial sums for this one's chunks), child_for ([{"agg_index":
              p, "workers": [ids] or mask}]: sum those workers' contributions to
              aggregator p's chunks here and send p one partial; docs/hierarchy.md)
              -> created, job, memory, port, vals, job_token, lease_s
    resize    *job_id, max_elements, aggregators, agg_index, job_token -> job, memory
    reset     *job_id, job_token -> job      (new generation: partial sums and stats cleared)
    remove    *job_id, job_token -> job_id, freed_slots, freed_bytes, memory
    keepalive *job_id, job_token -> job_id, lease_s   (the registrant is still there)
    list      -> jobs (with idle_s), memory  (cookies for the admin only)
    stats     job_id -> time, uptime_s, backend, vals, counters {verdict: packets},
              packets, bytes_aggregated, jobs {"ID": {aggregated, completed, retransmits,
              dropped, bytes_aggregated}}
    status    -> name, pid, backend, iface, netns, mode, attached, port, prog_id, vals,
              max_workers, uptime_s, started_at, control, listen, tls, metrics, health,
              unicast_problem (why unicast fan-out is refused, or null), memory,
              lease_s, idle {after_s, jobs, slots}, jobs (with idle_s)

Leases: a job that has neither packets nor requests from its registrant
(register, resize, reset, keepalive) for ``lease_s`` seconds (xaggd
--job-lease; 0: never) is removed. A registrant that may send no packet for
that long (a long evaluation, a checkpoint) sends ``keepalive`` more often.

``job``: job_id, job_index, the register fields, n_workers, n_chunks (this
aggregator's share, xagg.wire.chunks.capacity), slot_base, n_slots (2 per chunk),
memory_bytes, registered_at, resets. ``memory``: max_slots, used_slots,
free_slots, largest_free_slots, slot_bytes, memory_bytes, free_bytes,
max_jobs, jobs.

Every request may carry ``"id"`` (echoed back). Unknown fields are errors.
Errors start with the field they are about ("workers[1]: not an IPv4
address: ...").

Credentials (xaggd.auth): the Unix socket is the admin's. Over TCP the
first line of a connection is ``AUTH <token>`` with the admin token (every
op on every job) or the client token (register new jobs; status, stats,
list without cookies); the daemon answers ``{"ok": true, "role": ...}``, or
an error starting "auth:" and closes. A job's register answer carries its
``job_token``, given to that registrant only; re-registering, replacing,
resizing, resetting or removing the job takes it (``job_token`` in the
request) unless the connection is the admin's.

Over TCP the token, job tokens and cookies travel in clear unless the
daemon serves TLS (xaggd --tls-cert) and the client asks for it: a CA file
(``tls_ca``) to verify the daemon's certificate against, or a "tls:" address
for the system's CAs.

``ControlClient`` is the Python side; registration.py registers one job
with every aggregator of it (what ``xagg-client`` does at start-up).
``xaggd.control_server`` serves this protocol.
"""
from __future__ import annotations

import json
import socket
import ssl
import threading
import time

from xagg.wire.addresses import split_host_port
from xagg.wire.fanout import Fanout

MAX_LINE = 1 << 20
DEFAULT_CONTROL = "/run/xaggd/xaggd.sock"

REGISTER_FIELDS = {"job_id", "cookie", "workers", "n_workers", "max_elements", "fanout", "bcast_ip",
                   "result_port", "aggregators", "agg_index", "vals", "replace", "job_token",
                   "children", "child_for"}
RESIZE_FIELDS = {"job_id", "max_elements", "aggregators", "agg_index", "job_token"}
# op -> (required fields, optional fields); "op" and "id" are always allowed
OPS = {
    "register": ({"job_id", "cookie", "max_elements"}, REGISTER_FIELDS),
    "resize": ({"job_id"}, RESIZE_FIELDS),
    "reset": ({"job_id"}, {"job_id", "job_token"}),
    "remove": ({"job_id"}, {"job_id", "job_token"}),
    "keepalive": ({"job_id"}, {"job_id", "job_token"}),
    "list": (set(), set()),
    "stats": (set(), {"job_id"}),
    "status": (set(), set()),
    "dataplane": ({"addr", "netns"}, {"addr", "port", "netns"}),      # local only: answers with fds (client/local.py)
}
ALWAYS_ALLOWED = {"op", "id"}


class ControlError(RuntimeError):
    """The daemon refused a request (``.response`` holds its answer), or
    could not be reached."""

    def __init__(self, message: str, response: dict | None = None):
        super().__init__(message)
        self.response = response or {}


class DaemonUnavailable(ControlError):
    """Nothing answers at the control address."""


def parse_address(address) -> tuple[int, object]:
    """(socket family, address) for a control address:
    "/run/xaggd/xaggd.sock", "unix:PATH", "HOST:PORT", "tcp:HOST:PORT",
    "tls:HOST:PORT", (host, port)."""
    if address is None:
        return socket.AF_UNIX, DEFAULT_CONTROL
    if isinstance(address, (tuple, list)):
        return socket.AF_INET, (str(address[0]), int(address[1]))
    s = str(address)
    if s.startswith("unix:"):
        return socket.AF_UNIX, s[5:]
    if s.startswith(("tcp:", "tls:")):
        s = s[4:]
    elif "/" in s:
        return socket.AF_UNIX, s
    try:
        return socket.AF_INET, split_host_port(s, default_host="127.0.0.1")
    except ValueError:
        port = s.rpartition(":")[2]
        why = f"port {port} is not 0..65535" if port.isdigit() else "expected a socket path or HOST:PORT"
        raise ValueError(f"control address {address!r}: {why}") from None


class ControlClient:
    """Talk to one xaggd.

    >>> c = ControlClient("/run/xaggd/xaggd.sock")            # local, as root
    >>> c = ControlClient("10.77.0.101:9979", token=open("/etc/xagg/client-token").read())
    >>> c.register(7, cookie=99, max_elements=25_000_000, workers=["10.77.0.1", "10.77.0.2"],
    ...            aggregators=[{"addr": "10.77.0.101:9977", "weight": 2},
    ...                         {"addr": "10.77.0.102:9977", "weight": 1}], agg_index=0)

    Methods return the daemon's answer without ``ok``; a refusal raises
    ``ControlError`` with the daemon's message (it names the field), an
    unreachable daemon ``DaemonUnavailable``. One connection, reopened once
    if it broke; safe to share between threads.

    Over TCP ``token`` (admin or client token) authenticates each
    connection. The job token of every job this client registers is kept
    (``job_tokens``) and sent with that job's later requests. ``tls_ca``
    (a PEM file of the CA that signed the daemon's certificate), or a
    "tls:HOST:PORT" address (the system's CAs), puts the connection in TLS;
    the certificate must name the host or IP address connected to.
    """

    def __init__(self, address=None, token: str | None = None, timeout: float = 30.0,
                 tls_ca: str | None = None):
        self.family, self.address = parse_address(address)
        tls = self.family != socket.AF_UNIX and (tls_ca or str(address).startswith("tls:"))
        self.tls = tls_context(tls_ca) if tls else None      # a local socket needs none
        self.token = token.strip() if token else None
        if self.token is not None and (not self.token.isprintable() or " " in self.token):
            raise ValueError("token: must be one line of printable characters without spaces")
        self.timeout = timeout
        self.job_tokens: dict[int, str] = {}
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
        if self.tls is not None:
            s = self._handshake(s)
        f = s.makefile("rb")
        if self.family != socket.AF_UNIX:
            self._authenticate(s, f)
        self._sock, self._file = s, f

    def _handshake(self, s):
        """The TLS connection over ``s``; ControlError when the daemon's
        certificate does not verify, DaemonUnavailable when it speaks no TLS."""
        try:
            return self.tls.wrap_socket(s, server_hostname=self.address[0])
        except ssl.SSLCertVerificationError as e:
            s.close()
            raise ControlError(f"tls: the certificate of xaggd at {self._where()} does not verify: "
                               f"{e.verify_message} (control_ca: the CA file that signed it)") from None
        except (OSError, ValueError) as e:
            s.close()
            raise DaemonUnavailable(f"tls: no TLS handshake with xaggd at {self._where()} ({e}); "
                                    "does it run with --tls-cert?") from None

    def _authenticate(self, s, f) -> None:
        """The connection's first line: AUTH <token>; ControlError if refused."""
        if not self.token:
            s.close()
            raise ControlError(f"token: xaggd at {self._where()} needs a token over TCP (the admin or the "
                               "client token: --token-file FILE or XAGG_TOKEN)")
        closed = (f"xaggd at {self._where()} closed the connection without answering AUTH"
                  + ("" if self.tls else " (a daemon that serves TLS does so to a plain connection: "
                                         "give the CA file of its certificate)"))
        try:
            s.sendall(b"AUTH " + self.token.encode() + b"\n")
            line = f.readline(MAX_LINE + 1)
            resp = json.loads(line) if line else {"ok": False, "error": closed}
        except ConnectionResetError:
            s.close()
            raise DaemonUnavailable(closed) from None
        except (OSError, ValueError) as e:
            s.close()
            raise DaemonUnavailable(f"xaggd at {self._where()}: {e}") from None
        if not resp.get("ok"):
            s.close()
            raise ControlError(str(resp.get("error", "auth: refused")), resp)

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
                    return json.loads(line)
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
                 workers=None, n_workers: int | None = None, fanout: Fanout | str | None = None,
                 bcast_ip: str | None = None, result_port: int | None = None, aggregators=None,
                 agg_index: int | None = None, vals: int | None = None,
                 replace: bool | None = None, job_token: str | None = None) -> dict:
        """Install job ``job_id`` on this aggregator, sized for gradients of up
        to ``max_elements``; returns {"created", "job", "memory", "port", "vals",
        "job_token"}: the job's credential, kept for this client's later
        requests about the job (``job_token`` brings your own; one this
        client holds is sent along).

        ``workers``: one IPv4 address per worker id ("" = any source), or
        give ``n_workers``. ``aggregators``: every aggregator of the job, as
        "HOST:PORT", (addr, weight) or {"addr", "weight"}; ``agg_index``:
        which one this daemon is. Registering the same parameters again is
        a no-op (created: false); other parameters need ``replace=True``.

        ``job_id`` may instead be a whole register request (a dict with
        these keys); keyword arguments given as well override its entries.
        """
        fields = dict(cookie=cookie, max_elements=max_elements, workers=workers, n_workers=n_workers,
                      fanout=None if fanout is None else Fanout.parse(fanout).label, bcast_ip=bcast_ip, result_port=result_port,
                      aggregators=aggregators, agg_index=agg_index, vals=vals, replace=replace,
                      job_token=job_token)
        if isinstance(job_id, dict):
            req = {k: v for k, v in job_id.items() if k != "op"}
            req.update({k: v for k, v in fields.items() if v is not None})
        else:
            req = {"job_id": job_id, **fields}
        req["aggregators"] = aggregator_entries(req.get("aggregators"))
        if req.get("job_token") is None:
            req["job_token"] = self.job_tokens.get(req.get("job_id"))
        resp = self.request("register", **req)
        if resp.get("job_token"):
            self.job_tokens[req["job_id"]] = resp["job_token"]
        return resp

    def _token_for(self, job_id, given):
        return given if given is not None else self.job_tokens.get(job_id)

    def resize(self, job_id: int, max_elements: int | None = None, *, aggregators=None,
               agg_index: int | None = None, job_token: str | None = None) -> dict:
        return self.request("resize", job_id=job_id, max_elements=max_elements,
                            aggregators=aggregator_entries(aggregators), agg_index=agg_index,
                            job_token=self._token_for(job_id, job_token))

    def reset(self, job_id: int, job_token: str | None = None) -> dict:
        return self.request("reset", job_id=job_id, job_token=self._token_for(job_id, job_token))["job"]

    def remove(self, job_id: int, job_token: str | None = None) -> dict:
        resp = self.request("remove", job_id=job_id, job_token=self._token_for(job_id, job_token))
        self.job_tokens.pop(job_id, None)
        return resp

    def keepalive(self, job_id: int, job_token: str | None = None) -> dict:
        """Renew job ``job_id``'s lease; {"job_id", "lease_s"}: keep calling
        well within lease_s (0: the daemon never expires jobs)."""
        return self.request("keepalive", job_id=job_id, job_token=self._token_for(job_id, job_token))

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


def tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """A client context that verifies the daemon's certificate and its host
    name against ``ca_file`` (default: the system's CAs)."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"control_ca: {ca_file!r}: not a readable PEM CA file ({e})") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def aggregator_entries(aggregators):
    """Aggregators as the protocol lists them: "HOST:PORT", (addr, weight) or
    {"addr", "weight"} -> [{"addr", "weight"}]."""
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
