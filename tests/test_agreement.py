"""The per-step agreement (xagg/torch/agreement.py) as a table: what every
rank posts, the maximum the board takes, and what each rank decides. The
cases are the ones tests/test_torch_hook.py drives through real ranks. And
the aggregator set (xagg/torch/aggregator_set.py) that rank 0 registers and
every rank adopts, without processes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from xagg.torch import aggregator_set
from xagg.torch.aggregator_set import AggregatorSet

from xagg.torch.agreement import (KEEP, REDO, Agreed, ReplanDecision, RetryDecision, StepDecision, Switch, decide,
                                  decide_replan, decide_retry, from_rank, post, post_replan, post_retry, read,
                                  sooner)
from xagg.wire.registration import RegistrationError

BASE = 1000         # every lane's next round before the step, on every rank


def agree(posts: list[list[int]]) -> list[int]:
    """What the board reads: the elementwise maximum of every rank's post."""
    return [max(col) for col in zip(*posts)]


def settle(step: int, ranks: list[dict], retrying: bool = False) -> list[StepDecision]:
    """Every rank posts (``failed``: per bucket; ``rounds``: per lane, after
    the step; ``reason``: why it failed here) and decides on the maximum."""
    agreed = agree([post(r, x["failed"], x["rounds"]) for r, x in enumerate(ranks)])
    nb = len(ranks[0]["failed"])
    return [decide(read(agreed, nb), step, x["failed"], x["rounds"], x.get("reason", ""), retrying)
            for x in ranks]


def rank(failed: str, rounds=(BASE + 3,), reason: str = "") -> dict:
    """A rank's step: one letter per bucket, x summed here, f failed (or skipped)."""
    return dict(failed=[c == "f" for c in failed], rounds=list(rounds), reason=reason)


LOST = "no result for chunk 5 of round 1003"        # a client's own reason

CASES = {
    # every bucket summed on every rank: keep the sums, nothing switches
    "success everywhere": dict(
        step=7, ranks=[rank("xxx")] * 4,
        want=[StepDecision((KEEP, KEEP, KEEP), None, None, True)] * 4),
    # the aggregator died mid-round: rank 0 got every result, the others lost
    # the last bucket's; rank 0 broadcasts it, and since rank 0 did not wait,
    # every rank switches after the next step
    "success somewhere: take it from that rank": dict(
        step=5, ranks=[rank("xxx")] + [rank("xxf", reason=LOST)] * 3,
        want=[StepDecision((KEEP, KEEP, from_rank(0)), None,
                           Switch(6, "rank 3 got no answer from the aggregators", True), False)]
        + [StepDecision((KEEP, KEEP, from_rank(0)), (BASE + 3,), Switch(6, LOST, True), False)] * 3),
    # the highest rank that holds a sum broadcasts it: every rank names the same one
    "success on two ranks: the highest sends": dict(
        step=5, ranks=[rank("x"), rank("f", reason=LOST), rank("x"), rank("f", reason=LOST)],
        want=[StepDecision((from_rank(2),), None, Switch(6, "rank 3 got no answer from the aggregators", True),
                           False), StepDecision((from_rank(2),), (BASE + 3,), Switch(6, LOST, True), False)] * 2),
    # the aggregator is gone: no rank had any bucket, every rank waited, so
    # every rank switches after this very step and sums everything again
    "failed everywhere: redo over gloo, switch at once": dict(
        step=15, ranks=[rank("ff", reason=LOST)] * 4,
        want=[StepDecision((REDO, REDO), (BASE + 3,), Switch(15, LOST, True), False)] * 4),
    # lanes: rank 0 summed all three; rank 1 lost bucket 1 and skipped bucket 2
    # (its lanes start nothing after a failure), the others lost bucket 2
    "a failure skips the buckets after it": dict(
        step=9, ranks=[rank("xxx"), rank("xff", reason=LOST), rank("xxf", reason=LOST), rank("xxf", reason=LOST)],
        want=[StepDecision((KEEP, from_rank(3), from_rank(0)), None,
                           Switch(10, "rank 3 got no answer from the aggregators", True), False)]
        + [StepDecision((KEEP, from_rank(3), from_rank(0)), (BASE + 3,), Switch(10, LOST, True), False)] * 3),
    # no rank had all its buckets, though each bucket was summed somewhere
    "no rank had everything: switch at this step": dict(
        step=3, ranks=[rank("xf", reason=LOST), rank("fx", reason=LOST), rank("xf", reason=LOST),
                       rank("xf", reason=LOST)],
        want=[StepDecision((from_rank(3), from_rank(1)), (BASE + 3,), Switch(3, LOST, True), False)] * 4),
    # rank 0 had every result and redid one bucket's chunks (a missed exponent
    # prediction: a second round on lane 1); rank 1 lost that bucket and takes
    # lane 1's count from the agreement, lane by lane; rank 0 keeps its own
    "a second round for a missed prediction reaches a rank that failed": dict(
        step=4, ranks=[rank("xx", rounds=(BASE + 1, BASE + 2)), rank("xf", rounds=(BASE + 1, BASE + 1),
                                                                     reason=LOST)],
        want=[StepDecision((KEEP, from_rank(0)), None, Switch(5, "rank 1 got no answer from the aggregators",
                                                                  True), False),
              StepDecision((KEEP, from_rank(0)), (BASE + 1, BASE + 2), Switch(5, LOST, True), False)]),
    # after a back-off, on trial: a failure is a failed retry, not a new fallback
    "a failure while retrying": dict(
        step=20, retrying=True, ranks=[rank("f", reason=LOST)] * 2,
        want=[StepDecision((REDO,), (BASE + 3,), Switch(20, LOST, False), False)] * 2),
    # the same step succeeding while retrying: the recovery (fallback.succeeded)
    "success while retrying": dict(
        step=21, retrying=True, ranks=[rank("x")] * 2,
        want=[StepDecision((KEEP,), None, None, True)] * 2),
}


@pytest.mark.parametrize("name", CASES)
def test_every_rank_decides_the_step(name):
    case = CASES[name]
    got = settle(case["step"], case["ranks"], case.get("retrying", False))
    assert got == case["want"]
    # the collectives a decision names are the same on every rank
    assert len({d.fates for d in got}) == 1


def test_a_post_reads_back_field_by_field():
    assert read(post(2, [True, False], [7, 9]), 2) == Agreed((3, 0), (0, 3), False, (7, 9))
    assert read(post(0, [False], [5]), 1) == Agreed((0,), (1,), True, (5,))


@pytest.mark.parametrize("pending,new,want", [
    (None, None, None),
    (None, Switch(6, "b", True), Switch(6, "b", True)),
    (Switch(6, "a", True), None, Switch(6, "a", True)),
    (Switch(6, "a", True), Switch(5, "b", True), Switch(5, "b", True)),   # every rank waited: sooner
    (Switch(6, "a", True), Switch(6, "b", True), Switch(6, "a", True)),   # the first agreed stays
    (Switch(5, "a", True), Switch(7, "b", True), Switch(5, "a", True)),
])
def test_the_earlier_switch_wins(pending, new, want):
    assert sooner(pending, new) == want


@pytest.mark.parametrize("name,ranks,want", [
    # rank 0 registered again; every lane's rounds go past every round used
    ("every rank back", [(False, [10, 20], 0), (False, [12, 18], 0)], RetryDecision(True, (14, 22), 0)),
    # rank 0 could not register: the back-off goes on, nothing else changes
    ("rank 0 could not register", [(True, [10], 0), (False, [12], 0)], RetryDecision(False, None, 0)),
    # rank 0's registration planned aggregator 1 out: every rank adopts that set,
    # whatever the others posted for it
    ("the set rank 0 registered is adopted", [(False, [10], 0b10), (False, [10], 0b01), (False, [11], 0)],
     RetryDecision(True, (13,), 0b10)),
])
def test_the_retry_after_a_back_off(name, ranks, want):
    agreed = agree([post_retry(r, failed, rounds, out) for r, (failed, rounds, out) in enumerate(ranks)])
    assert decide_retry(agreed) == want


TREE = [[0, 0], [0, 0], [0, 1], [0, 1]]      # ranks 0 and 1 send aggregator 1's chunks through aggregator 0


@pytest.mark.parametrize("name,proposal,failed,want", [
    # rank 0's split and tree reach every rank bit for bit; rounds go past every rank's
    ("a tree proposed", ([0.25, 0.75], TREE), [False] * 4,
     ReplanDecision(True, (12, 9), [0.25, 0.75], TREE)),
    ("a flat split proposed", ([0.6, 0.4], None), [False] * 4, ReplanDecision(True, (12, 9), [0.6, 0.4], None)),
    # a bucket of the step failed somewhere: its agreement moves the job to gloo, no switch
    ("a rank failed the step", ([0.6, 0.4], None), [False, False, True, False],
     ReplanDecision(False, (12, 9), None, None)),
    ("nothing proposed", None, [False] * 4, ReplanDecision(False, (12, 9), None, None)),
])
def test_the_re_plan_check(name, proposal, failed, want):
    rounds = [(10, 9), (12, 8), (11, 9), (12, 9)]
    posts = [post_replan(proposal if r == 0 else None, failed[r], rounds[r], 2, 4) for r in range(4)]
    assert decide_replan(agree(posts), lanes=2, aggregators=2, world=4) == want


def job_on(n_aggs: int, weights=None) -> AggregatorSet:
    """Rank 0's aggregator set of a 4-rank job on ``n_aggs`` aggregators."""
    cfg = SimpleNamespace(aggregators=[f"10.0.0.{k}:9000" for k in range(n_aggs)], weights=weights, routes=None,
                          lanes=2, token=None, control=[f"ctl{k}" for k in range(n_aggs)])
    aggs = AggregatorSet(SimpleNamespace(config=cfg, job_id=5, cookie=6, vals=None), None, 0, 4)
    aggs.request = {"aggregators": [{"addr": a} for a in cfg.aggregators]}
    return aggs


def daemons_down(monkeypatch, down: set) -> list:
    """register_job answering like daemons of which those in ``down`` cannot be
    reached: the weights of every registration that went through."""
    done = []

    def register_job(control, token, req, *, workers_by_agg=None, routes=None):
        for k, a in enumerate(req["aggregators"]):
            if a["weight"] and k in down:
                raise RegistrationError(f"aggregator {k}: daemon unavailable", aggregator=k)
        done.append([a["weight"] for a in req["aggregators"]])
        return 256
    monkeypatch.setattr(aggregator_set, "register_job", register_job)
    return done


def test_a_dead_aggregator_is_planned_out_and_the_rest_registered(monkeypatch):
    aggs = job_on(3, weights=[1.0, 2.0, 1.0])
    done = daemons_down(monkeypatch, {1})
    assert aggs.register() == (1, "")
    assert aggs.proposed_out == 0b010 and aggs.out == 0         # proposed; every rank adopts it later
    assert done == [[1.0, 0.0, 1.0]] * 2                        # both lanes' jobs, without aggregator 1
    assert aggs.state.vals == 256


def test_no_aggregator_left_is_a_failed_registration(monkeypatch):
    aggs = job_on(2)
    daemons_down(monkeypatch, {0, 1})
    ok, why = aggs.register()
    assert not ok and "daemon unavailable" in why and aggs.proposed_out == 0


def test_adopting_a_set_gives_every_lane_its_weights():
    aggs = job_on(2)
    aggs.lanes = [SimpleNamespace(client=SimpleNamespace(cfg=SimpleNamespace(weights=[1.0, 1.0]))) for _ in range(2)]
    aggs.adopt(0b01)
    assert aggs.out == 0b01 and [lane.client.cfg.weights for lane in aggs.lanes] == [[0.0, 1.0]] * 2
    aggs.adopt(0)
    assert [lane.client.cfg.weights for lane in aggs.lanes] == [[1.0, 1.0]] * 2
