"""DDP training runs on a lab: the digits example (examples/train_digits.py),
one rank per worker host under ``xagg-client run``, over xagg or gloo.

Used by ``make demo`` (accuracy and step time of both transports) and the
bench's train section. The example ships with the checkout, not the
package: these runs need a checkout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from xagg.lab.cluster import LabError
from xagg.lab.experiment import resolve
from xagg.torch.lanes import lane_jobs
from xagg.wire.fanout import AUTO, Fanout

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


@lru_cache(maxsize=None)
def digits_example():
    """examples/train_digits.py as a module (for its model; the ranks run it as a script)."""
    if not DIGITS.exists():
        raise LabError(f"{DIGITS} not found: training runs on the lab need a checkout of xagg "
                       "(examples/ is not installed with the package)")
    spec = importlib.util.spec_from_file_location("train_digits", DIGITS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def n_params(model: str) -> int:
    """Parameters of the example's model ``model`` ("tiny", "small")."""
    return sum(p.numel() for p in digits_example().make_model(model).parameters())


def client_command(transport: str, aggregators: str, *, nproc: int = 4, steps: int = 60, model: str = "small",
                   out: str | None = None, job: tuple[int, int] | None = None, control: str | None = None,
                   token_file: str | None = None, torchrun: list[str] | None = None,
                   epochs: int = 1000, fanout: Fanout | str = AUTO, vals: int | None = None,
                   optimizer: str = "adam", lanes: int = 1, compress: str | None = None,
                   result_group: str = "", lr: float | None = None) -> list[str]:
    """The ``xagg-client run`` command line of one run of the example. ``torchrun``:
    extra launcher flags (e.g. ["--nnodes", "4", "--node-rank", "0", "--master-addr",
    "10.77.0.1"]), for one rank per lab host started with ``xagg lab exec wK -- ...``."""
    cmd = [sys.executable, "-m", "xagg.torch.cli", "run", "--aggregators", aggregators,
           "--transport", transport, "--nproc-per-node", str(nproc),
           "--fanout", fanout if fanout == AUTO else Fanout.parse(fanout).label]
    if result_group:
        cmd += ["--result-group", result_group]
    if vals:
        cmd += ["--vals", str(vals)]
    if lanes > 1:
        cmd += ["--lanes", str(lanes)]
    if compress:
        cmd += ["--compress", compress]
    if job:
        cmd += ["--job-id", str(job[0]), "--cookie", str(job[1])]
    if control:
        cmd += ["--control", control] + (["--token-file", token_file] if token_file else [])
    cmd += list(torchrun or [])
    cmd += ["--", str(DIGITS), "--model", model, "--optimizer", optimizer, "--epochs", str(epochs),
            "--max-steps", str(steps)]
    cmd += ["--lr", repr(lr)] if lr else []     # None: the example's default for the optimizer
    return cmd + (["--out", out] if out else [])


def summary(result_file: str) -> dict:
    """Step and communication time of one run, from the example's --out file."""
    with open(result_file) as f:
        r = json.load(f)
    hook = r["hook"] or {}
    return {"step_ms": r["step_ms"], "steps_ms": r.get("steps_ms", []), "losses": r.get("losses", []),
            "comm_ms": 1e3 * hook.get("seconds_comm", 0) / max(1, hook.get("steps", 1)),
            "cpu_ms": r.get("machine_cpu_ms_per_step"), "ranks_cpu_ms": r.get("ranks_cpu_ms_per_step"),
            "path": hook.get("path"),
            "fallbacks": hook.get("fallbacks", 0), "final_test_acc": r["final_test_acc"],
            "final_loss": r["epochs"][-1]["loss"] if r.get("epochs") else None,
            "retransmits": hook.get("retransmits", 0), "max_in_flight": hook.get("max_in_flight", 0),
            "hook": hook}


def lab_train(lab, aggs=None, transport: str = "xagg", *, epochs: int = 8, steps: int = 0,
              model: str = "small", optimizer: str = "adam", fanout: Fanout | str = AUTO,
              echo: bool = True, timeout: float = 1800, lanes: int = 1, compress: str | None = None,
              lr: float | None = None) -> dict:
    """The example on a lab (xagg.lab.Lab): one rank per worker host, started
    there with ``xagg-client run`` (torchrun, one node each). ``aggs``: an
    xagg.lab.experiment.Aggregators holding the job (needed for transport xagg),
    and with ``lanes`` > 1 the job of each lane (xagg.torch.lanes).
    Rank 0's epoch lines are echoed; returns ``summary()`` of the run, with
    ``said``: rank 0's ``xagg-client:`` lines (what it says at exit), and
    ``results``: how results came back (a planner model name; "auto" resolved
    as the hook would, the lab registering the job)."""
    n = len(lab.workers)
    job, jobs, group, results = None, [], "", ""
    if transport == "xagg":
        job = (random.randrange(1, 2**31), random.randrange(2**32))
        jobs = lane_jobs(job[0], lanes)
        # the lab registers the job, so it resolves "auto" as the hook would and tells the ranks
        chosen = resolve(lab, aggs.hosts, n, fanout, "")
        fanout, group, results = chosen.fanout, chosen.group, chosen.model
        for job_id, port in jobs:
            aggs.register(job_id, job[1], n, n_params(model), fanout, result_port=port, result_group=group)
    port = random.randrange(20000, 30000)
    agg_addrs = ",".join(h.ip for h in lab.aggregators)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for k, w in enumerate(lab.workers):
            launcher = ["--nnodes", str(n), "--node-rank", str(k), "--master-addr", lab.workers[0].ip,
                        "--master-port", str(port)]
            cmd = client_command(transport, agg_addrs, nproc=1, steps=steps, model=model, out=out, job=job,
                                 torchrun=launcher, epochs=epochs, fanout=fanout, optimizer=optimizer,
                                 vals=aggs.vals if aggs else None, lanes=lanes, compress=compress,
                                 result_group=group, lr=lr)
            # lab hosts resolve their own name to 127.0.0.1: gloo must use eth0
            env = {**os.environ, "GLOO_SOCKET_IFNAME": w.ifname}
            procs.append(lab.spawn(w, cmd, stdout=subprocess.PIPE if k == 0 else subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, env=env))
        for line in procs[0].stdout:
            if echo and line.startswith("epoch"):
                print(f"[{transport}] {line.rstrip()}", flush=True)
        said = []
        try:
            for k, p in enumerate(procs):
                p.wait(timeout)
                err = p.stderr.read()
                if p.returncode:
                    raise RuntimeError(f"{transport} rank {k} failed ({p.returncode}): {err[-3000:]}")
                if k == 0:
                    said = [ln for ln in err.splitlines() if ln.startswith("xagg-client:")]
        finally:
            for job_id, _ in jobs:
                aggs.remove(job_id)         # its slots go back to the pool for the next run
        return summary(out) | {"said": said, "results": results}
