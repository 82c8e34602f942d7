"""Registering a training job with the aggregators' daemons (xaggd control API).

Every aggregator runs its own xaggd; each gets the same request with its own
``agg_index``, so all of them split buckets the same way (xagg.plan). The
request is the daemon's register request (daemon/xaggd/jobs.py). After a
(re-)registration the job is reset: a fresh generation forgets every partial
sum, so rounds restart safely after a restore from an older checkpoint or a
daemon restart.
"""
from __future__ import annotations

import socket

from xagg.client import parse_addr
from xagg.proto import C


class RegistrationError(RuntimeError):
    """The job could not be registered; the message names the aggregator."""


def worker_source_ip(aggregator: str) -> str:
    """The local address this host uses to reach ``aggregator`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(parse_addr(aggregator))
        return s.getsockname()[0]


def job_request(*, job_id: int, cookie: int, workers: list, max_elements: int, aggregators: list,
                weights: list | None, fanout: str, result_port: int = C.XAGG_PORT + 1,
                vals: int | None = None) -> dict:
    """The register request; ``vals`` None takes the daemons' values per packet."""
    ws = weights or [1.0] * len(aggregators)
    req = {"job_id": job_id, "cookie": cookie, "workers": list(workers), "max_elements": max_elements,
           "fanout": fanout, "result_port": result_port,
           "aggregators": [{"addr": a, "weight": w} for a, w in zip(aggregators, ws)]}
    return req if vals is None else {**req, "vals": vals}


def _control_client(address: str, token: str | None):
    try:
        from xaggd.control import ControlClient
    except ImportError as e:
        raise RegistrationError(f"registering job needs the xaggd control API (xaggd.control), "
                                f"which is not importable here: {e}") from None
    return ControlClient(address, token=token)


def register_job(control: list, token: str | None, request: dict, *, reset: bool = True) -> int:
    """Register ``request`` with every aggregator's daemon (idempotent), then
    reset the job. Returns the values per packet the daemons run (all must agree)."""
    vals = set()
    for k, address in enumerate(control):
        cc = None
        try:
            cc = _control_client(address, token)
            vals.add(cc.register({**request, "agg_index": k})["vals"])
            if reset:
                cc.reset(request["job_id"])
        except RegistrationError:
            raise
        except Exception as e:  # noqa: BLE001 - any transport or daemon error, named
            raise RegistrationError(f"aggregator {k} ({request['aggregators'][k]['addr']}), control "
                                    f"{address}: {type(e).__name__}: {e}") from None
        finally:
            close = getattr(cc, "close", None)
            if close:
                close()
    if len(vals) != 1:
        raise RegistrationError(f"the aggregators run different values per packet ({sorted(vals)}): "
                                "start every xaggd with the same --vals")
    return vals.pop()
