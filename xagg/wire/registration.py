"""Registering one job with every aggregator of it, through each one's
control API (control.py): the request a job sends (``job_request``), its
credential across runs (``run_job_token``), a tree plan's children and child
entries per aggregator (``plan_request``), and the source address a worker
reaches each aggregator from (multi-rail hosts), with whether a router lies
between (``worker_reach``: the "auto" fan-out's input, xagg.wire.fanout.choose).
What ``xagg-client`` does at start-up, and the lab's experiments."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from xagg.wire.addresses import parse_addr
from xagg.wire.control import ControlClient
from xagg.wire.fanout import Fanout, Reach
from xagg.wire.jobspec import DEFAULT_RESULT_PORT


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


RTN_UNICAST, RTN_LOCAL = 1, 2        # rtm_type of a route (linux/rtnetlink.h)


def reach(aggregator: str) -> Reach:
    """How this host reaches ``aggregator`` ("HOST[:PORT]"): the source address
    it sends from, and whether its routing table puts the address on a link
    ("link": the same L2 segment), behind a gateway ("router"), on this host
    ("local") or nowhere (""). No packet is sent."""
    from pyroute2 import IPRoute     # netlink: only where a job registers
    try:
        src = worker_source_ip(aggregator)
        with IPRoute() as ipr:
            r = ipr.route("get", dst=parse_addr(aggregator)[0])[0]
    except Exception:   # noqa: BLE001 - no route, no netlink: the fan-out stays unicast (choose)
        return Reach()
    if r["type"] == RTN_LOCAL:
        return Reach(src, "local")
    if r["type"] != RTN_UNICAST:
        return Reach(src)
    return Reach(src, "router" if r.get_attr("RTA_GATEWAY") else "link")


def worker_reach(aggregators: list) -> list[Reach]:
    """This host's Reach of each of ``aggregators``."""
    return [reach(a) for a in aggregators]


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
                vals: int | None = None, job_token: str | None = None, result_group: str = "") -> dict:
    """The register request (``OPS["register"]``) for ``aggregators`` ("HOST:PORT"
    list) and their ``weights``; ``vals`` None takes the daemons' values per packet.
    ``job_token``: the job's control credential at every aggregator (default: a
    fresh random one), so the request registers, resets and re-registers the
    job (after a daemon restart too) and no other client can. ``replace``: the
    registrant's own parameters win over a resize an operator made meanwhile,
    which would otherwise refuse every re-registration (only the job token's
    holder or the admin may replace). ``result_group``: broadcast fan-out to this
    multicast group instead of the daemon's broadcast address."""
    ws = weights or [1.0] * len(aggregators)
    req = {"job_id": job_id, "cookie": cookie, "workers": list(workers), "max_elements": max_elements,
           "fanout": Fanout.parse(fanout).label, "result_port": result_port, "replace": True,
           "job_token": job_token or secrets.token_urlsafe(24),
           "aggregators": [{"addr": a, "weight": w} for a, w in zip(aggregators, ws)]}
    if result_group:
        req["bcast_ip"] = result_group
    return req if vals is None else {**req, "vals": vals}


def register_job(control: list, token: str | None, request: dict, *, reset: bool = True,
                 workers_by_agg: list | None = None, routes: list | None = None,
                 tls_ca: str | None = None) -> int:
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
    and is skipped (a plan that routes around a dead one). ``tls_ca``: TCP
    control in TLS, verified against this CA file (ControlClient)."""
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
            with ControlClient(address, token=token, tls_ca=tls_ca) as cc:
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


# -- two-level plans (a Plan's routes) --------------------------------------------
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
