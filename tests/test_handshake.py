"""The probe packet a client sends each aggregator before its first sum
(xagg/client/handshake.py, bpf/xagg_probe.h): the XDP program attached by
xaggd in a lab answers, from the worker's namespace, with its values per
packet and its verdict on the job and cookie; the userspace aggregator
answers the same; and the one-line problems a client reports from them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xagg.client.handshake import Answer, problem, question, read_answer
from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C
from xaggd.dataplane.userspace import UserspaceAggregator

VALS = 120
ASK = ("import json, sys; from xagg.client.handshake import ask; "
       "a = ask(sys.argv[1:2], int(sys.argv[2]), int(sys.argv[3])); "
       "print(json.dumps({k: v and v.__dict__ for k, v in a.items()}))")


def ask_from(lab, host, addr, job_id, cookie) -> dict | None:
    out = lab.exec(host, [sys.executable, "-c", ASK, addr, str(job_id), str(cookie)],
                   capture_output=True, text=True, check=True).stdout
    return json.loads(out)[addr]


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"hs{os.getpid() % 100000}", workers=1, aggregators=1)) as lab, \
            Aggregators(lab, "xdp", max_slots=256, vals=VALS) as aggs:
        aggs.register(31, cookie=0xBEEF, n_workers=1, max_elements=1000)
        yield lab, aggs


def test_the_xdp_program_answers_a_probe_with_its_values_per_packet(lab):
    lab, aggs = lab
    addr = f"{lab.host('a0').ip}:{C.XAGG_PORT}"
    before = aggs.counters()[0]
    w = lab.workers[0]
    assert ask_from(lab, w, addr, 31, 0xBEEF) == {"addr": addr, "vals": VALS, "verdict": "probed",
                                                  "version": C.XAGG_VERSION}
    assert ask_from(lab, w, addr, 31, 1)["verdict"] == "bad_cookie"
    assert ask_from(lab, w, addr, 32, 0xBEEF)["verdict"] == "unknown_job"
    after = aggs.counters()[0]
    assert after["probed"] - before.get("probed", 0) == 3, after
    assert after.get("malformed", 0) == before.get("malformed", 0)      # nothing else was dropped


def test_a_port_with_no_aggregator_gives_no_answer(lab):
    lab, _ = lab
    assert ask_from(lab, lab.workers[0], f"{lab.host('a0').ip}:{C.XAGG_PORT + 1}", 31, 0xBEEF) is None


def test_the_userspace_aggregator_answers_as_the_program_does():
    agg = UserspaceAggregator(vals=VALS)
    agg.set_job(JobSpec(job_id=31, cookie=0xBEEF, n_chunks=4, n_workers=1))
    for (job, cookie), verdict in {(31, 0xBEEF): "probed", (31, 1): "bad_cookie", (9, 0xBEEF): "unknown_job"}.items():
        counted, replies = agg.handle(question(job, cookie), ("10.0.0.2", 5555))
        assert counted == "probed" and [r.dest for r in replies] == [("10.0.0.2", 5555)]
        assert read_answer("a", replies[0].payload) == Answer("a", VALS, verdict, C.XAGG_VERSION)
    assert agg.counters["probed"] == 3


def test_an_answer_from_another_wire_version_says_so():
    q = bytearray(question(1, 2))
    q[4] = C.XAGG_VERSION + 1
    assert read_answer("a", bytes(q)) == Answer("a", 0, "malformed", C.XAGG_VERSION + 1)
    assert read_answer("a", b"not xagg") is None


@pytest.mark.parametrize("answers, vals, says", [
    ({"a:1": None}, None, "aggregator a:1 did not answer a probe"),
    ({"a:1": Answer("a:1", 100, "unknown_job", 1)}, None, "aggregator a:1 has no job 7 (check --job-id"),
    ({"a:1": Answer("a:1", 100, "bad_cookie", 1)}, None, "another cookie (check --cookie)"),
    ({"a:1": Answer("a:1", 100, "probed", 1), "b:1": Answer("b:1", 120, "probed", 1)}, None,
     "different values per packet: a:1 100, b:1 120"),
    ({"a:1": Answer("a:1", 100, "probed", 1)}, 120, "this client sends 120 (--vals), the aggregators sum 100"),
    ({"a:1": Answer("a:1", 100, "probed", 1)}, None, None),
    ({"a:1": Answer("a:1", 100, "probed", 1)}, 100, None),
])
def test_the_problem_is_one_line_naming_the_setting(answers, vals, says):
    got = problem(answers, 7, vals)
    assert got == says if says is None else (says in got and "\n" not in got), got
