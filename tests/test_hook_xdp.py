"""The product's main path on the real data plane: the DDP hook
(`XaggState` / `xagg_hook`) in four torch.distributed ranks, one per
worker namespace of a lab, against xaggd with its XDP program attached
to the aggregator's veth. Rank 0 registers each job through the daemon's
control socket, as `xagg-client run --control` does.

Every step trains two replicas on the same inputs, plain DDP (gloo) and
DDP with the xagg hook, the hooked one reset to the plain one's parameters
first, so each step checks one all-reduce: the hook's gradients are within
the fixed-point bound of gloo's where the step went through xagg, equal to
gloo's bit for bit where it fell back (the fallback is gloo's own
reduction), and the same bits on every rank either way.

Scenarios, in one start of the ranks (torch's start-up is the slow part):
unicast and broadcast fan-out, and broadcast to a multicast group the
workers join; two lanes on a three-bucket model; xaggd
stopped mid-run (its program detached: the step's bucket is redone over
gloo) and started again (after the back-off rank 0 registers the job
anew and the ranks go back to xagg); xaggd killed (SIGKILL: the program it
leaves attached goes on summing) and started again in its place.

With XAGG_TEST_DEVICE=cuda (`make gpu-test`) the models, inputs and
gradients live on the GPU, so the hook's buckets are CUDA tensors staged
through host memory; the checks gather on the CPU (gloo has no CUDA
all_gather).

Run as ``python tests/test_hook_xdp.py rank JSON``, this file is one rank;
rank 0 asks the test for daemon actions through files in the shared
output directory.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from xagg.wire.fanout import DEFAULT_GROUP

WORLD = 4
DEVICE = os.environ.get("XAGG_TEST_DEVICE", "cpu")
REPO = Path(__file__).resolve().parent.parent
LR = 0.3
FAST = dict(timeout=10.0, rto=0.05)                 # healthy scenarios: a timeout never expected
BACKOFF = dict(timeout=5.0, rto=0.05, backoff_steps=2, max_backoff_steps=2)   # one step times out
# name -> (hook settings, buckets of the model (None: DDP's one), steps, {step: daemon action})
SCENARIOS = {
    "unicast": (dict(fanout="unicast", **FAST), None, 5, {}),
    "bcast": (dict(fanout="bcast", **FAST), None, 5, {}),
    "group": (dict(fanout="bcast", result_group=DEFAULT_GROUP, **FAST), None, 5, {}),
    "lanes": (dict(fanout="unicast", lanes=2, **FAST), 0.002, 5, {}),
    # stopped before step 3, which times out and is redone over gloo; back-off 4, 5; the
    # retry after 5 finds no daemon: 6, 7 on gloo; started before 7: the retry after 7 succeeds
    "stopped": (dict(fanout="unicast", **BACKOFF), None, 11, {3: "stop", 7: "start"}),
    # killed before step 3: the program it left attached goes on summing; a new xaggd
    # before step 6 replaces it and restores the job from its run directory
    "killed": (dict(fanout="unicast", **BACKOFF), None, 9, {3: "kill", 6: "start"}),
}


# -- one rank ------------------------------------------------------------------------------
def rank_main(a: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist

    from ddp_replicas import deterministic
    torch.set_num_threads(1)
    deterministic()
    log = []

    class Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    lg = logging.getLogger("xagg.torch")
    lg.addHandler(Keep())
    lg.setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"], world_size=WORLD)
    out = {}
    for name in a["scenarios"]:
        log.clear()
        out[name] = run_scenario(name, a, log)
    (Path(a["out"]) / f"r{a['rank']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_scenario(name: str, a: dict, log: list) -> dict:
    import torch
    import torch.distributed as dist
    from ddp_replicas import ask, gradients, inputs, reset
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_digits import make_model

    from xagg.client.fixedpoint import tolerance
    from xagg.torch import attach

    settings, bucket_mb, steps, events = SCENARIOS[name]
    buckets = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
    dev = torch.device(a["device"])
    A, X = (DDP(make_model("tiny", 0).to(dev), **buckets) for _ in range(2))
    local = make_model("tiny", 0).to(dev)       # no DDP: this rank's own gradient
    sX = attach(X, [a["aggregator"]], control=[a["control"]], **settings)
    path, worst = "", 0.0
    for step in range(steps):
        if step in events:
            ask(a, a["asked"], events[step])
            a["asked"] += 1
        x, y = inputs(step, a["rank"], dev)
        reset((X.module, local), A.module)
        before = sX.stats["buckets_xagg"]
        grads = gradients((local, A, X), x, y)
        took = "x" if sX.stats["buckets_xagg"] > before else "g"      # this step's path
        gmax = grads[0].abs().max().reshape(1)
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        ga, gx = grads[1], grads[2]
        if took == "g":     # the fallback is gloo's own reduction: the same bits
            assert torch.equal(gx, ga), (f"{name} step {step}: fallback differs from DDP's gloo all-reduce "
                                         f"(by up to {(gx - ga).abs().max().item():.3g})")
        else:               # xagg's fixed point, and gloo's float32 rounding of the same sum
            bound = tolerance(gmax.item(), WORLD) / WORLD + WORLD * gmax.item() * 2.0 ** -23
            diff = (gx - ga).abs().max().item()
            assert diff <= bound, f"{name} step {step}: |xagg - gloo| = {diff:.3g} > {bound:.3g}"
            worst = max(worst, diff / bound)
        assert gx.device.type == dev.type, f"{name} step {step}: the gradient left {dev}"
        gx = gx.cpu()
        every = [torch.empty_like(gx) for _ in range(WORLD)]
        dist.all_gather(every, gx)
        assert all(torch.equal(e, gx) for e in every), f"{name} step {step}: ranks hold different sums"
        path += took
        with torch.no_grad():
            for p in A.parameters():
                p -= LR * p.grad
    out = dict(path=path, worst=worst, stats=sX.snapshot(), log=list(log))
    sX.close()
    ask(a, a["asked"], f"stats {name}")       # the daemon's counters before the next scenario restarts it
    a["asked"] += 1
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side: the lab, xaggd and the ranks ---------------------------------------------
import random  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from xagg.lab.cluster import Lab, LabSpec  # noqa: E402
from xagg.wire.control import ControlClient  # noqa: E402
from xaggd.dataplane.attach import xdp_program  # noqa: E402


class Xaggd:
    """xaggd with XDP on the lab's aggregator, acting as the ranks ask:
    "stop" (SIGTERM), "kill" (SIGKILL), "start", "stats NAME" (the jobs'
    counters, kept under NAME). Records the XDP program attached around
    each action."""

    def __init__(self, lab: Lab, run_dir: Path):
        self.lab, self.a0 = lab, lab.host("a0")
        self.name, self.run_dir = f"{lab.name}-a0", run_dir
        self.socket = str(run_dir / f"{self.name}.sock")
        self.proc, self.logs = None, []
        self.attached, self.jobs, self.results_to = {}, {}, {}

    def program(self) -> dict | None:
        return xdp_program(self.a0.ifname, self.a0.netns)

    def start(self) -> dict:
        self.logs.append(open(self.run_dir / f"xaggd-{len(self.logs)}.log", "w"))
        self.proc = self.lab.spawn(self.a0, [sys.executable, "-m", "xaggd.cli", "start", "--name", self.name,
                                             "--iface", self.a0.ifname, "--run-dir", str(self.run_dir),
                                             "--max-slots", "4096", "--log-level", "info"],
                                   stdout=self.logs[-1], stderr=subprocess.STDOUT)
        with ControlClient(self.socket) as c:
            status = c.wait_ready(timeout=120)
        self.attached.setdefault("after start", []).append(self.program())
        return status

    def act(self, action: str) -> None:
        if action.startswith("stats "):
            with ControlClient(self.socket) as c:
                name = action.split()[1]
                self.jobs[name] = c.stats()["jobs"]
                self.results_to[name] = {str(j["job_id"]): j["bcast_ip"] for j in c.list_jobs()}
        elif action == "start":
            self.start()
        else:
            self.attached[f"before {action}"] = self.program()
            self.proc.terminate() if action == "stop" else self.proc.kill()
            self.proc.wait(30)
            self.attached[f"after {action}"] = self.program()

    def log_text(self) -> str:
        return "".join((self.run_dir / f"xaggd-{k}.log").read_text() for k in range(len(self.logs)))

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.act("stop")
        for f in self.logs:
            f.close()


def serve(procs, out: Path, daemon: Xaggd) -> None:
    """Carry out rank 0's requests (req-N, answered with ack-N) until the
    ranks exit; a failed rank ends the run (the others would wait for it)."""
    asked = 0
    while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
        req = out / f"req-{asked}"
        if req.exists():
            daemon.act(req.read_text())
            (out / f"ack-{asked}").write_text("")
            asked += 1
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    errors = [p.communicate()[1][-3000:] for p in procs if p.returncode]
    assert not errors, "\n".join(errors) + daemon.log_text()[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, run by 4 ranks: each rank's results, the daemon's
    per-job counters after each scenario, the programs attached."""
    if DEVICE != "cpu":
        import torch
        if not torch.cuda.is_available():
            pytest.fail(f"XAGG_TEST_DEVICE={DEVICE}, but torch {torch.__version__} sees no CUDA device")
    out = tmp_path_factory.mktemp("hook_xdp")
    with Lab(LabSpec(name=f"hx{os.getpid() % 100000}", workers=WORLD, aggregators=1)) as lab:
        daemon = Xaggd(lab, out)
        try:
            status = daemon.start()
            master = f"{lab.workers[0].ip}:{random.randrange(20000, 30000)}"
            procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), "rank", json.dumps(dict(
                rank=k, master=master, aggregator=lab.host("a0").ip, control=daemon.socket, out=str(out),
                device=DEVICE,
                scenarios=list(SCENARIOS), asked=0))], stdout=-1, stderr=-1, text=True)
                for k, w in enumerate(lab.workers)]
            serve(procs, out, daemon)
        finally:
            daemon.close()
    ranks = [json.loads((out / f"r{k}.json").read_text()) for k in range(WORLD)]
    return dict(ranks=ranks, jobs=daemon.jobs, results_to=daemon.results_to, status=status,
                attached=daemon.attached)


def scenario(runs, name):
    res = [r[name] for r in runs["ranks"]]
    print(f"\n{name}: path {res[0]['path']}, worst |xagg - gloo| / bound {max(r['worst'] for r in res):.3f}, "
          f"last fallback: {res[0]['stats']['reason'] or 'none'}")
    assert all(r["path"] == res[0]["path"] for r in res), "ranks disagree on the path"
    return res


def chunks_per_step(runs, stats) -> int:
    """Data and meta chunks of one step of the one-bucket model."""
    from xagg.wire.chunks import meta_chunks
    data = -(-stats["bytes_xagg"] // (4 * stats["buckets_xagg"]) // runs["status"]["vals"])
    return data + meta_chunks(data, runs["status"]["vals"])


def test_xaggd_serves_from_xdp(runs):
    assert runs["status"]["backend"] == "xdp" and runs["status"]["frames"] == "linear"
    first = runs["attached"]["after start"][0]
    assert first["name"] == "xagg_xdp" and first["mode"] == "xdp"          # in driver mode


@pytest.mark.parametrize("fanout", ["unicast", "bcast", "group"])
def test_every_step_through_the_xdp_program_equals_ddp(runs, fanout):
    res = scenario(runs, fanout)
    steps = SCENARIOS[fanout][2]
    s0 = res[0]["stats"]
    assert res[0]["path"] == "x" * steps
    for r in res:
        s = r["stats"]
        assert s["buckets_xagg"] == steps and s["buckets_gloo"] == 0 and s["fallbacks"] == 0, s
        assert s["redone"] == s0["redone"]
    # the program completed every chunk of every step once, and again those
    # whose predicted exponent missed (the first step's data chunks, at least)
    job = runs["jobs"][fanout][str(s0["job_id"])]
    if fanout == "group":       # rank 0 registered the job with its group as the results' address
        assert runs["results_to"][fanout][str(s0["job_id"])] == DEFAULT_GROUP, runs["results_to"]
    per_step = chunks_per_step(runs, s0)
    assert job["completed"] == steps * per_step + s0["redone"], job
    assert s0["redone"] >= per_step - 1


def test_two_lanes_sum_every_bucket_through_their_own_jobs(runs):
    res = scenario(runs, "lanes")
    steps = SCENARIOS["lanes"][2]
    assert res[0]["path"] == "x" * steps
    for r in res:
        s = r["stats"]
        assert s["buckets_xagg"] >= 3 * (steps - 1) and s["buckets_gloo"] == 0 and s["fallbacks"] == 0, s
    job = res[0]["stats"]["job_id"]
    for lane in (0, 1):                 # lane k is job JOB + k: each summed a bucket every step
        assert runs["jobs"]["lanes"][str(job + lane)]["completed"] >= 2 * steps, runs["jobs"]["lanes"]


def test_stopped_xaggd_falls_back_to_gloo_and_the_job_returns(runs):
    res = scenario(runs, "stopped")
    path = res[0]["path"]
    assert path == "xxx" + "g" * 5 + "xxx", path
    assert runs["attached"]["before stop"] is not None and runs["attached"]["after stop"] is None  # detached
    for r in res:
        s = r["stats"]
        assert s["fallbacks"] == 1 and s["retries"] == 2 and s["recoveries"] == 1, s
        assert s["buckets_xagg"] == path.count("x") and s["buckets_gloo"] == path.count("g"), s
    assert any("retry failed" in m for m in res[0]["log"]), res[0]["log"]
    # the restarted daemon's program summed the steps after the return (the
    # registration that took the job back reset its counters)
    job = runs["jobs"]["stopped"][str(res[0]["stats"]["job_id"])]
    assert job["completed"] >= 3 * chunks_per_step(runs, res[0]["stats"]), job


def test_killed_xaggd_leaves_its_program_summing_and_a_new_one_takes_over(runs):
    res = scenario(runs, "killed")
    path, steps = res[0]["path"], SCENARIOS["killed"][2]
    killed, new = runs["attached"]["after kill"], runs["attached"]["after start"][-1]
    assert killed is not None and killed["id"] == runs["attached"]["before kill"]["id"]    # left attached
    assert new["id"] != killed["id"]                    # the new daemon's program replaced it
    assert path == "x" * steps, path                    # not one step lost
    for r in res:
        s = r["stats"]
        assert s["buckets_xagg"] == steps and s["fallbacks"] == 0, s
    # the steps after the new daemon came up were summed by its program
    job = runs["jobs"]["killed"][str(res[0]["stats"]["job_id"])]
    assert job["completed"] >= (steps - 6) * chunks_per_step(runs, res[0]["stats"]), job
