"""Lanes: several DDP buckets in flight at once, one xagg job per lane.

An aggregator keeps two slots per chunk, one per round parity
(bpf/xagg_slot.h slot_step), and every round of a job numbers its chunks
from 0. So within one job a worker may start round r + 2 only once every
worker has finished round r (it has: a worker starts r + 2 after it got all
of r + 1, which no worker sends before it got all of r). Two rounds of one
job in flight on one worker would break that rule: a worker still waiting
for a lost result of round r would find its slot superseded by another's
round r + 2 and time out.

Lanes keep the rule and still overlap: lane L is a job of its own (its own
slots at the aggregators, its own socket and result port on the worker),
whose rounds run one after another on the lane's thread; bucket i of a step
goes to lane i mod L on every rank. The job of lane 0 is the job itself;
lane L's id and result port follow from it, so an operator who registers
jobs by hand registers these too (``lane_jobs``).
"""
from __future__ import annotations

from xagg.wire.jobspec import DEFAULT_RESULT_PORT

MAX_LANES = 8


def lane_job_id(job_id: int, lane: int) -> int:
    """The job id lane ``lane`` runs on: the job's own for lane 0, then the
    next ids (mod 2**32, 0 skipped)."""
    return job_id if lane == 0 else (job_id - 1 + lane) % 0xFFFFFFFF + 1


def lane_result_port(lane: int, port: int = DEFAULT_RESULT_PORT) -> int:
    """The UDP port a broadcast fan-out sends lane ``lane``'s results to
    (each lane's socket binds its own)."""
    return port + lane


def lane_jobs(job_id: int, lanes: int, port: int = DEFAULT_RESULT_PORT) -> list[tuple[int, int]]:
    """(job id, result port) of every lane: what to register for a job run with ``lanes``."""
    return [(lane_job_id(job_id, k), lane_result_port(k, port)) for k in range(lanes)]
