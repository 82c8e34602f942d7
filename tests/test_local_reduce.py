"""Reduce inside the host first (xagg/torch/local_reduce.py).

The segment and its barrier in real processes sharing a real file: the
host sum of every rank's bucket (compiled and numpy, equal to the bit),
each bucket's two result regions in turn, a failed share failing the
bucket on every rank of the host, a peer that exited named, a rank
waiting for its peers asleep in futex(2) on the segment's word.

Then the hook on the real data plane: 2 lab hosts x 2 ranks (4 processes,
2 per namespace, started by real torchrun with --nproc-per-node 2 on each
host) against xaggd with its XDP program. Every step trains plain DDP and
DDP with the hook on the same inputs, as tests/test_hook_xdp.py does, so
each step checks one all-reduce: within the fixed-point bound of gloo's on
xagg, bit for bit gloo's where it fell back, the same bits on every rank.
Scenarios: unicast, broadcast, two lanes; a share whose results never
reach one host (that host's ranks take the sum from a rank of the other
host); a share one host never sends (every rank redoes the bucket over
gloo); a bfloat16 model, whose buckets the hosts share and sum with no
float32 copy of them.

Run as ``python tests/test_local_reduce.py rank JSON``, this file is one
rank (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE in its environment).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST
REPO = Path(__file__).resolve().parent.parent
LR = 0.3
JOB = 0x5EED0000                # scenario k registers job JOB + 16 k (its shares and lanes follow it)
FAST = dict(timeout=10.0, rto=0.05)
BACKOFF = dict(timeout=5.0, rto=0.05, backoff_steps=2, max_backoff_steps=2)
# name -> (hook settings, bucket_cap_mb (None: one bucket), steps, {step: action on host w1})
SCENARIOS = {
    "unicast": (dict(fanout="unicast", **FAST), None, 4, {}),
    "bcast": (dict(fanout="bcast", **FAST), None, 3, {}),
    "lanes": (dict(fanout="unicast", lanes=2, **FAST), 0.002, 4, {}),
    # share 1's results never reach host 1 at step 2: its ranks get the sum from host 0's
    "held": (dict(fanout="unicast", **BACKOFF), None, 8, {2: "drop-in 1", 3: "clear"}),
    # host 1 never sends share 1 at step 2: no aggregator finishes it, every rank redoes it on gloo
    "lost": (dict(fanout="unicast", **BACKOFF), None, 8, {2: "drop-out 1", 3: "clear"}),
    "bf16": (dict(fanout="unicast", **FAST), None, 4, {}),
}
DTYPE_OF = {"bf16": "bfloat16"}     # a scenario's model dtype (float32 unless named)


def job_of(name: str) -> int:
    return JOB + 16 * list(SCENARIOS).index(name)


# -- one rank ------------------------------------------------------------------------------
def rank_main(a: dict) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    import torch.distributed as dist

    from ddp_replicas import ask

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    a["rank"] = dist.get_rank()
    out = {}
    for name in a["scenarios"]:
        out[name] = run_scenario(name, a, ask)
    (Path(a["out"]) / f"r{a['rank']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_scenario(name: str, a: dict, ask) -> dict:
    import torch
    import torch.distributed as dist
    from ddp_replicas import gradients, inputs, reset
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_digits import make_model

    from xagg.client.fixedpoint import tolerance
    from xagg.torch import attach

    settings, bucket_mb, steps, events = SCENARIOS[name]
    dtype = getattr(torch, DTYPE_OF.get(name, "float32"))
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    buckets = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
    A, X = (DDP(make_model("tiny", 0).to(dtype), **buckets) for _ in range(2))
    local = make_model("tiny", 0).to(dtype)
    sX = attach(X, [a["aggregator"]], control=[a["control"]], job_id=job_of(name), cookie=77, **settings)
    path, worst = "", 0.0
    for step in range(steps):
        if step in events:
            ask(a, a["asked"], f"{events[step]} {name}")
            a["asked"] += 1
        x, y = inputs(step, a["rank"])
        x = x.to(dtype)
        reset((X.module, local), A.module)
        before = sX.stats["buckets_xagg"]
        grads = gradients((local, A, X), x, y)
        took = "x" if sX.stats["buckets_xagg"] > before else "g"
        assert grads[2].dtype == dtype, f"{name} step {step}: the hook's gradient is {grads[2].dtype}"
        gmax = grads[0].float().abs().max().reshape(1)
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        ga, gx = grads[1].double(), grads[2].double()
        if took == "g" and name != "held":      # redone over gloo: DDP's own reduction
            assert torch.equal(gx, ga), f"{name} step {step}: fallback differs from DDP's gloo all-reduce"
        else:       # xagg: each host's sum of PER_HOST gradients in fixed point over HOSTS workers
            # (a 16-bit model: gloo rounds each rank's share and each partial sum, xagg the mean once)
            bound = (tolerance(PER_HOST * gmax.item(), HOSTS) / WORLD + 2 * WORLD * gmax.item() * 2.0 ** -23
                     + (WORLD + 1) * eps * gmax.item())
            diff = (gx - ga).abs().max().item()
            assert diff <= bound, f"{name} step {step}: |xagg - gloo| = {diff:.3g} > {bound:.3g}"
            worst = max(worst, diff / bound)
        every = [torch.empty_like(gx) for _ in range(WORLD)]
        dist.all_gather(every, gx)
        assert all(torch.equal(e, gx) for e in every), f"{name} step {step}: ranks hold different sums"
        path += took
        with torch.no_grad():
            for p in A.parameters():
                p -= LR * p.grad
    out = dict(path=path, worst=worst, stats=sX.snapshot(), elements=sum(p.numel() for p in A.parameters()))
    sX.close()
    ask(a, a["asked"], f"stats {name}")
    a["asked"] += 1
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side ---------------------------------------------------------------------------
import multiprocessing  # noqa: E402
import random  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from xagg.client import XaggError  # noqa: E402
from xagg.client.fixedpoint import BFLOAT16  # noqa: E402
from xagg.torch.lanes import lane_job_id  # noqa: E402
from xagg.torch.local_reduce import (  # noqa: E402
    HostReduce,
    Hosts,
    HostSegment,
    LocalReduceError,
    job_index,
    share_bounds,
)
from xagg.wire.proto import HDR_DTYPE, C  # noqa: E402


def test_shares_cover_every_bucket_once_on_aligned_starts():
    for n in (1, 5, 16, 17, 1000, 2**20 + 3):
        for shares in (1, 2, 3, 4, 8):
            bounds = [share_bounds(n, i, shares) for i in range(shares)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
            assert all(lo % 16 == 0 for lo, hi in bounds if hi > lo)


def _peer(path: str, me: int, size: int, sizes: list, fail_at: dict, exit_at: int, fast: bool, q) -> None:
    hosts = Hosts(0, 1, me, size, (0,))
    seg = HostSegment(path, hosts, fast=fast)
    red = HostReduce(seg)
    got, held = [], []
    for call, n in enumerate(sizes):
        if call == exit_at and me == size - 1:
            os._exit(0)
        x = (np.arange(n, dtype=np.float32) + call) * (me + 1)

        def share(h, into, call=call):
            if fail_at.get(call) == me:
                raise XaggError("no answer (test)")
            np.multiply(h, 10, out=into)        # stands for the sum over the hosts
        try:
            out = red.allreduce(x, share, key=n, divide=size)
            got.append(("ok", out.tolist()))
            held.append((call, out))
        except XaggError as e:
            got.append(("failed", str(e)))
        except LocalReduceError as e:
            got.append(("stopped", str(e)))
            break
    # a result stays as it was until its bucket's call after next
    kept = [(call, out.tolist() == got[call][1]) for call, out in held]
    q.put((me, dict(got=got, kept=kept, compiled=seg.ops.compiled)))
    red.close()


def _run_peers(tmp_path, size: int, sizes: list, fail_at: dict | None = None, exit_at: int = -1,
               fast: bool = True) -> dict:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    path = str(tmp_path / "segment")
    procs = [ctx.Process(target=_peer, args=(path, me, size, sizes, fail_at or {}, exit_at, fast, q))
             for me in range(size)]
    for p in procs:
        p.start()
    alive = size - (1 if exit_at >= 0 else 0)
    out = dict(q.get(timeout=120) for _ in range(alive))
    for p in procs:
        p.join(30)
    for r in out.values():
        assert r["compiled"] == fast, "the compiled host sum did not load (a C compiler is needed)"
    return {me: r["got"] for me, r in out.items()}, {me: r["kept"] for me, r in out.items()}


def _host_sum(n: int, call: int, size: int) -> list:
    """What the peers' share() makes of their buckets: the average, times ten."""
    x = np.arange(n, dtype=np.float32) + call
    total = x * 1
    for me in range(1, size):
        total = total + x * (me + 1)
    return (total / np.float32(size) * 10).tolist()


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
def test_the_ranks_of_a_host_sum_their_buckets_through_the_segment(tmp_path, fast):
    # grows, shrinks, grows; a bucket (its size its key here) comes again and again
    size, sizes = 3, [10, 1000, 5, 4099, 4099, 10, 4099, 5000, 4099]
    out, kept = _run_peers(tmp_path, size, sizes, fast=fast)
    for call, n in enumerate(sizes):
        for me in range(size):
            assert out[me][call] == ("ok", _host_sum(n, call, size)), (me, call)
    # each bucket's results use two regions in turn: its last two calls still hold theirs,
    # an earlier one was written over (4099's calls 3 and 4 by 6 and 8)
    for me in range(size):
        assert [c for c, ok in kept[me] if not ok] == [3, 4], (me, kept[me])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_compiled_and_numpy_host_sums_agree_to_the_bit(dtype):
    from xagg.client.fixedpoint import narrow, widen
    from xagg.client.host_sum import HostSum
    rng = np.random.default_rng(5)
    fast, ref = HostSum(True), HostSum(False)
    assert fast.compiled and not ref.compiled
    elem = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    scale = 20 if dtype != "float16" else 4                 # fp16: subnormals to Inf, not only those
    for size, n, divide in ((1, 7, 1), (2, 4099, 2), (3, 5000, 6), (4, 2048 * 3 + 1, 8), (8, 100, 1)):
        srcs = [narrow((rng.standard_normal(n) * 10.0 ** rng.integers(-scale, scale, n)).astype(np.float32), elem)
                for _ in range(size)]
        a, b = np.empty(n, np.float32), np.empty(n, np.float32)
        fast.sum(srcs, divide, a)
        ref.sum(srcs, divide, b)
        assert a.tobytes() == b.tobytes(), (dtype, size, n, divide)
        # a 16-bit slice is widened exactly: the float32 sum of the widened slices, bit for bit
        fast.sum([widen(s) for s in srcs], divide, b)
        assert a.tobytes() == b.tobytes(), (dtype, size, n, divide)


def test_the_host_sum_refuses_slices_of_mixed_or_unknown_types():
    from xagg.client.host_sum import HostSum
    out = np.empty(4, np.float32)
    for fast in (True, False):
        with pytest.raises(TypeError, match="host sum"):
            HostSum(fast).sum([np.ones(4, np.float32), np.ones(4, np.float16)], 1, out)
        with pytest.raises(TypeError, match="host sum"):
            HostSum(fast).sum([np.ones(4, np.float64)], 1, out)


def test_a_failed_share_fails_the_bucket_on_every_rank_of_the_host(tmp_path):
    out, _ = _run_peers(tmp_path, 3, [100, 100, 100], fail_at={1: 2})
    for me in range(3):
        assert [r[0] for r in out[me]] == ["ok", "failed", "ok"], out[me]
    assert out[2][1][1] == "no answer (test)"                           # its own reason
    assert out[0][1][1] == out[1][1][1] and "local rank 2" in out[0][1][1]  # the peers name it


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
def test_a_peer_that_exited_is_named_instead_of_waited_for(tmp_path, fast):
    out, _ = _run_peers(tmp_path, 2, [64, 64, 64], exit_at=1, fast=fast)
    assert out[0][0][0] == "ok"
    assert out[0][1][0] == "stopped" and "local rank 1" in out[0][1][1] and "exited" in out[0][1][1], out[0]


SYS_FUTEX = 202                 # x86-64


def _early(path: str, me: int, size: int, go, q) -> None:
    """Rank 0 says where its barrier's futex word is and goes straight in;
    the others come when told."""
    seg = HostSegment(path, Hosts(0, 1, me, size, (0,)))
    red = HostReduce(seg)
    if me == 0:
        q.put(("waiting", os.getpid(), seg.gen.ctypes.data))
    else:
        go.wait()
    out = red.allreduce(np.full(64, me + 1, np.float32), lambda h, into: np.copyto(into, h))
    q.put(("done", me, out.tolist()))
    red.close()


def test_a_rank_waiting_for_its_peers_sleeps_on_the_segments_futex(tmp_path):
    """The compiled barrier: a rank whose peers are late blocks in futex(2)
    on the segment's word (no spinning or polling on cores the host's ranks
    share), and the last rank to arrive wakes it."""
    ctx = multiprocessing.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    path, size = str(tmp_path / "segment"), 2
    procs = [ctx.Process(target=_early, args=(path, me, size, go, q)) for me in range(size)]
    for p in procs:
        p.start()
    _, pid, word = q.get(timeout=120)
    seen = []
    for _ in range(600):                # until it is in the barrier: what it waits in
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
        seen.append(fields[:2])
        if fields[0] == str(SYS_FUTEX) and int(fields[1], 16) == word:
            break
        time.sleep(0.05)
    go.set()
    done = [q.get(timeout=120) for _ in range(size)]
    for p in procs:
        p.join(30)
    assert seen[-1] == [str(SYS_FUTEX), hex(word)], seen[-5:]
    assert sorted(d[1] for d in done) == [0, 1] and all(d[2] == [3.0] * 64 for d in done), done


def test_share_jobs_follow_the_lanes_jobs():
    lanes = 3
    ids = {job_index(k, i, lanes) for k in range(lanes) for i in range(4)}
    assert ids == set(range(12))                        # every job once
    assert [job_index(k, 0, lanes) for k in range(lanes)] == list(range(lanes))   # share 0: the lanes'


# -- the lab ---------------------------------------------------------------------------------
def nft_rule(direction: str, job_id: int) -> str:
    """A rule on a worker host dropping one job's results (in) or packets (out):
    the job id matched in the xagg header behind the UDP header, as sent
    (little-endian; nft compares raw bits as a big-endian number)."""
    bits = 8 * (8 + HDR_DTYPE.fields["job_id"][1])
    assert HDR_DTYPE.fields["job_id"][0].str == "<u4"
    raw = int.from_bytes(struct.pack("<I", job_id), "big")
    hook, port = ("input", "sport") if direction == "in" else ("output", "dport")
    return (f"table inet wfdrop {{\n chain c {{\n  type filter hook {hook} priority 0; policy accept;\n"
            f"  udp {port} {C.XAGG_PORT} @th,{bits},32 {raw:#x} counter drop\n }}\n}}\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_hook_xdp import Xaggd, serve

    from xagg.lab.cluster import Lab, LabSpec
    from xagg.wire.control import ControlClient

    class Daemon(Xaggd):
        """xaggd on a0, and the drop rules on host w1 the ranks ask for."""
        def __init__(self, lab, run_dir):
            super().__init__(lab, run_dir)
            self.registered = {}

        def act(self, action: str) -> None:
            verb, *rest = action.split()
            w1 = self.lab.host("w1")
            if verb in ("drop-in", "drop-out"):
                share, name = int(rest[0]), rest[1]
                job = lane_job_id(job_of(name), job_index(0, share, SCENARIOS[name][0].get("lanes", 1)))
                r = self.lab.exec(w1, ["nft", "-f", "-"], input=nft_rule(verb[5:], job), text=True,
                                  capture_output=True)
                assert r.returncode == 0, r.stderr
            elif verb == "clear":
                self.lab.exec(w1, ["nft", "delete", "table", "inet", "wfdrop"], capture_output=True)
            else:
                if verb == "stats":
                    with ControlClient(self.socket) as c:
                        self.registered[rest[0]] = {str(j["job_id"]): j for j in c.list_jobs()}
                super().act(action)

    out = tmp_path_factory.mktemp("local_reduce")
    with Lab(LabSpec(name=f"wf{os.getpid() % 100000}", workers=HOSTS, aggregators=1)) as lab:
        daemon = Daemon(lab, out)
        try:
            status = daemon.start()
            master = lab.workers[0].ip
            port = random.randrange(20000, 30000)
            arg = json.dumps(dict(aggregator=lab.host("a0").ip, control=daemon.socket, out=str(out),
                                  scenarios=list(SCENARIOS), asked=0))
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            procs = [lab.spawn(w, [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(HOSTS),
                                   "--node-rank", str(k), "--nproc-per-node", str(PER_HOST),
                                   "--master-addr", master, "--master-port", str(port),
                                   os.path.abspath(__file__), "rank", arg],
                               stdout=-1, stderr=-1, text=True, env=env)
                     for k, w in enumerate(lab.workers)]
            serve(procs, out, daemon)
        finally:
            daemon.close()
    ranks = [json.loads((out / f"r{k}.json").read_text()) for k in range(WORLD)]
    return dict(ranks=ranks, jobs=daemon.jobs, registered=daemon.registered, status=status)


def paths(runs, name) -> list[str]:
    res = [r[name] for r in runs["ranks"]]
    print(f"\n{name}: paths {[r['path'] for r in res]}, worst |xagg - gloo| / bound "
          f"{max(r['worst'] for r in res):.3f}")
    return [r["path"] for r in res]


@pytest.mark.parametrize("name", ["unicast", "bcast", "lanes"])
def test_two_hosts_of_two_ranks_sum_every_step_as_ddp_with_the_hosts_as_workers(runs, name):
    steps, lanes = SCENARIOS[name][2], SCENARIOS[name][0].get("lanes", 1)
    assert paths(runs, name) == ["x" * steps] * WORLD
    for r in runs["ranks"]:
        s = r[name]["stats"]
        assert s["fallbacks"] == 0 and s["buckets_gloo"] == 0, s
    # every share job of every lane registered with one worker per host, and each summed
    registered, done = runs["registered"][name], runs["jobs"][name]
    for k in range(lanes):
        for share in range(PER_HOST):
            job = str(lane_job_id(job_of(name), job_index(k, share, lanes)))
            assert registered[job]["n_workers"] == HOSTS, registered[job]
            assert done[job]["completed"] >= steps, done
    mine = [j for j in registered if 0 <= int(j) - job_of(name) < 16]
    assert len(mine) == lanes * PER_HOST, mine          # the lanes' jobs of every share, no more


def test_bf16_buckets_are_shared_and_summed_per_host_without_a_float32_copy(runs):
    assert paths(runs, "bf16") == ["x" * SCENARIOS["bf16"][2]] * WORLD
    for r in runs["ranks"]:
        s = r["bf16"]["stats"]
        assert s["fallbacks"] == 0 and s["buckets_gloo"] == 0, s
        assert s["staged_f32"] == 0, s                                      # no float32 copy of a bucket
        assert s["bytes_xagg"] == SCENARIOS["bf16"][2] * r["bf16"]["elements"] * 2, s     # 2-byte buckets


def test_a_share_one_host_missed_comes_from_a_rank_of_the_other_host(runs):
    got = paths(runs, "held")
    host0, host1 = got[:PER_HOST], got[PER_HOST:]
    assert len(set(host0)) == 1 and len(set(host1)) == 1, got      # a host's ranks alike
    assert host0[0][:3] == "xxx" and host1[0][:3] == "xxg", got     # step 2: host 1 took host 0's sum
    assert host0[0][-2:] == host1[0][-2:] == "xx", got              # back on xagg after the back-off
    for r in runs["ranks"]:
        assert r["held"]["stats"]["fallbacks"] == 1, r["held"]["stats"]


def test_a_share_no_aggregator_finished_is_redone_over_gloo_by_every_rank(runs):
    got = paths(runs, "lost")
    assert len(set(got)) == 1 and got[0][:3] == "xxg" and got[0][-2:] == "xx", got
    for r in runs["ranks"]:
        assert r["lost"]["stats"]["fallbacks"] == 1, r["lost"]["stats"]


def test_train_digits_under_xagg_client_run_sums_each_host_as_one_worker(tmp_path):
    """examples/train_digits.py as users start it on 2 lab hosts: `xagg-client
    run --nproc-per-node 2` on each, rank 0 registering the job: every step
    of every rank through xagg, the job's workers the two hosts."""
    from xagg.lab.cluster import Lab, LabSpec
    from xagg.lab.experiment import Aggregators
    from xagg.lab.training import DIGITS

    steps, status = 6, tmp_path / "status"
    with Lab(LabSpec(name=f"wfd{os.getpid() % 10000}", workers=HOSTS, aggregators=1)) as lab, \
            Aggregators(lab) as aggs:
        port = random.randrange(20000, 30000)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        procs = [lab.spawn(w, [sys.executable, "-m", "xagg.torch.cli", "run", "-a", lab.host("a0").ip,
                               "--control", aggs.controls[0].address, "--fanout", "unicast",
                               "--nproc-per-node", str(PER_HOST), "--nnodes", str(HOSTS), "--node-rank", str(k),
                               "--master-addr", lab.workers[0].ip, "--master-port", str(port),
                               "--status-dir", str(status), "--progress", "0", "--",
                               str(DIGITS), "--model", "tiny", "--epochs", "1", "--max-steps", str(steps)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k, w in enumerate(lab.workers)]
        errs = [p.communicate(timeout=600)[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
        jobs = aggs.controls[0].list_jobs()
    ranks = [json.loads((status / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for s in ranks:
        assert s["buckets_xagg"] >= steps and s["buckets_gloo"] == 0 and s["fallbacks"] == 0, s
    job = ranks[0]["job_id"]
    shares = {j["job_id"]: j for j in jobs if 0 <= j["job_id"] - job < PER_HOST}
    assert sorted(shares) == [job + i for i in range(PER_HOST)], jobs
    assert all(j["n_workers"] == HOSTS for j in shares.values()), shares
