"""The window is what a worker has in flight to all its aggregators
together (xagg/client/config.py): every aggregator's results converge on
the worker's link and its host's receive path, so the sum is what must fit
their queues; per aggregator, four aggregators put four times as many
results in flight, past a CPU's receive backlog (1000 frames), and the
excess was dropped and resent."""
from __future__ import annotations

import pytest

from xagg.client.config import DEFAULT_WINDOW_BYTES, MIN_WINDOW, ClientConfig
from xagg.wire.proto import max_vals, packet_dtype


def _window(n_aggs: int, mtu: int) -> tuple[int, int]:
    cfg = ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=4, aggregators=["127.0.0.1"] * n_aggs,
                       vals=max_vals(mtu))
    return cfg.window, packet_dtype(cfg.vals).itemsize


@pytest.mark.parametrize("n_aggs", [1, 2, 4, 8])
def test_the_aggregators_share_one_byte_window(n_aggs):
    window, size = _window(n_aggs, 1500)
    assert window == max(MIN_WINDOW, DEFAULT_WINDOW_BYTES // n_aggs // size)
    assert n_aggs * window * size <= max(DEFAULT_WINDOW_BYTES, n_aggs * MIN_WINDOW * size)


def test_four_workers_of_four_aggregators_stay_under_a_cpu_backlog_at_mtu_1500():
    window, _ = _window(4, 1500)
    assert 4 * 4 * window < 1000            # net.core.netdev_max_backlog's default
    assert window >= MIN_WINDOW


def test_one_aggregator_keeps_the_whole_window():
    window, size = _window(1, 1500)
    assert window == DEFAULT_WINDOW_BYTES // size
