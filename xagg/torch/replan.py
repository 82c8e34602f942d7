"""Re-planning between steps when the cluster's rates drift.

A job that ran ``--plan auto`` was split for the rates it started with. When
they change (an aggregator's link is throttled, a rack's uplink is shared
with another job), the split that was best can become the slowest part of
every step. Every ``every`` steps, rank 0 reads the current figures from a
*rates source* (``FileRates``: the plan-inputs file, which an operator, a
monitor, or ``xagg plan --probe --json`` keeps current; a re-read only when
it changed. ``ProbeRates``: that file, and between its changes what every
rank measures, one after the other, with a short probe of every aggregator
from its own host) and plans again. It switches only when the new split is predicted
at least ``min_gain`` faster than the current one *under the new figures*
(hysteresis: noise in the figures must not make the job flap between splits).
With the probe on, the first check comes at the end of the first step: the
figures the job was planned from are measured as soon as its aggregators
are registered and every rank is in step, then again every ``every`` steps.

**All ranks switch at the same step.** The check is one collective on the
engine's private group at the end of step s (every rank runs it: the engine
calls ``between_steps`` at the same place of the same step everywhere, with
its aggregator set, aggregator_set.py). It carries rank 0's proposal (the
weights as integers, so every rank decodes the same bits: agreement.py
``post_replan``), whether any rank failed a bucket of step s (then nobody
switches: the step's agreement will move the job to gloo anyway) and the
highest round. Rank 0 then registers the new split with every aggregator's
daemon (a replace plus a reset: no slot keeps a partial sum of the old
split; one planned out before, dead or with no chunk of the old split, is
tried again, and one that cannot be reached is planned out) and a second
collective tells every rank whether that worked and which set it got. Every
rank takes the new weights from step s + 1 on and moves its rounds past
every round used. If the registration failed, every rank goes to gloo (the
fallback's back-off, whose retry registers the job again with the old
split).

Trees are re-planned too: the proposal is the planner's best xagg plan for
the new figures, flat or two-level, and its routes travel in the same
collective (each route + 1: zeros mean a flat plan); every rank then
rebuilds its clients for the new routes (another address book: each share
to its root or through a child). The job keeps its fan-out. The planner is
deterministic and runs on rank 0 only, so the ranks never disagree on what
was planned.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

from xagg.client.probe import probe_from_here
from xagg.torch import agreement
from xagg.torch.fallback import agree_max
from xagg.wire import planner, planner_inputs, planner_model, probe

log = logging.getLogger("xagg.torch")

CHECK_EVERY = 20            # steps between checks of the rates source
MIN_GAIN = 0.10             # switch only when predicted >= 10% faster under the new figures


class FileRates:
    """The plan-inputs file (docs/planner.md's format, or `xagg plan --json`
    output) as a rates source: its figures when it changed since the last
    read, else None. A file that cannot be read or parsed is reported once
    and skipped (training goes on with the current split)."""

    def __init__(self, path: str):
        self.path = path
        self._seen = self._stamp()      # the figures the job was planned from: not a change

    def _stamp(self):
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def __call__(self) -> planner_inputs.PlanInputs | None:
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            with open(self.path) as f:
                d = json.load(f)
            return planner_inputs.inputs_from_dict(d.get("inputs", d) if isinstance(d, dict) else d)
        except (OSError, ValueError) as e:      # PlanInputError is a ValueError
            log.warning("xagg: re-plan: %s: %s; keeping the current split", self.path, e)
            return None


class ProbeRates:
    """The plan-inputs file, and between its changes what the ranks measure:
    at each check every rank in turn (``measure``, rank r as the inputs'
    worker r) probes every aggregator from its own host with a short probe
    job (xagg.client.probe.probe_from_here), and rank 0 reports the figures
    all their samples show wrong (xagg.wire.probe.drifted: solo probes prove
    an aggregator slower than its figure when even the fastest worker saw it
    so, faster up to the fastest sampling worker's rate; a worker's link
    likewise). A file change wins over the probe. A probe's traffic shares
    the links with nothing: the other ranks wait in the check's barrier."""

    def __init__(self, path: str, config, mb: float):
        self.file, self.config, self.mb = FileRates(path), config, mb
        with open(path) as f:
            d = json.load(f)
        self.base = planner_inputs.inputs_from_dict(d.get("inputs", d) if isinstance(d, dict) else d)
        self.probe = probe_from_here

    def measure(self, rank: int) -> list[probe.Sample]:
        """This rank's solo samples of every aggregator ([] if it has no
        worker in the inputs, or the probe failed: training goes on)."""
        if rank >= len(self.base.workers):
            return []
        names = [a.name for a in self.base.aggregators]
        try:
            return self.probe(self.config.aggregators, self.config.control, self.config.token, names,
                              self.base.workers[rank].name, self.mb)
        except Exception as e:      # noqa: BLE001 - a failed probe must not stop training
            log.warning("xagg: re-plan: rank %d's probe failed (%s); its samples are left out", rank, e)
            return []

    def __call__(self, samples: list | None = None) -> planner_inputs.PlanInputs | None:
        """On rank 0: new figures from the file, else from ``samples`` (every
        rank's; None: rank 0 probes alone, as a single process does)."""
        new = self.file()
        if new is None:
            samples = self.measure(0) if samples is None else samples
            new = probe.drifted(self.base, samples) if samples else None
        if new is not None:
            self.base = new
        return new


def proposal(inputs: planner_inputs.PlanInputs, current: list[float], min_gain: float = MIN_GAIN,
             routes: list | None = None) -> tuple[list[float], list | None] | None:
    """(weights, routes: None for flat) of the best xagg plan for ``inputs``
    when it is predicted at least ``min_gain`` faster than the current split
    and ``routes`` (None: flat) under the same inputs; else None. Where gloo
    would win, its best xagg plan is still the one scored (switching
    transports mid-run is the fallback's); the fan-out stays the job's."""
    best = planner.make_plan(dataclasses.replace(inputs, result_choices=()))
    new = best.weights
    if len(new) != len(current) or (routes is not None and len(routes[0]) != len(current)):
        return None
    tree = best.routes if any(c != p for row in best.routes for p, c in enumerate(row)) else None
    now_s, _ = planner_model.predict(inputs, planner.registrable(current, inputs.n_chunks), routes)
    new_s, _ = planner_model.predict(inputs, new, tree)
    return (list(new), tree) if new_s <= now_s * (1 - min_gain) else None


class Replanner:
    def __init__(self, source, every: int = CHECK_EVERY, min_gain: float = MIN_GAIN, first: int | None = None):
        self.source, self.every, self.min_gain = source, every, min_gain
        self.first = first              # a step also checked at its end (0: the probe at registration)
        self.replans = 0                # switches made (every rank counts the same)

    @classmethod
    def from_env(cls, state, env=os.environ) -> "Replanner | None":
        """The job's re-planner, or None: only a ``--plan auto`` job that
        registers and has its figures in a file
        (``XAGG_PLAN_INPUTS``) is re-planned. ``XAGG_REPLAN_EVERY`` sets the
        interval in steps (0: never); ``XAGG_REPLAN_PROBE_MB`` > 0 has every
        rank in turn also probe the aggregators at each check, with calls of
        that size, and check at the end of the first step too (the probe at
        registration)."""
        cfg = state.config
        path = env.get("XAGG_PLAN_INPUTS")
        if cfg.plan != "auto" or not cfg.registers or not path:
            return None
        every = int(env.get("XAGG_REPLAN_EVERY", CHECK_EVERY))
        probe_mb = float(env.get("XAGG_REPLAN_PROBE_MB", 0))
        if every <= 0:
            return None
        if probe_mb > 0:
            return cls(ProbeRates(path, cfg, probe_mb), every, first=0)
        return cls(FileRates(path), every)

    def _probe_in_turn(self, aggs) -> list:
        """Every rank's probe, one rank at a time (a probe measures its host's
        path alone), and every rank's samples on every rank."""
        import torch.distributed as dist
        mine = []
        for r in range(aggs.world):
            if aggs.rank == r:
                mine = self.source.measure(r)
            dist.barrier(group=aggs.group)
        every = [None] * aggs.world
        dist.all_gather_object(every, [dataclasses.asdict(s) for s in mine], group=aggs.group)
        return [probe.Sample(**d) for ranks in every for d in ranks]

    def between_steps(self, aggs, step: int, failed_here: bool) -> None:
        """At the end of step ``step`` (in xagg mode, on every rank, in the
        same order as the engine's other collectives), on the engine's
        aggregator set ``aggs``."""
        if step != self.first and step % self.every != self.every - 1:
            return
        st, cfg = aggs.state, aggs.state.config
        m = len(cfg.aggregators)
        current = cfg.weights or [1.0] * m
        samples = self._probe_in_turn(aggs) if hasattr(self.source, "measure") else None
        new = None
        if aggs.rank == 0:
            inputs = self.source(samples) if samples is not None else self.source()
            new = proposal(inputs, current, self.min_gain, aggs.routes(0)) if inputs is not None else None
        workers = aggs.hosts.hosts          # the plan's workers: hosts where their ranks sum locally first
        d = agreement.decide_replan(
            agree_max(agreement.post_replan(new, failed_here, st.rounds, m, workers), aggs.group),
            len(st.rounds), m, workers)
        if not d.switch:
            return
        weights, routes = d.weights, d.routes
        old = cfg.weights, cfg.routes
        cfg.weights, cfg.routes = weights, routes
        # every aggregator again (one planned out for an empty share may have one now);
        # a daemon that cannot be reached is planned out (AggregatorSet.register)
        ok, why = aggs.register(out=0) if aggs.rank == 0 else (1, "")
        mine = [int(ok), aggs.proposed_out] if aggs.rank == 0 else [0, 0]
        ok, out = agree_max(mine, aggs.group)      # rank 0's answer
        st.rounds[:] = [t + 2 for t in d.rounds]    # past every round any rank used: no stale slot is met
        if not ok:
            cfg.weights, cfg.routes = old
            st.fallback.fail(aggs.rank, f"re-plan: registering the new split failed: {why}")
            return
        if routes != old[1] and not aggs.out and not out:     # a tree in, out or changed
            aggs.remake_clients()
        aggs.adopt(out)
        for lane in aggs.lanes:
            lane.client.cfg.weights = aggs.weights(aggs.out)
        self.replans += 1
        log.warning("xagg: rank %d: rates changed; re-planned after step %d: weights %s%s",
                    aggs.rank, step, ", ".join(f"{w:.3f}" for w in weights),
                    f"; tree routes {routes}" if routes else " (flat)")
