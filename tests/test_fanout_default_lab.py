"""The hook's default fan-out on the real data plane: four torch.distributed
ranks, one per worker namespace of a lab, xaggd with its XDP program on
the aggregator's veth, and no fan-out given (``--fanout auto``).

* "delivers": every worker is on the aggregator's segment, so the default
  registers the job with results to a multicast group; every step goes
  through xagg and equals DDP's gloo all-reduce within the fixed-point bound.
* "dropped": the switch forwards no multicast to one worker's port (an
  nftables rule in the lab's switch namespace, as a switch without
  multicast forwarding there would): the first round's probe misses on that
  rank, rank 0 re-registers the job with unicast fan-out and logs one line
  naming the setting, and every step still goes through xagg, none on gloo.

Run as ``python tests/test_fanout_default_lab.py rank JSON``, this file is
one rank; rank 0 asks the test for actions through files in the shared
output directory (tests/test_hook_xdp.py's pattern).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

WORLD = 4
REPO = Path(__file__).resolve().parent.parent
SETTINGS = dict(timeout=5.0, rto=0.05)      # and no fanout: the default
SCENARIOS = ("delivers", "dropped")
STEPS = 4
MISSING = 3                                 # the rank whose switch port drops multicast


def rank_main(a: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist
    from ddp_replicas import ask

    torch.set_num_threads(1)
    log = []

    class Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    lg = logging.getLogger("xagg.torch")
    lg.addHandler(Keep())
    lg.setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"], world_size=WORLD)
    out = {}
    for n, name in enumerate(SCENARIOS):
        log.clear()
        ask(a, n, f"before {name}")
        out[name] = run_scenario(name, a, log)
    (Path(a["out"]) / f"r{a['rank']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_scenario(name: str, a: dict, log: list) -> dict:
    import torch
    import torch.distributed as dist
    from ddp_replicas import gradients, inputs, reset
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_digits import make_model

    from xagg.client.fixedpoint import tolerance
    from xagg.torch import attach

    A, X = (DDP(make_model("tiny", 0)) for _ in range(2))
    sX = attach(X, [a["aggregator"]], control=[a["control"]], **SETTINGS)
    path, worst = "", 0.0
    for step in range(STEPS):
        x, y = inputs(step, a["rank"])
        reset((X.module,), A.module)
        before = sX.stats["buckets_xagg"]
        ga, gx = gradients((A, X), x, y)
        path += "x" if sX.stats["buckets_xagg"] > before else "g"
        gmax = ga.abs().max().reshape(1)
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        bound = tolerance(gmax.item(), WORLD) / WORLD + WORLD * gmax.item() * 2.0 ** -23
        worst = max(worst, (gx - ga).abs().max().item() / bound)
        with torch.no_grad():
            for p in A.parameters():
                p -= 0.3 * p.grad
    out = dict(path=path, worst=worst, job_id=sX.job_id, fallbacks=sX.snapshot()["fallbacks"], log=list(log))
    sX.close()
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side: the lab, xaggd, the switch's rule and the ranks ---------------------------
import random  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from xagg.lab.cluster import Lab, LabSpec  # noqa: E402
from xagg.wire.control import ControlClient  # noqa: E402
from xagg.wire.fanout import DEFAULT_GROUP  # noqa: E402

NFT_TABLE = "xagg_no_mcast"


def no_multicast_to(lab: Lab, host: str) -> str:
    """The switch forwards no multicast out of ``host``'s port (a bridge-family
    rule in the lab's switch namespace): the nft script."""
    port = lab.host(host).port
    return (f"table bridge {NFT_TABLE} {{\n  chain forward {{\n"
            f"    type filter hook forward priority 0; policy accept;\n"
            f"    oifname \"{port}\" ip daddr 224.0.0.0/4 counter drop\n  }}\n}}\n")


def dropped_frames(lab: Lab) -> int:
    out = lab.exec("switch", ["nft", "-j", "list", "table", "bridge", NFT_TABLE], capture_output=True,
                   text=True, check=True).stdout
    return sum(r["counter"]["packets"] for item in json.loads(out)["nftables"] if "rule" in item
               for r in item["rule"]["expr"] if "counter" in r)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fanout_default")
    jobs, dropped = {}, None
    with Lab(LabSpec(name=f"wd{os.getpid() % 100000}", workers=WORLD, aggregators=1)) as lab:
        a0 = lab.host("a0")
        name = f"{lab.name}-a0"
        sock = str(out / f"{name}.sock")
        logf = open(out / "xaggd.log", "w")
        daemon = lab.spawn(a0, [sys.executable, "-m", "xaggd.cli", "start", "--name", name, "--iface", a0.ifname,
                                "--run-dir", str(out), "--max-slots", "4096", "--log-level", "info"],
                           stdout=logf, stderr=subprocess.STDOUT)
        try:
            with ControlClient(sock) as c:
                try:
                    c.wait_ready(timeout=120)
                except Exception as e:
                    pytest.fail(f"xaggd did not start: {e}\n{(out / 'xaggd.log').read_text()[-3000:]}")
            master = f"{lab.workers[0].ip}:{random.randrange(20000, 30000)}"
            procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), "rank", json.dumps(dict(
                rank=k, master=master, aggregator=a0.ip, control=sock, out=str(out)))],
                stdout=-1, stderr=-1, text=True) for k, w in enumerate(lab.workers)]
            asked = 0
            while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
                req = out / f"req-{asked}"
                if req.exists():
                    if req.read_text() == "before dropped":
                        with ControlClient(sock) as c:      # the first scenario's job, as registered
                            jobs.update({j["job_id"]: j for j in c.list_jobs()})
                        lab.exec("switch", ["nft", "-f", "-"], input=no_multicast_to(lab, f"w{MISSING}"),
                                 text=True, check=True)
                    (out / f"ack-{asked}").write_text("")
                    asked += 1
                time.sleep(0.05)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            errors = [p.communicate()[1][-3000:] for p in procs if p.returncode]
            assert not errors, "\n".join(errors) + (out / "xaggd.log").read_text()[-3000:]
            with ControlClient(sock) as c:
                jobs.update({j["job_id"]: j for j in c.list_jobs()})
            dropped = dropped_frames(lab)
        finally:
            daemon.terminate()
            daemon.wait(30)
            logf.close()
    ranks = [json.loads((out / f"r{k}.json").read_text()) for k in range(WORLD)]
    return dict(ranks=ranks, jobs=jobs, dropped=dropped)


def scenario(runs, name):
    res = [r[name] for r in runs["ranks"]]
    print(f"\n{name}: path {res[0]['path']}, worst |xagg - gloo| / bound {max(r['worst'] for r in res):.3f}; "
          f"rank 0 logged: {res[0]['log']}; the others: {[r['log'] for r in res[1:]]}")
    return res, runs["jobs"][res[0]["job_id"]]


def test_the_default_sends_results_to_a_group_where_every_worker_is_on_the_segment(runs):
    res, job = scenario(runs, "delivers")
    assert (job["fanout"], job["bcast_ip"]) == ("bcast", DEFAULT_GROUP)
    assert all(r["path"] == "x" * STEPS for r in res) and all(r["fallbacks"] == 0 for r in res)
    assert all(r["worst"] <= 1.0 for r in res)
    assert any(f"results by multicast group {DEFAULT_GROUP}" in line for line in res[0]["log"])
    assert not any("did not reach" in line for r in res for line in r["log"])


def test_a_group_the_switch_drops_moves_the_job_to_unicast_in_one_line(runs):
    res, job = scenario(runs, "dropped")
    assert runs["dropped"] > 0                      # the rule did drop the group's frames
    assert job["fanout"] == "unicast"               # re-registered at the daemon
    assert all(r["path"] == "x" * STEPS for r in res) and all(r["fallbacks"] == 0 for r in res)
    assert all(r["worst"] <= 1.0 for r in res)
    lines = [line for line in res[0]["log"] if "did not reach" in line]
    assert len(lines) == 1 and f"group {DEFAULT_GROUP} did not reach rank(s) {MISSING} before" in lines[0]
    assert "--fanout" in lines[0] and "unicast" in lines[0]
    assert not any("did not reach" in line for r in res[1:] for line in r["log"])
