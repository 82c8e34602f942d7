"""A window larger than a slow link's queues, said instead of hidden.

The client's window is fixed (256 KB in flight per worker by default).
Workers at 100 Mbit/s, a rate-limited cloud link: the switch port queues
about 150 KB, so at every call the excess is lost and every worker resends
what one worker lost, nearly half of all packets sent. The client says so
once, with the window that helps; run with that window the same all-reduce
resends almost nothing and the client says nothing.
"""
from __future__ import annotations

import os

import pytest

from xagg.client.allreduce import STORM_MIN_PACKETS, STORM_SHARE, resend_storm
from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect_with_stderr, start_xagg
from xagg.lab.traffic import check_sums

ELEMENTS = 1_000_000            # 4 MB: ~2,800 datagrams per worker each way at MTU 1500
ROUNDS = 3
WORKERS = 4
SAID = "packets were resends, with"


def test_a_call_is_a_storm_only_past_its_share_of_enough_packets():
    assert resend_storm(10_000, 5_000, 178) and "XAGG_WINDOW=44" in resend_storm(10_000, 5_000, 178)
    assert resend_storm(10_000, int(STORM_SHARE * 10_000) - 1, 178) is None     # a lossy link's few percent
    assert resend_storm(STORM_MIN_PACKETS - 1, STORM_MIN_PACKETS - 1, 178) is None  # too few to tell
    assert "XAGG_WINDOW=16" in resend_storm(10_000, 9_000, 20)                  # never below MIN_WINDOW


@pytest.fixture(scope="module")
def slow_lab():
    spec = LabSpec(name=f"rs{os.getpid() % 100000}", workers=WORKERS, aggregators=1, rate="100mbit",
                   rate_of={"a0": "400mbit"}, mtu=1500)
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=65536) as aggs:
        yield lab, aggs


def _run(slow_lab, tmp_path, window: int):
    lab, aggs = slow_lab
    job_id, procs = start_xagg(lab, aggs, ELEMENTS, rounds=ROUNDS, timeout=30, window=window, out_dir=str(tmp_path))
    try:
        reports, errs = collect_with_stderr(procs, timeout=300)
    finally:
        aggs.remove(job_id)
    check_sums(tmp_path, WORKERS, ROUNDS, [ELEMENTS])          # exact on every worker, storm or not
    stats = [r["stats"] for r in reports]
    print(f"\nwindow {window or 'default'}: {sum(s['retransmits'] for s in stats)} of "
          f"{sum(s['packets_sent'] for s in stats)} packets resent")
    return sum(s["retransmits"] for s in stats), sum(s["packets_sent"] for s in stats), errs


def test_the_default_window_on_a_slow_link_is_named_with_the_window_that_helps(slow_lab, tmp_path):
    resent, sent, errs = _run(slow_lab, tmp_path, window=0)
    assert resent >= STORM_SHARE * sent, (resent, sent)        # the storm is there
    said = [e for e in errs if SAID in e]
    assert said, errs
    assert all(e.count(SAID) == 1 for e in said), said         # once per client, not per call
    assert "XAGG_WINDOW=44" in said[0], said[0]


def test_the_window_it_names_ends_the_storm_and_nothing_is_said(slow_lab, tmp_path):
    resent, sent, errs = _run(slow_lab, tmp_path, window=44)
    assert resent < 0.05 * sent, (resent, sent)
    assert not any(SAID in e for e in errs), errs
