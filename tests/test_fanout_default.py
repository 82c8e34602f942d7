"""The hook's default fan-out ("auto") as units: the decision table
(xagg.wire.fanout.choose), the setting at its doors, and what the first
round's probe sends. tests/test_fanout_default_lab.py runs the default on
the XDP program: a group that delivers, and one a switch drops."""
from __future__ import annotations

import pytest

from xagg.torch.config import HookConfig, HookConfigError
from xagg.torch.result_path import agree, probe_elements
from xagg.wire import chunks
from xagg.wire.fanout import AUTO, DEFAULT_GROUP, Fanout, Reach, ResultPath, choose
from xagg.wire.registration import reach

AGGS = ["10.1.0.101:9977", "10.1.0.102:9977"]
GROUP = ResultPath(Fanout.BCAST, DEFAULT_GROUP)
UNICAST = ResultPath(Fanout.UNICAST)


def link(host: int) -> Reach:
    return Reach(f"10.1.0.{host}", "link")


def flat(workers: int, aggs: int = 2) -> list:
    return [[link(w + 1)] * aggs for w in range(workers)]


def with_cell(rows, w, k, r):
    rows = [list(row) for row in rows]
    rows[w][k] = r
    return rows


# name -> (reach[w][k], the path, words the reason must hold)
TABLE = {
    "every worker on every aggregator's segment": (flat(4), GROUP, "every worker is on each aggregator's own"),
    "one worker behind a router": (with_cell(flat(4), 2, 1, Reach("10.2.0.3", "router")), UNICAST,
                                   "worker 2 reaches aggregator 1 (10.1.0.102:9977) through a router"),
    "a worker on an aggregator's host": (with_cell(flat(4), 0, 0, Reach("10.1.0.101", "local")), UNICAST,
                                         "worker 0 reaches aggregator 0 (10.1.0.101:9977) on its own host"),
    "a worker with no route": (with_cell(flat(4), 3, 0, Reach()), UNICAST, "worker 3 reaches aggregator 0"),
    "two ranks on one host": (with_cell(flat(4), 3, 1, link(2)), UNICAST, "workers 1 and 3 share address 10.1.0.2"),
    "one worker": (flat(1), GROUP, "every worker"),
}


@pytest.mark.parametrize("name", TABLE)
def test_the_default_fanout_decision(name):
    rows, want, why = TABLE[name]
    path, reason = choose(rows, AGGS)
    assert path == want and why in reason


def test_the_group_auto_picks_is_the_one_given():
    assert choose(flat(2), AGGS, "239.1.2.3")[0] == ResultPath(Fanout.BCAST, "239.1.2.3")
    assert choose(with_cell(flat(2), 0, 0, Reach("10.9.0.1", "router")), AGGS, "239.1.2.3")[0] == UNICAST


def test_a_reach_row_must_cover_every_aggregator():
    with pytest.raises(ValueError, match=r"reach\[1\]: one Reach per aggregator \(2\), got 1"):
        choose([[link(1)] * 2, [link(2)]], AGGS)
    with pytest.raises(ValueError, match="Reach.via must be one of"):
        Reach("10.1.0.1", "bridge")


def test_this_hosts_own_address_is_local():
    assert reach("127.0.0.1:9977") == Reach("127.0.0.1", "local")


BASE = dict(aggregators="127.0.0.1:9000", control="/run/x.sock")


def test_auto_is_the_hooks_default_at_every_door():
    cfg = HookConfig(**BASE)
    assert cfg.fanout == AUTO and "XAGG_FANOUT" not in cfg.to_env()
    assert HookConfig.from_env({**cfg.to_env(), "XAGG_FANOUT": "auto"}).fanout == AUTO
    # a group for auto to pick, but a group with unicast is still refused
    assert HookConfig(**BASE, result_group="239.1.2.3").result_group == "239.1.2.3"
    with pytest.raises(HookConfigError, match="^result_group: needs fanout 'bcast'"):
        HookConfig(**BASE, fanout="unicast", result_group="239.1.2.3")
    with pytest.raises(HookConfigError, match="^fanout: must be one of auto, bcast, unicast, got 'multicast'"):
        HookConfig(**BASE, fanout="multicast")


def test_a_client_config_needs_the_path_auto_chose():
    cfg = HookConfig(**BASE)
    agreed = dict(job_id=1, cookie=2, worker_id=0, n_workers=2, result_port=9979, weights=[1.0], vals=64, route=None)
    with pytest.raises(ValueError, match="fanout 'auto' is resolved at registration"):
        cfg.client_config(**agreed)
    c = cfg.client_config(**agreed, results=GROUP)
    assert (c.fanout, c.result_group) == ("bcast", DEFAULT_GROUP)


def test_a_fanout_set_by_name_is_kept_and_not_checked():
    c = agree(HookConfig(**BASE, fanout="bcast", result_group="239.1.2.3"), None, 1, [0])
    assert c.path == ResultPath(Fanout.BCAST, "239.1.2.3") and not c.check
    c = agree(HookConfig(**BASE, fanout="unicast"), None, 1, [0])
    assert c.path == UNICAST and not c.check
    c = agree(HookConfig(**BASE, routes=[[0]]), None, 1, [0])
    assert c.path == UNICAST and not c.check and "tree" in c.why
    # a job the operator registered: its ranks cannot know better than the daemon's default
    c = agree(HookConfig(aggregators="127.0.0.1:9000", job_id=1, cookie=2), None, 1, [0])
    assert c.path == UNICAST and not c.check and "operator" in c.why


@pytest.mark.parametrize("weights,vals,cap", [([1.0], 360, None), ([1.0] * 4, 360, None),
                                              ([10.0, 1.0, 0.0, 1.0], 360, None), ([1.0, 1.0], 360, 100)])
def test_the_probe_reaches_every_aggregator_with_a_share(weights, vals, cap):
    n = probe_elements(weights, vals, cap)
    if cap is not None:
        assert n <= cap
        return
    got = chunks.split(-(-n // vals), weights)
    assert all((hi > lo) == bool(w) for (lo, hi), w in zip(got, weights))
