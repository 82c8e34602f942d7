"""The retransmit timer restarts at each expiry (csrc/exchange.c, RFC 6298
5.5-5.6): a round waiting seconds on a late worker backs off to one probe
of PROBE_ROWS chunks per RTO_BACKOFF_MAX, and keeps sleeping in between.
Timed from the last result instead, the timer expired on every pass of the
loop once the stall outlasted the backoff's cap: the waiting worker spun,
polling and probing, on the CPU the late one needed, and resent every chunk
of its window once a second. Through the userspace twin of the XDP program,
over loopback."""
from __future__ import annotations

from test_fanout_loss_probe import WINDOW, _late_call

LATE = 3.0      # seconds: past the backoff's cap (RTO_BACKOFF_MAX, 1 s) twice over


def test_a_worker_seconds_late_gets_backed_off_probes():
    s0, _ = _late_call(2, LATE)
    assert s0["rto_resends"] >= 1, s0                  # the round did stall
    # expiries 0.02, 0.06, 0.14, ... 1.26, 2.26 s into the stall: 2 chunks
    # each; a timer that expires every pass past 1 s resends all WINDOW
    # chunks (twice over in the 2 s past the cap)
    assert s0["rto_resends"] < WINDOW, s0
