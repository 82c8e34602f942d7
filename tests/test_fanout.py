"""The one fan-out type (xagg/wire/fanout.py): the enum is the C program's
constants, labels are parsed at the door and written back out, and the
planner's three cost models are the three kinds of result path."""
from __future__ import annotations

import json

import pytest

from xagg.wire.fanout import DEFAULT_GROUP, MODELS, Fanout, ResultPath
from xagg.wire.jobspec import JobError, JobSpec
from xagg.wire.proto import C


def test_the_enum_is_the_c_constants():
    consts = {k[len("XAGG_FANOUT_"):]: v for k, v in vars(C).items() if k.startswith("XAGG_FANOUT_")}
    assert {f.name: f.value for f in Fanout} == consts


@pytest.mark.parametrize("label", ["bcast", "unicast"])
def test_labels_parse_and_print_back(label):
    f = Fanout.parse(label)
    assert f.label == label and str(f) == label and f"{f}" == label and Fanout.parse(f) is f


@pytest.mark.parametrize("bad", ["mcast", "BCAST", 0, None])
def test_anything_else_is_refused_with_the_labels(bad):
    with pytest.raises(ValueError, match="must be one of bcast, unicast"):
        Fanout.parse(bad)


def test_a_job_takes_a_label_and_holds_the_enum():
    spec = JobSpec(job_id=1, cookie=2, n_workers=2, n_chunks=1, fanout="bcast")
    assert spec.fanout is Fanout.BCAST
    with pytest.raises(JobError, match="^fanout: must be one of bcast, unicast, got 'multicast'"):
        JobSpec(job_id=1, cookie=2, n_workers=2, n_chunks=1, fanout="multicast")


def test_the_control_client_writes_labels_not_numbers():
    from xagg.wire.registration import job_request
    req = job_request(job_id=1, cookie=2, workers=["10.0.0.1"], max_elements=10, aggregators=["10.0.0.2:9977"],
                      weights=None, fanout=Fanout.BCAST)
    assert json.loads(json.dumps(req))["fanout"] == "bcast"


@pytest.mark.parametrize("model,path,reaches_aggregators,one_frame", [
    ("bcast", ResultPath(Fanout.BCAST), True, True),
    ("mcast", ResultPath(Fanout.BCAST, DEFAULT_GROUP), False, True),
    ("unicast", ResultPath(Fanout.UNICAST), False, False),
])
def test_the_planners_models_are_result_paths(model, path, reaches_aggregators, one_frame):
    assert ResultPath.from_model(model) == path and path.model == model
    assert path.reaches_aggregators is reaches_aggregators and path.one_frame is one_frame
    assert ResultPath(Fanout.BCAST, "239.1.2.3").model == "mcast"        # any group is the mcast model
    assert set(MODELS) == {"bcast", "mcast", "unicast"}


def test_a_group_needs_a_broadcast_fanout():
    with pytest.raises(ValueError, match="needs fan-out 'bcast'"):
        ResultPath(Fanout.UNICAST, DEFAULT_GROUP)
    with pytest.raises(ValueError, match=r"must be one of \['bcast', 'mcast', 'unicast'\]"):
        ResultPath.from_model("multicast")
