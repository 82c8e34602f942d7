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
              -> created, job, memory, port, vals, job_token
    resize    *job_id, max_elements, aggregators, agg_index, job_token -> job, memory
    reset     *job_id, job_token -> job      (new generation: partial sums and stats cleared)
    remove    *job_id, job_token -> job_id, freed_slots, freed_bytes, memory
    list      -> jobs, memory                (cookies for the admin only)
    stats     job_id -> time, uptime_s, backend, vals, counters {verdict: packets},
              packets, bytes_aggregated, jobs {"ID": {aggregated, completed, retransmits,
              dropped, bytes_aggregated}}
    status    -> name, pid, backend, iface, netns, mode, attached, port, prog_id, vals,
              max_workers, uptime_s, started_at, control, listen, metrics, health,
              unicast_problem (why unicast fan-out is refused, or null), memory, jobs

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

``ControlClient`` is the Python side; ``register_job`` registers one job
with every aggregator of it (what ``xagg-client`` does at start-up).
``xaggd.control_server`` serves this protocol.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import threading
import time

from xagg.wire.fanout import Fanout
from xagg.wire.jobspec import DEFAULT_RESULT_PORT
from xagg.wire.proto import parse_addr

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
    (``job_tokens``) and sent with that job's later requests.
    """

    def __init__(self, address=None, token: str | None = None, timeout: float = 30.0):
        self.family, self.address = parse_address(address)
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
        f = s.makefile("rb")
        if self.family != socket.AF_UNIX:
            self._authenticate(s, f)
        self._sock, self._file = s, f

    def _authenticate(self, s, f) -> None:
        """The connection's first line: AUTH <token>; ControlError if refused."""
        if not self.token:
            s.close()
            raise ControlError(f"token: xaggd at {self._where()} needs a token over TCP (the admin or the "
                               "client token: --token-file FILE or XAGG_TOKEN)")
        try:
            s.sendall(b"AUTH " + self.token.encode() + b"\n")
            line = f.readline(MAX_LINE + 1)
            resp = json.loads(line) if line else {"ok": False, "error": "connection closed by xaggd"}
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


# -- registering a job with every aggregator ------------------------------------
class RegistrationError(RuntimeError):
    """The job could not be registered; the message names the aggregator and
    ``aggregator`` holds its index (None: not one aggregator's fault)."""

    def __init__(self, message: str, aggregator: int | None = None):
        super().__init__(message)
        self.aggregator = aggregator


def worker_source_ip(aggregator: str) -> str:
    """The local address this host uses to reach ``aggregator`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(parse_addr(aggregator))
        return s.getsockname()[0]


def worker_source_ips(aggregators: list) -> list[str]:
    """This host's source address towards each of ``aggregators``: a host with
    several NICs (multi-rail) may reach each through another one. "" where
    there is no route (the job then takes any source for this worker there)."""
    out = []
    for a in aggregators:
        try:
            out.append(worker_source_ip(a))
        except OSError:
            out.append("")
    return out


def run_job_token(token: str, job_id: int, cookie: int) -> str:
    """The job token a run of job ``job_id``/``cookie`` uses with control token
    ``token``: the same for every run of that job (a fixed --job-id/--cookie
    run again, a restored checkpoint), so a new run may re-register the job
    its previous run left behind. Only a holder of both the control token and
    the job's cookie can compute it."""
    msg = f"xagg job token v1 {job_id} {cookie}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def job_request(*, job_id: int, cookie: int, workers: list, max_elements: int, aggregators: list,
                weights: list | None, fanout: Fanout | str, result_port: int = DEFAULT_RESULT_PORT,
                vals: int | None = None, job_token: str | None = None) -> dict:
    """The register request (``OPS["register"]``) for ``aggregators`` ("HOST:PORT"
    list) and their ``weights``; ``vals`` None takes the daemons' values per packet.
    ``job_token``: the job's control credential at every aggregator (default: a
    fresh random one), so the request registers, resets and re-registers the
    job (after a daemon restart too) and no other client can. ``replace``: the
    registrant's own parameters win over a resize an operator made meanwhile,
    which would otherwise refuse every re-registration (only the job token's
    holder or the admin may replace)."""
    ws = weights or [1.0] * len(aggregators)
    req = {"job_id": job_id, "cookie": cookie, "workers": list(workers), "max_elements": max_elements,
           "fanout": Fanout.parse(fanout).label, "result_port": result_port, "replace": True,
           "job_token": job_token or secrets.token_urlsafe(24),
           "aggregators": [{"addr": a, "weight": w} for a, w in zip(aggregators, ws)]}
    return req if vals is None else {**req, "vals": vals}


def register_job(control: list, token: str | None, request: dict, *, reset: bool = True,
                 workers_by_agg: list | None = None, routes: list | None = None) -> int:
    """Register ``request`` with every aggregator's daemon, then reset the job.
    Returns the values per packet the daemons run (all must agree).

    Each daemon gets the same request with its own ``agg_index``, so all of
    them split tensors the same way (xagg.wire.chunks), and, given
    ``workers_by_agg`` (one worker list per aggregator), the addresses the
    workers reach that aggregator from (multi-rail hosts); given a plan's
    ``routes`` (a tree), its children and child entries (plan_request).
    Registering again is idempotent; the reset (a fresh generation) forgets
    every partial sum, so rounds restart safely after a restore from an older
    checkpoint or a daemon restart. An aggregator of weight 0 holds no chunk
    and is skipped (a plan that routes around a dead one)."""
    aggs = request["aggregators"]
    ips = [parse_addr(a["addr"])[0] for a in aggs]
    try:
        per_agg = [plan_request(request, routes, k, agg_ips=ips) if routes else {**request, "agg_index": k}
                   for k in range(len(aggs))]
    except ValueError as e:
        raise RegistrationError(f"plan.{e}") from None
    vals = set()
    for k, address in enumerate(control):
        if not aggs[k]["weight"]:
            continue
        try:
            with ControlClient(address, token=token) as cc:
                req = per_agg[k]
                if workers_by_agg is not None:
                    req["workers"] = list(workers_by_agg[k])
                vals.add(cc.register(req)["vals"])
                if reset:
                    cc.reset(request["job_id"])      # with the job token register kept
        except Exception as e:  # noqa: BLE001 - any transport or daemon error, named
            raise RegistrationError(f"aggregator {k} ({aggs[k]['addr']}), control "
                                    f"{address}: {type(e).__name__}: {e}", aggregator=k) from None
    if len(vals) != 1:
        raise RegistrationError(f"the aggregators run different values per packet ({sorted(vals)}): "
                                "start every xaggd with the same --vals")
    return vals.pop()


# -- two-level plans (xagg.wire.planner.Plan) -------------------------------------
def plan_entries(routes: list, k: int) -> tuple[list, list]:
    """What aggregator ``k`` holds for a plan's ``routes`` (routes[w][p] = c:
    worker w sends p's chunks through aggregator c): its children for its own
    chunk range, [(c, worker mask)] for each c != k some worker reaches k
    through; and its child entries, [(p, worker mask)] for each other root p
    some workers reach through k."""
    def mask(p, c):
        return sum(1 << w for w, row in enumerate(routes) if row[p] == c)
    m = len(routes[0]) if routes else 0
    for w, row in enumerate(routes):
        if len(row) != m or not all(isinstance(c, int) and 0 <= c < m for c in row):
            raise ValueError(f"routes[{w}]: must list, per aggregator, an aggregator index 0..{m - 1}, "
                             f"got {row!r}")
    children = [(c, mask(k, c)) for c in range(m) if c != k and mask(k, c)]
    subs = [(p, mask(p, k)) for p in range(m) if p != k and mask(p, k)]
    return children, subs


def plan_request(request: dict, routes: list, k: int, *, agg_ips: list) -> dict:
    """``request`` (job_request's) for aggregator ``k`` of a plan: its
    ``children`` ({"addr": IPv4, "workers": mask}) and ``child_for``
    ({"agg_index": p, "workers": mask}: the daemon finds p's address in
    ``aggregators`` and resolves its next hop's MAC)."""
    children, subs = plan_entries(routes, k)
    req = {**request, "agg_index": k}
    if children:
        req["children"] = [{"addr": agg_ips[c], "workers": m} for c, m in children]
    if subs:
        req["child_for"] = [{"agg_index": p, "workers": m} for p, m in subs]
    return req


def register_plan(control: list, token: str | None, request: dict, plan, *, reset: bool = True,
                  workers_by_agg: list | None = None) -> int:
    """Register a job planned as ``plan`` (kind, weights, routes) with every
    aggregator's daemon: ``request`` is job_request's, its aggregators in the
    plan's order; the weights become the plan's. A flat plan registers as
    register_job does; a tree also gives each root its children and each
    child its sub-jobs. Returns the values per packet the daemons run."""
    aggs = request["aggregators"]
    if len(plan.weights) != len(aggs):
        raise RegistrationError(f"plan.weights: {len(plan.weights)} weights for {len(aggs)} aggregators")
    request = {**request, "aggregators": [{**a, "weight": float(w)} for a, w in zip(aggs, plan.weights)]}
    return register_job(control, token, request, reset=reset, workers_by_agg=workers_by_agg,
                        routes=getattr(plan, "routes", None) or None)
