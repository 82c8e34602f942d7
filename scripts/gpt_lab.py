"""Step time and loss of examples/train_gpt.py (a 13.8 M-parameter GPT,
AdamW, plain DDP: a third-party-style script) under ``xagg-client run`` on
a lab, per run, gloo in the same lab.

    .venv/bin/python scripts/gpt_lab.py [--runs 'gloo;none;int16;auto'] [--steps 100] [--mtu 1500]
        [--rate 1gbit] [--agg-rate 4gbit] [--to-loss 8.33,7.72]

Four workers at 1 Gbit/s, the aggregator at 4 Gbit/s (or the rates
given), one rank per worker host, the client's default fan-out and worker
path. A run is ``gloo``, ``none`` (dense xagg) or a ``--compress`` spec,
with ``@N`` its own number of steps (``gloo@10``: on a slow link a few
steps tell its step time). Each row: the median step (rank 0's, optimizer
to the gradients' sums) over all steps and over the last 20, the mean loss
of the last 5 steps, with ``--to-loss`` the time to that loss (the steps'
times summed until the mean of the last 5 losses is first at or below it:
how a run that trains less per step is judged), and rank 0's ``compress
auto`` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from xagg.bench.compress import time_to_loss
from xagg.client.config import DEFAULT_PATH
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, resolve
from xagg.torch.lanes import lane_jobs

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
PARAMS = 13_817_856         # GPT() in examples/train_gpt.py
WORLD = 4


def run_once(lab, aggs, run: str, steps: int) -> tuple[dict, list, str]:
    """One run on the lab: (rank 0's --out, rank 0's xagg-client lines, the
    fan-out and worker path its sums took: the client's defaults)."""
    gloo = run == "gloo"
    how = "gloo's ring (TCP)"
    cmd = [sys.executable, "-m", "xagg.torch.cli", "run", "--aggregators", lab.aggregators[0].ip,
           "--transport", "gloo" if gloo else "xagg", "--nproc-per-node", "1"]
    job = (random.randrange(1, 2**31), random.randrange(2**32))
    if not gloo:
        chosen = resolve(lab, aggs.hosts, WORLD, "auto", "")     # the lab registers the job, as lab_train does
        aggs.register(*job, WORLD, PARAMS, chosen.fanout, result_port=lane_jobs(job[0], 1)[0][1],
                      result_group=chosen.group)
        cmd += ["--fanout", chosen.fanout.label, "--job-id", str(job[0]), "--cookie", str(job[1])]
        cmd += ["--result-group", chosen.group] if chosen.group else []
        how = f"fan-out {chosen.fanout.label}{' to ' + chosen.group if chosen.group else ''}, {DEFAULT_PATH} path"
        cmd += ["--compress", run] if run != "none" else []
    port = random.randrange(20000, 30000)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            procs = [lab.spawn(w, cmd + ["--nnodes", str(WORLD), "--node-rank", str(k), "--master-addr",
                                         lab.workers[0].ip, "--master-port", str(port), "--", str(SCRIPT),
                                         "--steps", str(steps), "--out", out],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "GLOO_SOCKET_IFNAME": w.ifname})
                     for k, w in enumerate(lab.workers)]
            errs = [p.communicate(timeout=3600)[1] for p in procs]
            for k, p in enumerate(procs):
                if p.returncode:
                    raise RuntimeError(f"{run}: rank {k} failed ({p.returncode}): {errs[k][-3000:]}")
            return json.loads(Path(out).read_text()), [ln for ln in errs[0].splitlines()
                                                       if ln.startswith("xagg-client: compress auto")], how
    finally:
        if not gloo:
            aggs.remove(job[0])


def time_to(r: dict, loss: float) -> str:
    """How long the run took to reach ``loss`` (the mean of the last 5
    steps' losses), or how far it got."""
    reached = time_to_loss(r["losses"], r["steps_ms"], loss, span=5)
    if reached:
        return f"loss {loss:g} after {reached[0]} steps, {reached[1]:.1f} s"
    return f"loss {loss:g} not reached in {len(r['losses'])} steps ({sum(r['steps_ms']) / 1e3:.1f} s)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="gloo;none;int16;auto", help="';'-separated: gloo, none or a --compress spec")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--rate", default="1gbit", help="the workers' links (tc rate)")
    ap.add_argument("--agg-rate", default="4gbit", help="the aggregator's link (tc rate)")
    ap.add_argument("--to-loss", help="also say each run's time to these losses (','-separated)")
    ap.add_argument("--name", default=f"gp{os.getpid() % 100}")
    args = ap.parse_args()
    spec = LabSpec(name=args.name, workers=WORLD, aggregators=1, mtu=args.mtu, rate=args.rate,
                   rate_of={"a0": args.agg_rate})
    print(f"workers {args.rate}, aggregator {args.agg_rate}, MTU {args.mtu}", flush=True)
    # 13.8 M elements need 77,844 slots at MTU 1500 (two per 358-value chunk)
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=131072) as aggs:
        base = None
        for run in [r for r in args.runs.split(";") if r]:
            run, _, steps = run.partition("@")
            r, said, how = run_once(lab, aggs, run, int(steps or args.steps))
            s, last = r["steps_ms"], statistics.median(r["steps_ms"][-20:])
            base = last if run == "gloo" else base
            ratio = f", {base / last:.2f}x gloo" if base else ""
            to = "".join(f"; {time_to(r, float(x))}" for x in (args.to_loss or "").split(",") if x)
            print(f"MTU {args.mtu} {run}: median step {statistics.median(s):.0f} ms, last 20 {last:.0f} ms{ratio}; "
                  f"loss {r['losses'][0]:.3f} -> {statistics.mean(r['losses'][-5:]):.3f}{to} ({how})", flush=True)
            for ln in dict.fromkeys(said):       # said at start and again at exit
                print(f"    {ln}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
