"""The xagg DDP hook with real torch.distributed: 4 gloo ranks on 127.0.0.1
against a userspace aggregator (UserspaceServer) in this process.

The ranks are started once for the module (spawning 4 torch processes is the
slow part) and run one task per test; rank 0 can ask this process to act on
an aggregator (kill or restart a daemon) at a given step. Failures of the
data plane are injected at the step a test names (``Faults``), so a test's
path of steps is the same on every run however busy the machine: healthy
rounds wait long timeouts, and nothing races a clock.

With XAGG_TEST_DEVICE=cuda (`make gpu-test`) the ranks' models, inputs and
gradients live on the GPU (gloo reduces CUDA tensors through host memory), so
the hook's buckets are CUDA tensors; the checks compare on the CPU. The
userspace aggregator needs neither bcc nor root, so this file runs the CUDA
path on any CUDA host.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import pickle
import random
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_replicas import deterministic
from train_digits import batches, load_digits_data, make_model

from xagg.client import Client, XaggError
from xagg.client.fixedpoint import tolerance
from xagg.torch import XaggState, XaggStateError, attach, xagg_hook
from xagg.torch.lanes import lane_job_id
from xagg.wire import chunks
from xagg.wire.jobspec import JobSpec
from xaggd.dataplane.userspace import UserspaceAggregator, UserspaceServer

WORLD = 4
DEVICE = os.environ.get("XAGG_TEST_DEVICE", "cpu")
COOKIE = 0xC0DE
HEALTHY = 30.0      # a round's timeout that a healthy round never reaches, however busy the machine
P_TINY = sum(p.numel() for p in make_model("tiny").parameters())
CHUNKS_PER_ROUND = 1 + -(-P_TINY // 256)          # one meta chunk + the data chunks
assert chunks.meta_chunks(CHUNKS_PER_ROUND - 1, 256) == 1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# the aggregator side (this process)
# ---------------------------------------------------------------------------
def aggregator_for(job_ids, n_params=P_TINY, port=0):
    agg = UserspaceAggregator()
    for j in job_ids:
        agg.set_job(JobSpec(job_id=j, cookie=COOKIE, n_workers=WORLD, fanout="unicast",
                            n_chunks=chunks.capacity(n_params, 256, [1])[0]))
    return agg


def free_port(kind=socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A base port whose ``n`` ports from it are all free, below the
    ephemeral range (from which the ranks' own connections take theirs, so
    a free_port() + 1 can be taken by the time a rank binds it)."""
    for base in random.Random().sample(range(20_000, 32_000, n), 200):
        socks = []
        try:
            for p in range(base, base + n):
                socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


# ---------------------------------------------------------------------------
# the ranks
# ---------------------------------------------------------------------------
_ctl = None
_log: list[str] = []


class _ListHandler(logging.Handler):
    def emit(self, record):
        _log.append(record.getMessage())


def _rank_main(rank, port, inq, outq, ctl, ack):
    global _ctl
    import traceback
    _ctl = (ctl, ack)
    torch.set_num_threads(1)
    deterministic()
    lg = logging.getLogger("xagg.torch")
    lg.addHandler(_ListHandler())
    lg.setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    FAULTS.install(rank)
    while True:
        msg = inq.get()
        if msg is None:
            break
        name, kw = msg
        _log.clear()
        FAULTS.step, FAULTS.schedule = 0, kw.pop("faults", {})
        try:
            outq.put((rank, True, globals()[name](rank, **kw)))
        except BaseException:  # noqa: BLE001 - reported to the test
            outq.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Faults:
    """Failures injected into this rank's xagg sums, by training step, where
    the engine meets them: in ``Client.allreduce``, raising what a real
    failure raises. A test names, per step:

    ("lost", k)  every rank sums bucket k (None: every sum) through the
                 aggregator, then every rank but 0 loses the result, as when
                 the aggregator dies after answering rank 0 only;
    "down"       every sum of the step fails at once, nothing sent, as when
                 no aggregator answers (without waiting for the timeout)."""

    def __init__(self):
        self.rank, self.step, self.schedule = 0, 0, {}

    def install(self, rank: int) -> None:
        self.rank, real = rank, Client.allreduce

        def allreduce(client, x, *args, **kw):
            what = self.schedule.get(self.step)
            if what == "down":
                raise XaggError(f"job {client.cfg.job_id}: no result from the aggregators (injected)")
            out = real(client, x, *args, **kw)
            if isinstance(what, tuple) and what[1] in (None, kw.get("key")) and self.rank != 0:
                raise XaggError(f"job {client.cfg.job_id}: no result for the last chunk (injected loss)")
            return out
        Client.allreduce = allreduce


FAULTS = Faults()


def down(first: int, last: int) -> dict:
    """Steps ``first`` to ``last`` with no aggregator answering."""
    return {s: "down" for s in range(first, last + 1)}


def ask(rank, request):
    """Rank 0 has the test process act on the aggregator; all ranks wait for it."""
    if rank == 0:
        _ctl[0].put(request)
        _ctl[1].get()
    dist.barrier()


class Ranks:
    def __init__(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.inq = [ctx.Queue() for _ in range(WORLD)]
        self.outq, self.ctl, self.ack = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, port, self.inq[r], self.outq, self.ctl, self.ack),
                                  daemon=True) for r in range(WORLD)]
        for p in self.procs:
            p.start()

    def run(self, fn, on_request=None, **kw) -> list:
        for q in self.inq:
            q.put((fn.__name__, kw))
        results = {}
        while len(results) < WORLD:
            while not self.ctl.empty():
                on_request(self.ctl.get())
                self.ack.put(True)
            try:
                rank, ok, res = self.outq.get(timeout=0.05)
            except Exception:  # queue.Empty
                if not all(p.is_alive() for p in self.procs):
                    raise AssertionError("a rank process died") from None
                continue
            assert ok, f"rank {rank} failed:\n{res}"
            results[rank] = res
        return [results[r] for r in range(WORLD)]

    def close(self):
        for q in self.inq:
            q.put(None)
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def ranks():
    if DEVICE != "cpu" and not torch.cuda.is_available():
        pytest.fail(f"XAGG_TEST_DEVICE={DEVICE}, but torch {torch.__version__} sees no CUDA device")
    r = Ranks()
    yield r
    r.close()


# ---------------------------------------------------------------------------
# tasks run by every rank
# ---------------------------------------------------------------------------
_data = {}


def data(rank):
    if rank not in _data:
        _data[rank] = load_digits_data(rank, WORLD)
    return _data[rank]


def tiny(seed=0, dtype=None) -> torch.nn.Module:
    """The tiny CNN on the test's device (with ``dtype``, that too)."""
    return make_model("tiny", seed).to(DEVICE, dtype)


def step_batches(rank, n_steps, batch=32, seed=0):
    (x, y), _ = data(rank)
    out, epoch = [], 0
    while len(out) < n_steps:
        out += [(x[i], y[i]) for i in batches(len(x), batch, seed, epoch)]
        epoch += 1
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in out[:n_steps]]


def local_grad_max(model_params, x, y, dtype=torch.float32) -> float:
    """max |local gradient| over all ranks, from a plain copy of the model."""
    m = tiny(dtype=dtype)
    with torch.no_grad():
        for p, q in zip(m.parameters(), model_params):
            p.copy_(q)
    F.cross_entropy(m(x.to(dtype)).float(), y).backward()
    t = torch.tensor([max(p.grad.abs().max().item() for p in m.parameters())])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def sgd_step(model, opt, x, y, dtype=torch.float32):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x.to(dtype)).float(), y)
    loss.backward()
    opt.step()
    return loss.item()


def resync(dst, src):
    with torch.no_grad():
        for p, q in zip(dst.parameters(), src.parameters()):
            p.copy_(q)


def params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).cpu()


def task_parity(rank, agg, job_free, job_check, steps, lr):
    """A: DDP's default all-reduce; B: xagg, free running; C: xagg, reset to A's
    parameters before every step, so each step checks one aggregation exactly."""
    A, B, C = (DDP(tiny()) for _ in range(3))
    sB = attach(B, [agg], job_id=job_free, cookie=COOKIE, timeout=30)
    sC = attach(C, [agg], job_id=job_check, cookie=COOKIE, timeout=30)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (A, B, C)]
    worst = 0.0
    for x, y in step_batches(rank, steps):
        resync(C, A)
        gmax = local_grad_max(list(A.parameters()), x, y)
        pmax = params(A).abs().max().item()
        for m, o in zip((A, B, C), opts):
            sgd_step(m, o, x, y)
        # xagg's fixed-point error and gloo's float32 rounding, through one SGD step,
        # plus float32 rounding of the update itself
        bound = lr * 2 * tolerance(gmax, WORLD) / WORLD + pmax * 2.0 ** -22
        diff = (params(C) - params(A)).abs().max().item()
        assert diff <= bound, f"step: |C - A| = {diff:.3g} > fixed-point bound {bound:.3g}"
        worst = max(worst, diff / bound)
    (_, _), (xt, yt) = data(rank)
    acc = [float((m.module(xt.to(DEVICE)).argmax(1).cpu() == yt).float().mean()) for m in (A, B)]
    out = dict(worst=worst, acc_gloo=acc[0], acc_xagg=acc[1],
               drift=(params(B) - params(A)).abs().max().item(), statsB=sB.snapshot(), statsC=sC.snapshot())
    sB.close(), sC.close()
    return out


def test_parity_with_ddp_default_allreduce(ranks):
    jobs = (11, 12)
    with UserspaceServer(aggregator_for(jobs), "127.0.0.1", 0).start() as server:
        steps = 300
        res = ranks.run(task_parity, agg=f"127.0.0.1:{server.port}", job_free=jobs[0], job_check=jobs[1],
                        steps=steps, lr=0.3)
        completed = server.agg.counters["completed"]
    r0 = res[0]
    print(f"\nparity over {steps} steps: worst |C-A| / bound = {max(r['worst'] for r in res):.3f}; "
          f"free-running drift |B-A| = {r0['drift']:.3g}; test accuracy gloo {100 * r0['acc_gloo']:.2f}% "
          f"xagg {100 * r0['acc_xagg']:.2f}%")
    assert abs(r0["acc_gloo"] - r0["acc_xagg"]) <= 0.005
    assert r0["acc_xagg"] > 0.85                       # it really learned
    for r in res:
        for s in (r["statsB"], r["statsC"]):
            assert s["steps"] == steps and s["buckets_xagg"] == steps and s["fallbacks"] == 0
            assert s["buckets_gloo"] == 0
    # every step of both xagg models went through the aggregator, chunk by chunk
    # (chunks whose predicted exponent missed twice: at least the first step's)
    redone = res[0]["statsB"]["redone"] + res[0]["statsC"]["redone"]
    assert all(r[k]["redone"] == res[0][k]["redone"] for r in res for k in ("statsB", "statsC"))
    assert completed == 2 * steps * CHUNKS_PER_ROUND + redone and redone >= 2 * (CHUNKS_PER_ROUND - 1)


def task_incarnation(rank, agg, job, steps, lr=0.3):
    """One run of a job with a fixed id and cookie: xagg (reset to DDP's default
    all-reduce before each step, so each step checks one sum) and DDP's default."""
    A, C = DDP(tiny()), DDP(tiny())
    sC = attach(C, [agg], job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (A, C)]
    for x, y in step_batches(rank, steps):
        resync(C, A)
        gmax = local_grad_max(list(A.parameters()), x, y)
        pmax = params(A).abs().max().item()
        for m, o in zip((A, C), opts):
            sgd_step(m, o, x, y)
        bound = lr * 2 * tolerance(gmax, WORLD) / WORLD + pmax * 2.0 ** -22
        diff = (params(C) - params(A)).abs().max().item()
        assert diff <= bound, f"step: |C - A| = {diff:.3g} > fixed-point bound {bound:.3g}"
    out = sC.snapshot()
    sC.close()
    return out


def test_a_fixed_job_id_and_cookie_run_twice_sums_right_without_fallback(ranks):
    """The second run meets slots the first left (no reset in between, as with a
    job the operator registered): a new incarnation's rounds start at a fresh base
    agreed by the ranks, so its packets restart those slots instead of being
    dropped as stale (or answered with the old run's sums)."""
    job = 57
    with UserspaceServer(aggregator_for([job]), "127.0.0.1", 0).start() as server:
        agg = f"127.0.0.1:{server.port}"
        runs = [ranks.run(task_incarnation, agg=agg, job=job, steps=6) for _ in range(2)]
        stale = server.agg.counters["stale"]
    for res in runs:
        for s in res:
            assert s["steps"] == 6 and s["buckets_xagg"] == 6 and s["fallbacks"] == 0, s
    assert stale == 0


def task_dtypes(rank, agg, jobs, steps):
    out = {}
    for dtype, job in zip((torch.float16, torch.bfloat16), jobs):
        A, X = DDP(tiny(dtype=dtype)), DDP(tiny(dtype=dtype))
        sX = attach(X, [agg], job_id=job, cookie=COOKIE, timeout=30)
        worst = 0.0
        for x, y in step_batches(rank, steps):
            resync(X, A)
            gmax = local_grad_max(list(A.parameters()), x, y, dtype)
            for m in (A, X):
                m.zero_grad(set_to_none=True)
                F.cross_entropy(m(x.to(dtype)).float(), y).backward()
            gx = torch.cat([p.grad.reshape(-1).float() for p in X.parameters()]).cpu()
            ga = torch.cat([p.grad.reshape(-1).float() for p in A.parameters()]).cpu()
            assert all(p.grad.dtype == dtype for p in X.parameters())
            # xagg: exact-ish fp32 average rounded once to dtype; DDP: fp16/bf16 adds
            bound = tolerance(gmax, WORLD) / WORLD + WORLD * torch.finfo(dtype).eps * gmax
            diff = (gx - ga).abs().max().item()
            assert diff <= bound, f"{dtype}: |xagg - gloo| = {diff:.3g} > {bound:.3g}"
            worst = max(worst, diff / bound)
            with torch.no_grad():
                for m in (A, X):
                    for p in m.parameters():
                        p -= 0.1 * p.grad
        out[str(dtype)] = dict(worst=worst, stats=sX.snapshot())
        sX.close()
    return out


def test_fp16_and_bf16_buckets(ranks):
    jobs = (21, 22)
    with UserspaceServer(aggregator_for(jobs), "127.0.0.1", 0).start() as server:
        steps = 8
        res = ranks.run(task_dtypes, agg=f"127.0.0.1:{server.port}", jobs=jobs, steps=steps)
    for r in res:
        for dtype, d in r.items():
            s = d["stats"]
            assert s["buckets_xagg"] == steps and s["fallbacks"] == 0, dtype
            assert s["bytes_xagg"] == steps * P_TINY * 2, f"{dtype}: buckets were not 2-byte"
    print("\nfp16/bf16 worst |xagg-gloo| / bound:", {k: round(v["worst"], 3) for k, v in res[0].items()})


def checked_steps(rank, A, X, sX, steps, events, lr, slack=None):
    """Train A (DDP's default all-reduce) and X (through ``sX``'s aggregators),
    X reset to A before every step, so every step, on xagg or fallen back, is
    checked against the fixed-point bound. Returns (path per step: x for
    xagg, g for the fallback; A's losses)."""
    oA, oX = (torch.optim.SGD(m.parameters(), lr=lr) for m in (A, X))
    path, losses = "", []
    for step, (x, y) in enumerate(step_batches(rank, steps)):
        FAULTS.step = step
        if step in events:
            ask(rank, events[step])
        resync(X, A)
        gmax = local_grad_max(list(A.parameters()), x, y)
        pmax = params(A).abs().max().item()
        losses.append(sgd_step(A, oA, x, y))
        before = sX.stats["buckets_xagg"]
        sgd_step(X, oX, x, y)
        path += "x" if sX.stats["buckets_xagg"] > before else "g"      # this step's path
        bound = lr * 2 * tolerance(gmax, WORLD, slack=slack) / WORLD + pmax * 2.0 ** -22
        diff = (params(X) - params(A)).abs().max().item()
        assert diff <= bound, f"step {step} ({sX.mode}): |X - A| = {diff:.3g} > {bound:.3g}"
    return path, losses


def task_fallback(rank, agg, job, steps, lr=0.3):
    A, X = DDP(tiny()), DDP(tiny())
    sX = attach(X, [agg], job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02,
                backoff_steps=2, max_backoff_steps=4)
    path, losses = checked_steps(rank, A, X, sX, steps, {}, lr)
    out = dict(path=path, stats=sX.snapshot(), log=list(_log), losses=losses)
    sX.close()
    return out


def test_a_sum_only_rank_0_got_then_a_dead_aggregator_and_its_return(ranks):
    """Step 5: the aggregator answers rank 0 only: rank 0 keeps its sum and
    broadcasts it, and since rank 0 did not wait, every rank moves to gloo
    after step 6. Steps 6 to 24 no aggregator answers: every retry after a
    back-off (2, then 4 steps) fails, until the one after step 28."""
    job = 31
    steps = 40
    with UserspaceServer(aggregator_for([job]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_fallback, agg=f"127.0.0.1:{server.port}", job=job, steps=steps,
                        faults={5: ("lost", 0), **down(6, 24)})
        completed = server.agg.counters["completed"]
    print("\npath per step (x: xagg, g: gloo):", [r["path"] for r in res])
    # retries after steps 8, 13, 18, 23 fail on their first step; the one after 28 holds
    assert [r["path"] for r in res] == ["x" * 6 + "g" * 23 + "x" * 11] + ["x" * 5 + "g" * 24 + "x" * 11] * 3
    for rank, r in enumerate(res):
        s = r["stats"]
        assert s["steps"] == steps and s["fallbacks"] == 1 and s["recoveries"] == 1 and s["retries"] == 5, s
        # at step 5 rank 0 kept the aggregator's sum and the others took it from rank 0
        # (the parameter check proves they all applied the same gradient)
        assert (s["buckets_xagg"], s["buckets_gloo"]) == ((17, 23) if rank == 0 else (16, 24)), s
        assert sum("falling back to gloo" in m for m in r["log"]) == 1, r["log"]
        assert sum("retry failed" in m for m in r["log"]) == 4, r["log"]
        assert any("answer again" in m for m in r["log"]), r["log"]
    # the reason each rank logs: rank 0 had every sum of step 5, the others their own failure
    assert any("rank 3 got no answer" in m for m in res[0]["log"]), res[0]["log"]
    assert any("no result for the last chunk" in m for m in res[1]["log"]), res[1]["log"]
    # the 17 steps rank 0 summed went through the aggregator, chunk by chunk, and
    # again the chunks whose predicted exponent missed (gradients moved on while on gloo)
    assert completed == 17 * CHUNKS_PER_ROUND + res[0]["stats"]["redone"]
    losses = res[0]["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


class Gate:
    """A UserspaceAggregator that, once closed, answers nothing of job ``held``
    until a chunk of job ``opener`` is complete: with one bucket in flight at
    a time, a round of ``held`` waiting for one of ``opener`` never ends."""

    def __init__(self, agg: UserspaceAggregator, held: int, opener: int):
        self.agg, self.held, self.opener = agg, held, opener
        self.closed, self.withheld = False, 0

    def handle(self, payload, src):
        verdict, replies = self.agg.handle(payload, src)
        job = int.from_bytes(payload[8:12], "little") if len(payload) >= 12 else None
        if job == self.opener and verdict == "completed":
            self.closed = False
        if self.closed and job == self.held and replies:
            self.withheld += 1
            return verdict, []
        return verdict, replies


def multi_bucket_model():
    """The tiny model in 3 DDP buckets (650, 1,152 and 96 values)."""
    return DDP(tiny(), bucket_cap_mb=0.002)


def task_lanes(rank, agg, job, steps, events, lanes=2, lr=0.3, backoff=2):
    A, X = DDP(tiny()), multi_bucket_model()
    sX = attach(X, [agg], job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02, lanes=lanes,
                backoff_steps=backoff, max_backoff_steps=2 * backoff)
    path, _ = checked_steps(rank, A, X, sX, steps, events, lr)
    out = dict(path=path, stats=sX.snapshot(), log=list(_log))
    sX.close()
    return out


def test_buckets_of_a_step_are_in_flight_together_and_sum_like_ddp(ranks):
    """Two lanes: buckets 0 and 2 on job 61, bucket 1 on job 62. From step 3 the
    aggregator holds job 61's answers back until a chunk of job 62 is complete:
    lane 0's round of bucket 0 can only end because lane 1's round of bucket 1
    is in flight beside it (one bucket at a time, the step would time out)."""
    job = 61
    jobs = [lane_job_id(job, k) for k in range(2)]
    gate = Gate(aggregator_for(jobs), held=jobs[0], opener=jobs[1])
    steps = 12

    def on_request(req):
        gate.closed = True

    with UserspaceServer(gate, "127.0.0.1", 0).start() as server:
        res = ranks.run(task_lanes, on_request=on_request, agg=f"127.0.0.1:{server.port}", job=job,
                        steps=steps, events={3: "close the gate"})
    for r in res:
        s = r["stats"]
        assert r["path"] == "x" * steps and s["fallbacks"] == 0, (r["path"], s)
        assert s["max_in_flight"] >= 2, s
        assert s["buckets_xagg"] >= 3 * (steps - 1) and s["buckets_gloo"] == 0
    print(f"\nlanes: max in flight {[r['stats']['max_in_flight'] for r in res]}, "
          f"answers held back {gate.withheld}")


def test_ranks_agree_through_a_fallback_with_buckets_in_flight(ranks):
    """Two lanes, 3 buckets a step: at step 5 only rank 0 gets bucket 2's sum
    (the others keep buckets 0 and 1 and take bucket 2 from rank 0), then no
    aggregator answers until step 21; every step (xagg or fallen back) is
    checked against DDP's sum and every rank takes the same path."""
    job = 65
    jobs = [lane_job_id(job, k) for k in range(2)]
    steps = 36
    with UserspaceServer(aggregator_for(jobs), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_lanes, agg=f"127.0.0.1:{server.port}", job=job, steps=steps, events={},
                        faults={5: ("lost", 2), **down(6, 21)})
    print("\nlanes, path per step (x: xagg, g: gloo):", [r["path"] for r in res])
    # gloo after step 6; retries after steps 8, 13, 18 fail; the one after 23 holds
    assert all(r["path"] == "x" * 6 + "g" * 18 + "x" * 12 for r in res)
    for r in res:
        s = r["stats"]
        assert s["steps"] == steps and s["fallbacks"] == 1 and s["recoveries"] == 1 and s["retries"] == 4, s
        assert s["max_in_flight"] >= 1
    # 3 buckets in each of the 18 steps on gloo; at step 5 the others took
    # bucket 2 from rank 0 (DDP's first step has buckets of its own)
    first = res[0]["stats"]
    assert first["buckets_gloo"] == 3 * 18, first
    for r in res[1:]:
        assert (r["stats"]["buckets_xagg"], r["stats"]["buckets_gloo"]) == \
            (first["buckets_xagg"] - 1, first["buckets_gloo"] + 1), r["stats"]


def task_compress_fallback(rank, agg, job, steps, lr=0.3):
    """The compression hook's sums over xagg (XaggCollectives with the job's
    state), checked like task_fallback within the exact-exponent bound."""
    from xagg.compress import attach as compress_attach
    from xagg.torch.compressed import XaggCollectives
    A, X = DDP(tiny()), DDP(tiny())
    sX = XaggState([agg], job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02, backoff_steps=2,
                   max_backoff_steps=4)
    compress_attach(X, "dense", XaggCollectives(sX.client, state=sX))
    path, _ = checked_steps(rank, A, X, sX, steps, {}, lr, slack=0)
    out = dict(path=path, stats=sX.snapshot(), log=list(_log))
    sX.close()
    return out


def test_compressed_sums_fall_back_when_the_aggregator_dies_and_come_back(ranks):
    """Step 4: only rank 0 gets its sums; steps 5 to 17 no aggregator answers."""
    job = 33
    with UserspaceServer(aggregator_for([job]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_compress_fallback, agg=f"127.0.0.1:{server.port}", job=job, steps=30,
                        faults={4: ("lost", None), **down(5, 17)})
    path = res[0]["path"]
    print("\ncompressed sums per step (x: xagg, g: torch.distributed):", path)
    assert all(r["path"] == path for r in res), "ranks disagree on the path"
    assert path[:4] == "xxxx" and path[4] == "g" and path[-1] == "x" and "x" not in path[5:18]
    for r in res:
        s = r["stats"]
        assert s["fallbacks"] == 1 and s["recoveries"] == 1 and s["retries"] >= 2, s
        assert any("fall back to torch.distributed" in m for m in r["log"]), r["log"]
        assert any("through the aggregators again" in m for m in r["log"]), r["log"]


def task_hook_trial(rank, agg, job, steps, costs, rescaling=(), plain=("last", 0.0, ()), count=1.0):
    """--compress auto's trial (xagg/torch/hook_trial.py) on one job: every
    bucket on rgc, then the per-bucket choice, then the plain hook, then the
    side whose steps took less. Step times come from a clock this task advances by
    ``costs[side]`` a step (no wall clock), so the outcome is the test's.
    Per step and bucket: the side, and whether the sum is the sum of what
    the ranks put in (each its gradient, plus the residual its method held,
    less the one it keeps) and the same bits on every rank. rgc's time
    counts ``count`` times under ``rescaling`` (1: at its time, sparse=on)."""
    from xagg.compress import get_compressor, make_ddp_hook
    from xagg.torch.compressed import XaggCollectives
    from xagg.torch.hook import bucket_elements
    from xagg.torch.hook_trial import BUCKETS, PLAIN, HookTrial, trial_hook
    settings = dict(job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02)
    opened, made, said = [], [], []

    class Counted(XaggState):       # each start of a side's transport, in order
        side = ""

        def start(self):
            if not self.started:
                opened.append(self.side)
            return super().start()

    def open_transport(side):
        made.append(side)
        return type("Counted", (Counted,), {"side": side})([agg], **settings)

    X = DDP(tiny())
    sX = open_transport(BUCKETS)
    coll = XaggCollectives(sX.client, state=sX)
    # rgc's own STEPS times sparse_steps makes the count the test's
    counting = f"sparse_steps={count / get_compressor('rgc').STEPS!r}" if count != 1.0 else "sparse=on"
    comp = get_compressor(f"auto:methods=rgc,min_size=0,probe=4096,hook=try,hook_steps=1,{counting}")
    comp.fit_optimizers(list(rescaling))
    chose = comp.hook_for(coll, bucket_elements(X))
    state, _ = make_ddp_hook(comp, coll, X)
    now = [0.0]
    assert chose.methods == ("rgc",)
    lanes = chose.lanes if "plain" in costs else None       # no plain side where it is not in doubt
    t = HookTrial(state, sX, lambda: open_transport(PLAIN), lanes, methods=chose.methods, window=comp.hook_steps,
                  plain_when=plain[0], plain_s=plain[1], sums=plain[2], said=said.append, clock=lambda: now[0])
    winner = min(costs, key=costs.get)
    seen = []

    def recording(t, bucket):
        name = f"bucket{bucket.index()}"
        params = bucket.parameters()
        state.drain()       # the compression thread's buckets before this one: the residuals hold still
        state.relayout(name, state.param_keys(params), [p.numel() for p in params])    # the hook's own first move
        before = comp.memory.get(name)
        put = bucket.buffer().detach().cpu().clone() + (before.clone() if before is not None else 0)
        side = t.side()         # at a round's end, the round judged first (the same on every rank)
        if bucket.is_last():
            now[0] += costs[side]
        fut = trial_hook(t, bucket)

        def done(f, side=side, put=put):    # the residual the bucket's sum left, read once it is done
            after = comp.memory.get(name)
            redone = t.plain.stats["redone"] if side == PLAIN else 0   # the plain hook's chunks summed twice
            seen.append((side, put - (after if after is not None else 0), f.value().detach().cpu() * WORLD, redone))
            return f.value()
        return fut.then(done)

    X.register_comm_hook(t, recording)
    opt = torch.optim.SGD(X.parameters(), lr=0.1)
    path = []
    for x, y in step_batches(rank, steps):
        seen.clear()
        sgd_step(X, opt, x, y)
        for side, put, got, redone in seen:
            puts, gots = [torch.empty_like(put) for _ in range(WORLD)], [torch.empty_like(got) for _ in range(WORLD)]
            dist.all_gather(puts, put)
            dist.all_gather(gots, got)
            want = torch.stack(puts).sum(0)
            scale = float(want.abs().max())
            path.append(dict(side=side, err=float((got - want).abs().max()), same=all(torch.equal(g, got) for g in gots),
                             bound=tolerance(scale, WORLD) + WORLD * scale * 2.0 ** -20, redone=redone))
    started = {BUCKETS: sX.started, PLAIN: t.plain is not None and t.plain.started}
    kept = len(sX.kept) + (len(t.plain.kept) if t.plain is not None else 0)
    t.close()
    return dict(opened=opened, made=made, started=started, kept=kept, said=said, chosen=t.chosen, path=path,
                left=sorted(comp.memory), choices=comp.choices(), barred=sorted(comp._barred))


@pytest.mark.parametrize("costs", [{"rgc": 2.0, "per-bucket": 3.0, "plain": 1.0},
                                   {"rgc": 3.0, "per-bucket": 1.0, "plain": 2.0},
                                   {"rgc": 1.0, "per-bucket": 2.0, "plain": 3.0}],
                         ids=["plain-faster", "per-bucket-faster", "rgc-faster"])
def test_auto_tries_every_side_on_one_job_and_keeps_the_fastest(ranks, costs):
    """Window 1: steps 0-2 every bucket on rgc (step 0 DDP's rebuild, 1
    settling, 2 judged), 3-6 the per-bucket choice, 7-10 the plain hook (the
    first step of each holds the change, the second what it leaves behind,
    the third its buffers' first touch, the fourth is judged), from step 11
    the side with the smallest median, agreed by every rank. The residual
    rgc held goes into the first plain sum, so no sum loses or doubles
    anything; a method that wins keeps every bucket."""
    steps, job = 14, 71
    with UserspaceServer(aggregator_for([job]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_hook_trial, agg=f"127.0.0.1:{server.port}", job=job, steps=steps, costs=costs)
        counters = dict(server.agg.counters)
    winner = min(costs, key=costs.get)
    sides = [p["side"] for p in res[0]["path"]]
    assert sides == ["rgc"] * 3 + ["per-bucket"] * 4 + ["plain"] * 4 + [winner] * 3, sides
    for r in res:
        assert r["chosen"] == winner and [p["side"] for p in r["path"]] == sides
        # each side's transport opened where it started, on the same job: the compression hook's again if it
        # won; each made once, the winner's open at the end
        assert r["opened"] == ["per-bucket", "plain"] + (["per-bucket"] if winner != "plain" else [])
        assert r["made"] == ["per-bucket", "plain"], r["made"]
        assert r["started"] == {"per-bucket": winner != "plain", "plain": winner == "plain"}, r["started"]
        assert r["kept"] == 0       # the loser's transport let go of what it held for another window
        for k, p in enumerate(r["path"]):
            assert p["same"] and p["err"] <= p["bound"], (k, p)
        # what rgc had not sent went into the plain hook's first sum: none is left behind in its memory
        assert winner != "plain" or r["left"] == [], r["left"]
        assert winner != "rgc" or set(r["choices"].values()) == {"rgc"}, r["choices"]
        # the per-bucket choice, having beaten rgc's whole steps by far, keeps its buckets off rgc
        assert r["barred"] == (["rgc"] if winner == "per-bucket" else []), r["barred"]
    line = res[0]["said"][0]
    what = {"plain": "plain hook, 32-bit lanes", "per-bucket": "per-bucket methods in the compression hook",
            "rgc": "every bucket on rgc in the compression hook"}[winner]
    assert line.startswith(f"compress auto: {what}, measured a step: "), line
    # the medians every rank agreed on: the clock's costs, in milliseconds
    assert (f"rgc {1e3 * costs['rgc']:.0f} ms, per-bucket methods {1e3 * costs['per-bucket']:.0f} ms, "
            f"plain hook {1e3 * costs['plain']:.0f} ms") in line, line
    assert counters["completed"] >= steps, counters


R, B, P = "rgc", "per-bucket", "plain"


@pytest.mark.parametrize("rgc, plain, chosen, sides, line", [
    (1.0, ("last", 0.0, ()), P, [R] * 3 + [B] * 4 + [P] * 6,
     ["rgc 1000 ms (counted 2x)", "per-bucket methods 2500 ms", "plain hook 1500 ms"]),
    # after: run where the best counted step (rgc's, 2 s) took longer than the plain hook's sums alone
    (1.0, ("after", 1.0, ()), P, [R] * 3 + [B] * 4 + [P] * 6,
     ["rgc 1000 ms (counted 2x)", "per-bucket methods 2500 ms", "plain hook 1500 ms"]),
    (1.0, ("after", 2.5, ()), R, [R] * 3 + [B] * 4 + [R] * 6,
     ["rgc 1000 ms (counted 2x)", "per-bucket methods 2500 ms", "plain hook not run"]),
    # first: the plain hook, then per-bucket (counted once: it runs in the first round); the fastest of
    # those, the plain hook's 1.5 s step less its predicted sums (1.2), leaves the model's own 0.3 s; rgc,
    # counted twice, pays it twice plus its counted sums (0.2): 0.8 < 1.5, it runs a second round
    (1.0, ("first", 1.2, ((R, 0.2, 2.0), (B, 1.2, 1.0))), P, [P] * 3 + [B] * 4 + [R] * 4 + [P] * 2,
     ["plain hook 1500 ms, rgc 1000 ms (counted 2x), per-bucket methods 2500 ms"]),
    (0.5, ("first", 1.2, ((R, 0.2, 2.0), (B, 1.2, 1.0))), R, [P] * 3 + [B] * 4 + [R] * 4 + [R] * 2,
     ["plain hook 1500 ms, rgc 500 ms (counted 2x), per-bucket methods 2500 ms"]),
    # its sums predicted at 0.6: 0.9 s of the step is the model's own, and counted twice rgc could not
    # beat it (2.0): the plain hook keeps the job without rgc's window
    (0.5, ("first", 0.6, ((R, 0.2, 2.0), (B, 1.2, 1.0))), P, [P] * 3 + [B] * 4 + [P] * 6,
     ["plain hook 1500 ms, per-bucket methods 2500 ms, not run: rgc"]),
    # after, rgc counted twice waits for the others: per-bucket's 2.5 s step (predicted 1.2) leaves 1.3 s
    # of the model's own: counted twice, rgc cannot beat it; the plain hook (sums predicted 1.0) runs after
    (0.5, ("after", 1.0, ((R, 0.2, 2.0), (B, 1.2, 1.0))), P, [B] * 3 + [P] * 4 + [P] * 6,
     ["per-bucket methods 2500 ms, plain hook 1500 ms, not run: rgc"]),
], ids=["plain-last", "plain-after-as-the-others-are-slower", "plain-not-run-as-its-sums-alone-are-slower",
        "plain-first-then-a-counted-side-that-could-beat-the-fastest", "plain-first-and-a-side-that-beats-it",
        "plain-first-where-no-counted-side-could-beat-the-fastest", "after-a-counted-side-waits-for-the-others"])
def test_a_sparse_side_under_adam_counts_its_steps_twice(ranks, rgc, plain, chosen, sides, line):
    """Where a sparse step trains about half as far under an optimizer that
    rescales per coordinate: rgc's steps count twice, and the plain hook (1.5 s a
    step by the clock) beats rgc at 1.0 s, not at 0.5. Where the plain hook
    runs depends on ``plain_when``: last (every side in the first round);
    after the others, only where their best counted step took longer than
    the plain hook's predicted sums; or first. Where a side's count is
    given (``sums``), one counted more than once runs after the first
    round, only where its counted step could beat the first round's
    fastest."""
    costs = {"rgc": rgc, "per-bucket": 2.5, "plain": 1.5}
    with UserspaceServer(aggregator_for([73]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_hook_trial, agg=f"127.0.0.1:{server.port}", job=73, steps=13, costs=costs,
                        rescaling=["AdamW"], plain=plain, count=2.0)
    assert {r["chosen"] for r in res} == {chosen}
    for r in res:
        assert [p["side"] for p in r["path"]] == sides
        for k, p in enumerate(r["path"]):
            assert p["same"] and p["err"] <= p["bound"], (k, p)
    # the per-bucket side counts as the options its buckets took (dense or rgc: from measured figures)
    said = res[0]["said"][0]
    assert "measured a step: " in said and all(part in said for part in line) and "raced" not in said, said


@pytest.mark.parametrize("costs, then", [
    ({"rgc": 1.0, "per-bucket": 1.05, "plain": 3.0}, ""),
    ({"rgc": 1.05, "per-bucket": 1.0, "plain": 3.0}, "; rgc within 10% of the per-bucket methods, which go on "
                                                     "changing their buckets: the pinned method keeps the job"),
], ids=["rgc-faster", "per-bucket-faster-by-less-than-noise"])
def test_a_method_within_noise_of_the_per_bucket_choice_keeps_the_job_without_a_race(ranks, costs, then):
    """rgc and the per-bucket choice within RACE_EDGE of each other after
    the first round (steps 0-10): no race (the plain hook, far behind, is
    not in it); rgc keeps the job from step 11, the faster or within
    RACE_EDGE of the per-bucket choice, which goes on moving its buckets by
    their sum times. Every sum stays exact across the changes."""
    with UserspaceServer(aggregator_for([73]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_hook_trial, agg=f"127.0.0.1:{server.port}", job=73, steps=14, costs=costs)
    sides = [p["side"] for p in res[0]["path"]]
    assert sides == ["rgc"] * 3 + ["per-bucket"] * 4 + ["plain"] * 4 + ["rgc"] * 3, sides
    for r in res:
        assert r["chosen"] == "rgc" and [p["side"] for p in r["path"]] == sides
        assert r["opened"] == ["per-bucket", "plain", "per-bucket"], r["opened"]
        assert r["barred"] == [], r["barred"]
        assert all(p["same"] and p["err"] <= p["bound"] for p in r["path"])
        assert set(r["choices"].values()) == {"rgc"}, r["choices"]
    assert res[0]["said"] == ["compress auto: every bucket on rgc in the compression hook, measured a step: "
                              f"rgc {1e3 * costs['rgc']:.0f} ms, per-bucket methods {1e3 * costs['per-bucket']:.0f} "
                              f"ms, plain hook 3000 ms (the slowest rank's median of 1 step each){then}"]


def test_the_per_bucket_choice_gives_its_place_in_a_race_to_a_method_within_noise(ranks):
    """The plain hook fastest, the per-bucket choice second and rgc third,
    all within RACE_EDGE: rgc, not the per-bucket choice (which rgc would
    keep the job from either way), races the plain hook: after the first
    round (rgc 0-2, per-bucket 3-6, the plain hook 7-10), the plain hook
    goes on at 11, rgc 12-15, the plain hook 16-19, rgc 20-22; from 23 the
    plain hook, faster over every round."""
    costs = {"rgc": 1.08, "per-bucket": 1.05, "plain": 1.0}
    with UserspaceServer(aggregator_for([75]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_hook_trial, agg=f"127.0.0.1:{server.port}", job=75, steps=24, costs=costs)
    want = ["rgc"] * 3 + ["per-bucket"] * 4 + ["plain"] * 5 + ["rgc"] * 4 + ["plain"] * 4 + ["rgc"] * 3 + ["plain"]
    for r in res:
        assert [p["side"] for p in r["path"]] == want and r["chosen"] == "plain"
        assert all(p["same"] and p["err"] <= p["bound"] for p in r["path"])
    line = res[0]["said"][0]
    assert line.startswith("compress auto: plain hook, 32-bit lanes, measured a step: ") and \
        "plain hook and rgc raced 3 more round(s), 4 steps each)" in line, line


def test_the_plain_hook_started_again_goes_on_from_what_it_learned(ranks):
    """rgc and the plain hook within RACE_EDGE: the plain hook runs at steps
    7-10 (its transport made), 11, 16-18 (started again after rgc's 12-15)
    and 19; rgc keeps the job from 23. Its first sums were each summed twice (no
    exponents to predict from); started again, its transport goes on from
    what its clients learned: the first sums at 14 are predicted."""
    costs = {"rgc": 1.0, "per-bucket": 3.0, "plain": 1.05}
    with UserspaceServer(aggregator_for([74]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_hook_trial, agg=f"127.0.0.1:{server.port}", job=74, steps=24, costs=costs)
    want = ["rgc"] * 3 + ["per-bucket"] * 4 + ["plain"] * 5 + ["rgc"] * 4 + ["plain"] * 4 + ["rgc"] * 4
    for r in res:
        path = r["path"]
        assert [p["side"] for p in path] == want and r["chosen"] == "rgc"
        assert all(p["same"] and p["err"] <= p["bound"] for p in path)
        assert r["made"] == ["per-bucket", "plain"]
        assert r["opened"] == ["per-bucket", "plain", "per-bucket", "plain", "per-bucket"], r["opened"]
        assert r["kept"] == 0
        first, again = path[7]["redone"], path[16]["redone"] - path[11]["redone"]
        assert first >= CHUNKS_PER_ROUND - 1 and again < first, (first, again)
    line = res[0]["said"][0]
    assert line.startswith("compress auto: every bucket on rgc in the compression hook, measured a step: ") and \
        "raced 3 more round(s), 4 steps each)" in line, line


def test_without_the_plain_hook_in_doubt_the_trial_is_the_methods_and_the_per_bucket_choice(ranks):
    """Where the compression hook keeps the job outright, its trial has no
    plain side: rgc on every bucket for steps 0-2, the per-bucket choice 3-6,
    decided at step 7, and the per-bucket choice goes on revisiting."""
    costs = {"rgc": 2.0, "per-bucket": 1.0}
    with UserspaceServer(aggregator_for([72]), "127.0.0.1", 0).start() as server:
        res = ranks.run(task_hook_trial, agg=f"127.0.0.1:{server.port}", job=72, steps=8, costs=costs)
    sides = [p["side"] for p in res[0]["path"]]
    assert sides == ["rgc"] * 3 + ["per-bucket"] * 5, sides
    for r in res:
        assert r["chosen"] == "per-bucket" and r["opened"] == ["per-bucket"]
        assert all(p["same"] and p["err"] <= p["bound"] for p in r["path"])
    assert res[0]["said"] == ["compress auto: per-bucket methods in the compression hook, measured a step: "
                              "rgc 2000 ms, per-bucket methods 1000 ms (the slowest rank's median of 1 step each); "
                              "its buckets keep off rgc, slower by whole steps"]


def task_unreachable(rank, agg, job, steps):
    A, X = DDP(tiny()), DDP(tiny())
    sX = attach(X, [agg], job_id=job, cookie=COOKIE, timeout=0.3, rto=0.02, backoff_steps=3,
                max_backoff_steps=3)
    for x, y in step_batches(rank, steps):
        for m in (A, X):
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
        # fallen back to gloo: exactly DDP's own arithmetic
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(A.parameters(), X.parameters()))
    out = dict(stats=sX.snapshot(), log=list(_log))
    sX.close()
    return out


def test_unreachable_at_start_trains_over_gloo(ranks):
    port = free_port(socket.SOCK_DGRAM)       # nobody listens there
    res = ranks.run(task_unreachable, agg=f"127.0.0.1:{port}", job=41, steps=8)
    for r in res:
        s = r["stats"]
        assert s["fallbacks"] == 1 and s["buckets_gloo"] == 8 and s["buckets_xagg"] == 0
        assert s["retries"] == 2
        assert sum("falling back to gloo" in m for m in r["log"]) == 1    # logged once


def task_checkpoint(rank, agg, job, path, phase, steps=10):
    path = path.format(rank)
    data_steps = step_batches(rank, 2 * steps)
    if phase == 1:
        X = DDP(tiny())
        sX = attach(X, [agg], job_id=job, cookie=COOKIE, timeout=30)
        opt = torch.optim.SGD(X.parameters(), lr=0.2, momentum=0.9)
        for x, y in data_steps[:steps]:
            sgd_step(X, opt, x, y)
        blob = pickle.dumps(sX)
        assert sX.started and not pickle.loads(blob).started      # the connection is not pickled
        torch.save({"model": X.module.state_dict(), "opt": opt.state_dict(), "xagg": sX}, path)
        for x, y in data_steps[steps:]:                            # and on, to compare with
            sgd_step(X, opt, x, y)
        out = dict(params=params(X), stats=sX.snapshot())
        sX.close()
        return out
    X = DDP(tiny(seed=123))                          # other weights until loaded
    ck = torch.load(path, weights_only=False)
    X.module.load_state_dict(ck["model"])
    opt = torch.optim.SGD(X.parameters(), lr=0.2, momentum=0.9)
    opt.load_state_dict(ck["opt"])
    sX = ck["xagg"]
    assert isinstance(sX, XaggState) and not sX.started
    X.register_comm_hook(sX, xagg_hook)                            # reconnects on the first bucket
    for x, y in data_steps[steps:]:
        sgd_step(X, opt, x, y)
    out = dict(params=params(X), stats=sX.snapshot())
    sX.close()
    return out


def test_checkpoint_and_restore(ranks, tmp_path):
    job = 51
    with UserspaceServer(aggregator_for([job]), "127.0.0.1", 0).start() as server:
        agg = f"127.0.0.1:{server.port}"
        first = ranks.run(task_checkpoint, agg=agg, job=job, path=str(tmp_path / "ck{}.pt"), phase=1)
        # no reset in between (as with a job the operator registered): the restored
        # run's rounds start at a fresh base, so its rounds are not taken for stale ones
        second = ranks.run(task_checkpoint, agg=agg, job=job, path=str(tmp_path / "ck{}.pt"), phase=2)
    # not bit-identical: DDP's first iteration after a restore packs the bucket in
    # parameter order, later ones in gradient order, so chunks (and their agreed
    # exponents) differ for one step; a lost optimizer state or weight would
    # show as differences around 1e-2
    diff = max((a["params"] - b["params"]).abs().max().item() for a, b in zip(first, second))
    print(f"\nrestored vs uninterrupted, after 10 more steps: max |dp| = {diff:.3g}")
    assert diff < 1e-5
    for a, b in zip(first, second):
        assert b["stats"]["steps"] == 20 and b["stats"]["buckets_xagg"] == 20
        assert b["stats"]["fallbacks"] == 0 and b["stats"]["job_id"] == job


def task_daemon(rank, agg, control, steps, events):
    """The job registered by rank 0 through xaggd's control API (no job id given)."""
    X = DDP(tiny())
    sX = attach(X, [agg], control=[control], timeout=HEALTHY, rto=0.02, backoff_steps=2, max_backoff_steps=2)
    opt = torch.optim.SGD(X.parameters(), lr=0.3)
    path = ""
    for step, (x, y) in enumerate(step_batches(rank, steps)):
        FAULTS.step = step
        if step in events:
            ask(rank, events[step])
        before = sX.stats["buckets_xagg"]
        sgd_step(X, opt, x, y)
        path += "x" if sX.stats["buckets_xagg"] > before else "g"
    out = dict(path=path, stats=sX.snapshot(), log=list(_log), vals=sX.vals)
    sX.close()
    return out


class Xaggd:
    """A userspace xaggd (the daemon's own aggregator), driven by its CLI."""

    def __init__(self, run_dir, port=0, vals=256, extra=()):
        self.run_dir, self.log = run_dir, open(run_dir / "xaggd.log", "a")
        self.proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "xaggd"), "start",
                                      "--userspace", "--bind", "127.0.0.1", "--port", str(port),
                                      "--vals", str(vals),
                                      "--memory", "8M", "--name", "hooktest", "--run-dir", str(run_dir),
                                      *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.control = str(run_dir / "hooktest.sock")
        from xagg.wire.control import ControlClient, ControlError
        while True:                       # until it answers (pytest-timeout guards a hang)
            assert self.proc.poll() is None, (run_dir / "xaggd.log").read_text()
            try:
                with ControlClient(self.control, timeout=5) as c:
                    self.port = c.status()["port"]
                    return
            except ControlError:
                import time
                time.sleep(0.1)

    def stats(self) -> dict:
        from xagg.wire.control import ControlClient
        with ControlClient(self.control) as c:
            return c.stats()

    def kill(self):
        self.proc.kill()                  # a crash: the job is gone with it
        self.proc.wait()


def test_job_registered_through_xaggd_and_again_after_it_restarts(ranks, tmp_path):
    """The daemon is killed before step 4 (whose sums fail: injected, instead of
    waiting out the timeout) and restarted before step 10: rank 0's
    re-registrations after steps 6 and 8 fail, the one after step 10 holds."""
    daemon = {"d": Xaggd(tmp_path)}
    port = daemon["d"].port

    def on_request(req):
        if req == "kill":
            daemon["d"].kill()
        elif req == "restart":
            daemon["d"] = Xaggd(tmp_path, port)

    try:
        res = ranks.run(task_daemon, on_request=on_request, agg=f"127.0.0.1:{port}",
                        control=daemon["d"].control, steps=24, events={4: "kill", 10: "restart"},
                        faults={4: "down"})
        stats = daemon["d"].stats()
    finally:
        daemon["d"].kill()
    path, job = res[0]["path"], res[0]["stats"]["job_id"]
    print("\nxaggd path per step (x: xagg, g: gloo):", path)
    assert all(r["path"] == path and r["stats"]["job_id"] == job for r in res)
    assert path == "x" * 4 + "g" * 7 + "x" * 13, path
    assert all(r["stats"]["retries"] == 3 and r["stats"]["recoveries"] == 1 for r in res)
    # while the daemon was down, rank 0's re-registration failed and the ranks stayed on gloo
    assert sum("retry failed" in m and "DaemonUnavailable" in m for m in res[0]["log"]) == 2, res[0]["log"]
    # the restarted daemon restored the job from its run dir, and rank 0 registered it
    # again (the same parameters: a no-op, then the reset that clears the counters)
    done, xs = stats["jobs"][str(job)]["completed"], path[10:].count("x")
    assert CHUNKS_PER_ROUND * xs <= done <= CHUNKS_PER_ROUND * xs + res[0]["stats"]["redone"]


def task_two_daemons(rank, aggs, controls, steps, events):
    """The job on two xaggds, registered by rank 0, every step checked against
    DDP's own all-reduce (checked_steps)."""
    A, X = DDP(tiny()), DDP(tiny())
    sX = attach(X, aggs, control=controls, timeout=HEALTHY, rto=0.02, backoff_steps=2, max_backoff_steps=2)
    path, _ = checked_steps(rank, A, X, sX, steps, events, lr=0.3, slack=0)
    out = dict(path=path, stats=sX.snapshot(), log=list(_log))
    sX.close()
    return out


def test_a_dead_aggregator_is_planned_out_and_back_in(ranks, tmp_path):
    """One of two aggregators dies for good: after one back-off on gloo the job
    goes on over xagg on the other (re-planned: weight 0 for the dead one),
    instead of training on gloo until it returns; once it is back, the ranks
    take it in again together at the next try of the whole set
    (aggregator_set.WHOLE_SET_EVERY). The step a1 dies in fails by injection,
    instead of waiting out the timeout."""
    from xagg.torch.aggregator_set import WHOLE_SET_EVERY
    dirs = [tmp_path / "a0", tmp_path / "a1"]
    for d in dirs:
        d.mkdir()
    daemons = [Xaggd(d) for d in dirs]
    port1 = daemons[1].port

    def on_request(req):
        if req == "kill a1":
            daemons[1].kill()
        elif req == "restart a1":
            daemons[1] = Xaggd(dirs[1], port1)

    steps = WHOLE_SET_EVERY + 8
    try:
        res = ranks.run(task_two_daemons, on_request=on_request,
                        aggs=[f"127.0.0.1:{d.port}" for d in daemons], controls=[d.control for d in daemons],
                        steps=steps, events={4: "kill a1", 20: "restart a1"}, faults={4: "down"})
        stats = [d.stats() for d in daemons]
    finally:
        for d in daemons:
            d.kill()
    path, job = res[0]["path"], str(res[0]["stats"]["job_id"])
    print("\ntwo daemons, path per step (x: xagg, g: gloo):", path)
    assert all(r["path"] == path for r in res), "ranks disagree on the path"
    # the step a1 died fell back; one back-off (2 steps) later, xagg on a0 alone, for good
    assert path[:4] == "xxxx" and path[4] == "g" and path[7:] == "x" * (steps - 7), path
    assert any("planning aggregator 1 out" in m for m in res[0]["log"]), res[0]["log"]
    assert all(any("all but aggregator(s) [1]" in m for m in r["log"]) for r in res)
    # back in at step WHOLE_SET_EVERY: a1 summed every step from then on
    assert all(any("every aggregator again" in m for m in r["log"]) for r in res)
    assert all(r["stats"]["planned_out"] == [] for r in res)
    # (steps 7..49 on xagg with a1 dead prove a0 held every chunk then: checked_steps
    # compared every step with DDP's own sum.) The registration that took a1 back
    # reset both daemons' counters: from then on each summed its share every step.
    back = steps - WHOLE_SET_EVERY
    for st in stats:
        assert st["jobs"][job]["completed"] >= back, st["jobs"][job]
    assert sum(st["jobs"][job]["completed"] for st in stats) >= CHUNKS_PER_ROUND * back


def task_tree(rank, aggs, controls, routes, steps):
    A, X = DDP(tiny()), DDP(tiny())
    sX = attach(X, aggs, control=controls, routes=routes, timeout=HEALTHY, rto=0.02)
    path, _ = checked_steps(rank, A, X, sX, steps, {}, lr=0.3, slack=0)
    out = dict(path=path, stats=sX.snapshot(), log=list(_log))
    sX.close()
    return out


def test_a_tree_plan_trains_through_a_child_aggregator(ranks, tmp_path):
    """routes (a plan's tree): ranks 0 and 1 send aggregator 1's chunks
    through aggregator 0, which sums them and sends one partial up. Every
    step on xagg and checked against DDP's own sum; a1 took partial sums from
    its child, and a0 held a child entry for a1's chunks."""
    dirs = [tmp_path / "a0", tmp_path / "a1"]
    for d in dirs:
        d.mkdir()
    daemons = [Xaggd(d) for d in dirs]
    routes = [[0, 0], [0, 0], [0, 1], [0, 1]]
    steps = 6
    try:
        res = ranks.run(task_tree, aggs=[f"127.0.0.1:{d.port}" for d in daemons],
                        controls=[d.control for d in daemons], routes=routes, steps=steps)
        stats = [d.stats() for d in daemons]
    finally:
        for d in daemons:
            d.kill()
    job = str(res[0]["stats"]["job_id"])
    assert all(r["path"] == "x" * steps for r in res), [r["log"] for r in res]
    sub = stats[0]["jobs"][job]["child_entries"]["1"]
    assert sub["completed"] >= steps, sub          # a0 finished a1's chunks for ranks 0, 1
    print("\ntree: a0's child entry", sub, "a1", stats[1]["jobs"][job])


def task_metrics(rank, agg, job, port, steps):
    """Train on xagg with XAGG_METRICS-style serving; each rank scrapes its own
    endpoint with a real HTTP client while its state is live."""
    import urllib.request
    X = DDP(tiny())
    sX = attach(X, [agg], job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02, metrics=f"127.0.0.1:{port}")
    opt = torch.optim.SGD(X.parameters(), lr=0.3)
    for x, y in step_batches(rank, steps):
        sgd_step(X, opt, x, y)
    with urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=10) as r:
        out = dict(text=r.read().decode(), ctype=r.headers["Content-Type"], stats=sX.snapshot())
    sX.close()
    return out


def test_each_rank_serves_its_counters_to_a_scraper(ranks):
    """Prometheus text per rank at PORT + rank (no torchrun here: no LOCAL_RANK)."""
    job, steps = 63, 3
    server = UserspaceServer(aggregator_for([job]), "127.0.0.1", 0).start()
    port = free_ports(WORLD)        # rank r serves at port + r
    try:
        res = ranks.run(task_metrics, agg=f"127.0.0.1:{server.port}", job=job, port=port, steps=steps)
    finally:
        server.stop()
    from prometheus_client.parser import text_string_to_metric_families
    for rank, r in enumerate(res):
        assert r["ctype"].startswith("text/plain; version=")
        families = {f.name: f for f in text_string_to_metric_families(r["text"])}
        st = r["stats"]
        samples = {(s.name, s.labels.get("path") or s.labels.get("mode")): s.value
                   for f in families.values() for s in f.samples
                   if s.labels.get("rank") == str(rank) and s.labels.get("job_id") == str(job)}
        assert samples[("xagg_client_steps_total", None)] == steps, r["text"]
        assert samples[("xagg_client_buckets_total", "xagg")] == st["buckets_xagg"]
        assert samples[("xagg_client_bytes_total", None)] == st["bytes_xagg"] > 0
        assert samples[("xagg_client_fallbacks_total", None)] == 0
        assert samples[("xagg_client_mode", "xagg")] == 1 and samples[("xagg_client_mode", "gloo")] == 0
        assert families["xagg_client_retransmits"].type == "counter"


def task_fixed_job_over_tcp(rank, agg, control, token, job, steps):
    X = DDP(tiny())
    sX = attach(X, [agg], control=[control], token=token, job_id=job, cookie=COOKIE, timeout=HEALTHY, rto=0.02)
    opt = torch.optim.SGD(X.parameters(), lr=0.3)
    for x, y in step_batches(rank, steps):
        sgd_step(X, opt, x, y)
    out = dict(stats=sX.snapshot(), log=list(_log))
    sX.close()
    return out


def test_a_fixed_job_registered_with_the_client_token_runs_again(ranks, tmp_path):
    """The second run of a fixed --job-id/--cookie over TCP with the client token
    re-registers the job its first run left (the same job token, derived from
    the control token and the cookie) instead of being refused as another
    registrant and training over gloo for good."""
    client, admin = "client-token-0123456789", "admin-token-0123456789ab"
    for name, tok in (("admin", admin), ("client", client)):
        (tmp_path / name).write_text(tok + "\n")
        (tmp_path / name).chmod(0o600)
    tcp = free_port()
    d = Xaggd(tmp_path, extra=["--listen", f"127.0.0.1:{tcp}", "--token-file", str(tmp_path / "admin"),
                               "--client-token-file", str(tmp_path / "client")])
    try:
        runs = [ranks.run(task_fixed_job_over_tcp, agg=f"127.0.0.1:{d.port}", control=f"127.0.0.1:{tcp}",
                          token=client, job=58, steps=3) for _ in range(2)]
    finally:
        d.kill()
    for res in runs:
        for r in res:
            assert r["stats"]["buckets_xagg"] == 3 and r["stats"]["fallbacks"] == 0, r["log"]


def test_values_per_packet_come_from_the_daemons(ranks, tmp_path):
    """No vals given: rank 0 learns the daemon's at registration and every rank packs by it."""
    d = Xaggd(tmp_path, vals=100)
    try:
        res = ranks.run(task_daemon, agg=f"127.0.0.1:{d.port}", control=d.control, steps=3, events={})
        stats = d.stats()
    finally:
        d.kill()
    assert all(r["vals"] == 100 and r["path"] == "xxx" for r in res)
    data = -(-P_TINY // 100)           # chunks of 100 values, then the meta chunks, then any redone
    assert stats["jobs"][str(res[0]["stats"]["job_id"])]["completed"] == \
        3 * (data + chunks.meta_chunks(data, 100)) + res[0]["stats"]["redone"]


# ---------------------------------------------------------------------------
# in this process: argument checks, and xagg-client on a script that never imports xagg
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw,arg", [
    (dict(aggregators=[]), "aggregators"),
    (dict(aggregators=["nonexistent.invalid:1"]), "aggregators"),
    (dict(timeout=0), "timeout"),
    (dict(rto=10.0), "rto"),
    (dict(fanout="multicast"), "fanout"),
    (dict(job_id=-1), "job_id"),
    (dict(job_id=None), "control"),
    (dict(control=["a:1", "b:2"]), "control"),
    (dict(backoff_steps=0), "backoff_steps"),
    (dict(weights=[1, 2]), "weights"),
    (dict(vals=0), "vals"),
    (dict(vals=5000), "vals"),
])
def test_state_arguments_are_checked(kw, arg):
    base = dict(aggregators=["127.0.0.1:9000"], job_id=1, cookie=2, start=False)
    with pytest.raises(XaggStateError, match=rf"XaggState\({arg}="):
        XaggState(**{**base, **kw})


def test_unstarted_state_pickles():
    s = XaggState("127.0.0.1:9000,127.0.0.1:9001", job_id=1, cookie=2, weights="1,3", start=False)
    t = pickle.loads(pickle.dumps(s))
    assert t.config.aggregators == ["127.0.0.1:9000", "127.0.0.1:9001"] and t.config.weights == [1.0, 3.0]
    assert not t.started and t.mode == "xagg"


# a plain torch script (on XAGG_TEST_DEVICE, which the ranks inherit); the
# replicas are compared on the CPU: gloo has no CUDA all_gather
NO_XAGG_SCRIPT = """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = os.environ.get("XAGG_TEST_DEVICE", "cpu")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(300, 10).to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(16, 300, generator=g).to(dev)).pow(2).mean().backward()
        opt.step()
    w = model.module.weight.detach().cpu()
    ws = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(ws, w)
    assert all(torch.equal(ws[0], v) for v in ws), "replicas diverged"
    print("SCRIPT-OK rank", dist.get_rank(), flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("compress", [[], ["--compress", "none"]])
def test_xagg_client_run_patches_an_unmodified_script(tmp_path, compress):
    """The plain hook sums every step; ``--compress none`` is that hook too
    (the compression hook's dense path sums exactly, every chunk in a second
    round, and counts none of them redone)."""
    steps, job = 5, 61
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NO_XAGG_SCRIPT).replace("STEPS", str(steps)))
    assert "xagg" not in script.read_text()
    n_params = 300 * 10 + 10
    status_dir = tmp_path / "status"
    with UserspaceServer(aggregator_for([job], n_params=n_params), "127.0.0.1", 0).start() as server:
        cli = [sys.executable, "-m", "xagg.torch.cli"]
        proc = subprocess.run(cli + ["run", "-a", f"127.0.0.1:{server.port}", "--job-id", str(job),
                                     "--cookie", str(COOKIE), "--nproc-per-node", str(WORLD),
                                     "--status-dir", str(status_dir), *compress, "--", str(script)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        counters = dict(server.agg.counters)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SCRIPT-OK") == WORLD
    st = subprocess.run(cli + ["status", "--dir", str(status_dir), "--json"], capture_output=True, text=True,
                        cwd=REPO, timeout=60)
    rows = json.loads(st.stdout)
    assert [r["rank"] for r in rows] == list(range(WORLD))
    assert all(r["buckets_xagg"] == steps and r["fallbacks"] == 0 and r["packets_sent"] > 0 for r in rows)
    # the aggregator summed every chunk of every step: meta + data chunks per round, and
    # again the chunks whose predicted exponent missed (all of the first step's)
    data = -(-n_params // 256)
    assert rows[0]["redone"] >= data and all(r["redone"] == rows[0]["redone"] for r in rows)
    assert counters["completed"] == steps * (1 + data) + rows[0]["redone"], counters
    table = subprocess.run(cli + ["status", "--dir", str(status_dir)], capture_output=True, text=True,
                           cwd=REPO, timeout=60).stdout
    assert f"job {job}" in table and "FALLBACKS" in table


@pytest.mark.parametrize("method", ["int8", "sketch", "iwp", "int16"])
def test_xagg_client_run_compresses_through_the_aggregator(tmp_path, method):
    """--compress: the compressor's sums reach the aggregator, replicas stay equal."""
    steps, job = 4, 62
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NO_XAGG_SCRIPT).replace("STEPS", str(steps)))
    with UserspaceServer(aggregator_for([job], n_params=300 * 10 + 10), "127.0.0.1", 0).start() as server:
        proc = subprocess.run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", f"127.0.0.1:{server.port}",
                               "--job-id", str(job), "--cookie", str(COOKIE), "--nproc-per-node", str(WORLD),
                               "--compress", method, "--", str(script)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        counters = dict(server.agg.counters)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SCRIPT-OK") == WORLD
    assert "terminate called" not in proc.stderr and "torch.distributed collectives" not in proc.stderr
    assert counters["completed"] >= steps, counters        # at least one sum per step went through xagg


@pytest.mark.parametrize("optimizer, compress, said", [
    ("AdamW", "auto", "compress auto: AdamW scales each coordinate's step by its own history, which trains slowly "
     "on sparse sums: counting rgc, mstopk, lossless at 3x, iwp, sketch at 3.2x their time"),
    ("AdamW", "auto:sparse_steps=1", None),     # the methods' own counts alone
    ("SGD", "auto", None),
    ("Adam", "rgc", "Adam scales each coordinate's step by its own history, and rgc sends a few coordinates"),
])
def test_xagg_client_run_fits_compression_to_the_script_s_optimizer(tmp_path, optimizer, compress, said):
    """Under an optimizer that rescales per coordinate auto counts sparse
    sums' time sparse_steps times more and says so;
    a sparse method asked for by name runs, and rank 0 says what it costs;
    SGD changes nothing."""
    job = 63
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NO_XAGG_SCRIPT).replace("STEPS", "3").replace(
        "torch.optim.SGD(model.parameters(), lr=0.1)", f"torch.optim.{optimizer}(model.parameters(), lr=0.01)"))
    with UserspaceServer(aggregator_for([job], n_params=300 * 10 + 10), "127.0.0.1", 0).start() as server:
        proc = subprocess.run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", f"127.0.0.1:{server.port}",
                               "--job-id", str(job), "--cookie", str(COOKIE), "--nproc-per-node", str(WORLD),
                               "--compress", compress, "--", str(script)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SCRIPT-OK") == WORLD
    if said:
        assert proc.stderr.count(said) == (2 if compress.startswith("auto") else 1), proc.stderr   # auto: at start, at exit
    else:
        assert "each coordinate" not in proc.stderr, proc.stderr


def test_xagg_client_run_errors_are_clear(tmp_path):
    cli = [sys.executable, "-m", "xagg.torch.cli", "run"]
    r = subprocess.run(cli + ["-a", "127.0.0.1", "--", "x.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--control" in r.stderr and "--job-id" in r.stderr
    r = subprocess.run(cli + ["-a", "127.0.0.1", "--job-id", "1", "--cookie", "2", "--compress", "nosuch",
                              "--", "x.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--compress" in r.stderr
