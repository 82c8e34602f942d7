"""The retransmit timer restarts at each expiry (csrc/exchange.c, RFC 6298
5.5-5.6): a round waiting seconds on a late worker backs off to one probe
of PROBE_ROWS chunks per RTO_BACKOFF_MAX, and keeps sleeping in between.
Timed from the last result instead, the timer expired on every pass of the
loop once the stall outlasted the backoff's cap: the waiting worker spun,
polling and probing, on the CPU the late one needed, and resent every chunk
of its window once a second. Through the userspace twin of the XDP program,
over loopback."""
from __future__ import annotations

import numpy as np
from test_fanout_loss_probe import WINDOW, _call_all, _clients
from test_native_loop import _serve_behind, _sum_and_bound

from xaggd.dataplane.userspace import UserspaceAggregator

VALS = 256
LATE = 3.0      # seconds: past the backoff's cap (RTO_BACKOFF_MAX, 1 s) twice over


def test_a_worker_seconds_late_gets_backed_off_probes():
    n, size = 2, 100 * VALS
    agg = UserspaceAggregator()
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(2)
    calls = [[rng.standard_normal(size).astype(np.float32) for _ in range(n)] for _ in range(3)]
    clients = _clients(n, srv.port, timeout=20, rto=0.02)
    try:
        for xs in calls[:2]:                        # the first call and its exponents settle
            _call_all(clients, xs)
        before = vars(clients[0].stats).copy()
        outs = _call_all(clients, calls[2], late=(1, LATE))
        want, tol = _sum_and_bound([[x] for x in calls[2]], 0)
        assert all(np.abs(o - want).max() <= tol for o in outs)
        s0 = {k: v - before[k] for k, v in vars(clients[0].stats).items() if isinstance(v, int)}
    finally:
        for c in clients:
            c.close()
        srv.stop()
    assert s0["rto_resends"] >= 1, s0                  # the round did stall
    # expiries 0.02, 0.06, 0.14, ... 1.26, 2.26 s into the stall: 2 chunks
    # each; a timer that expires every pass past 1 s resends all WINDOW
    # chunks (twice over in the 2 s past the cap)
    assert s0["rto_resends"] < WINDOW, s0
