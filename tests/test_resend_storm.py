"""A window larger than a slow link's queues: adapted, and said.

The client's window starts at 256 KB in flight per worker by default.
Workers at 100 Mbit/s, a rate-limited cloud link: the switch port queues
about 150 KB, so a window that large loses its excess and every worker
resends what one worker lost, nearly half of all packets sent. The round
loop halves the window within the call (csrc/exchange.c, judge_epoch), so
the first call does not storm to its end; the client carries the window
to the next call, halves it after a call that stormed, grows it back after
clean ones (xagg/client/window.py), and says so once, with a window to
start from; run with that window the same all-reduce resends almost
nothing and nothing is said.
"""
from __future__ import annotations

import os
import re

import pytest

from xagg.client.allreduce import resend_storm
from xagg.client.config import MIN_WINDOW
from xagg.client.window import CLEAN_SHARE, STORM_MIN_PACKETS, STORM_SHARE, Window
from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect_with_stderr, start_xagg
from xagg.lab.traffic import check_sums

ELEMENTS = 1_000_000            # 4 MB: ~2,800 datagrams per worker each way at MTU 1500
ROUNDS = 6
CEILING = 178                   # the default window at MTU 1500: 256 KB of 1,4xx-byte packets
WORKERS = 4
SAID = "a resend storm:"


def test_a_call_is_a_storm_only_past_its_share_of_enough_packets_or_where_its_window_was_cut():
    assert "XAGG_WINDOW=44" in resend_storm(10_000, 5_000, 178)                 # halved after it: start at a quarter
    assert resend_storm(10_000, int(STORM_SHARE * 10_000) - 1, 178) is None     # a lossy link's few percent
    assert resend_storm(STORM_MIN_PACKETS - 1, STORM_MIN_PACKETS - 1, 178) is None  # too few to tell
    assert "XAGG_WINDOW=16" in resend_storm(10_000, 9_000, 20)                  # never below MIN_WINDOW
    said = resend_storm(10_000, 300, 178, ended=22)       # the round loop cut it: the call's share may be small
    assert "cut to 22 during" in said and "XAGG_WINDOW=22" in said, said
    assert resend_storm(10_000, 300, 178, ended=178) is None


def test_the_window_halves_after_a_storm_holds_on_a_lossy_call_and_grows_back_after_clean_ones():
    w = Window(CEILING)
    assert w.now == CEILING
    assert w.after_call(10_000, 5_000) and w.now == CEILING // 2        # a storm
    assert not w.after_call(10_000, 400) and w.now == CEILING // 2      # 4%: a lossy link, not a full queue
    assert not w.after_call(STORM_MIN_PACKETS - 1, STORM_MIN_PACKETS - 1) and w.now == CEILING // 2   # too few
    assert not w.after_call(10_000, int(CLEAN_SHARE * 10_000) - 1) and w.now == CEILING // 2 + CEILING // 16
    for _ in range(40):
        w.after_call(10_000, 0)
    assert w.now == CEILING                                             # back up, never past the ceiling
    for _ in range(10):
        w.after_call(10_000, 9_000)
    assert w.now == MIN_WINDOW                                          # never below MIN_WINDOW
    assert Window(4).now == MIN_WINDOW


def test_a_window_the_round_loop_cut_is_where_the_next_call_starts():
    w = Window(CEILING)
    assert w.after_call(10_000, 300, ended=22) and w.now == 22         # cut during the call: no second halving
    assert not w.after_call(10_000, 0, ended=22) and w.now == 22 + 2    # then a clean call grows it
    assert not w.after_call(10_000, 0, ended=CEILING) and w.now == 24 + 3   # a loop left at its start: no cut


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
          f"{sum(s['packets_sent'] for s in stats)} packets resent, windows after {[s['window'] for s in stats]}")
    return (sum(s["retransmits"] for s in stats), sum(s["packets_sent"] for s in stats), errs,
            [s["window"] for s in stats])


def named_window(said: str) -> int:
    return int(re.search(r"XAGG_WINDOW=(\d+)", said).group(1))


def test_on_a_slow_link_the_default_window_is_cut_within_the_first_call_and_the_storm_said_once(slow_lab, tmp_path):
    resent, sent, errs, windows = _run(slow_lab, tmp_path, window=0)
    said = [e for e in errs if SAID in e]
    assert said, (resent, sent, errs)                           # the first call stormed
    assert all(e.count(SAID) == 1 for e in said), said         # once per client, not per call
    assert "during" in said[0] and MIN_WINDOW <= named_window(said[0]) <= CEILING // 4, said[0]
    # cut within the first call, not after it: a call storming to its end resent ~half its packets, and the
    # whole run about a quarter of them
    assert resent < STORM_SHARE / 2 * sent, (resent, sent)
    # every worker cut its window and had not grown back to the default by the last call
    assert all(MIN_WINDOW <= w < CEILING for w in windows), windows


def test_the_window_it_names_ends_the_storm_and_nothing_is_said(slow_lab, tmp_path):
    _, _, errs, _ = _run(slow_lab, tmp_path, window=0)
    window = min(named_window(e) for e in errs if SAID in e)
    resent, sent, errs, windows = _run(slow_lab, tmp_path, window=window)
    assert resent < 0.05 * sent, (resent, sent)
    assert not any(SAID in e for e in errs), errs
    assert windows == [window] * WORKERS                        # clean calls: the ceiling it was given
