"""Where the workers' CPU goes: gloo and xagg alternating in one lab (MTU
1500 and every default unless told), each run's time, the workers' user
and system CPU per GB apart from the rest of the machine, resends and lab
drops; then optionally `perf record -a -g` over one more xagg run: its
system calls and context switches per worker and call (perf stat), the
workers' samples by what their stacks were doing (send, receive, XDP, codec,
...) and their top symbols (self time), over the steady calls only.

    sudo .venv/bin/python scripts/worker_cpu.py [--shape unshaped] [--pairs 3] [--perf]
        [--mb 16] [--mtu 1500] [--path udp] [--before DIR]

--before DIR runs a second copy of the client (another version of csrc/,
say) beside this tree's in the same lab, so a change is judged against
what it replaces under the same load.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

from xagg.bench import OUT
from xagg.bench.allreduce import SHAPES, cpu_columns
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect, run_gloo, run_xagg, start_xagg
from xagg.wire import chunks
from xagg.wire.proto import max_vals

WORKERS = 4
SYSCALLS = ["syscalls:sys_enter_sendmsg", "syscalls:sys_enter_sendto", "syscalls:sys_enter_recvmmsg",
            "syscalls:sys_enter_ppoll", "context-switches"]
# a sample's stack names what it was for (the first match counts)
CATEGORIES = [("XDP program", ("bpf_prog_",)),
              ("send syscall", ("__sys_sendmsg", "__sys_sendto", "__sys_sendmmsg")),
              ("recvmmsg", ("__sys_recvmmsg", "do_recvmmsg")),
              ("poll/sleep", ("do_sys_poll", "__x64_sys_ppoll", "schedule", "do_nanosleep")),
              ("softirq (other)", ("net_rx_action", "do_softirq", "handle_softirqs")),
              ("codec", ("xagg_encode", "xagg_dequantise", "xagg_quantise", "xagg_chunk_exp")),
              ("round loop (C)", ("xagg_",)),
              ("python", ("libpython", "_PyEval"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="unshaped", choices=[s[0] for s in SHAPES])
    ap.add_argument("--mb", type=int, default=16, help="all-reduce size (MB of float32)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--pairs", type=int, default=3, help="gloo/xagg pairs")
    ap.add_argument("--rounds", type=int, default=6, help="xagg calls per run (the first is warm-up)")
    ap.add_argument("--path", default="", help="the workers' path (default: the default)")
    ap.add_argument("--perf", action="store_true", help="perf record -a -g one more xagg run")
    ap.add_argument("--before", default="", help="a copy of the xagg package's tree (e.g. `git archive HEAD xagg "
                    "bpf | tar -x -C DIR`) whose workers run too, after gloo and before this tree's")
    ap.add_argument("--name", default=f"wc{os.getpid() % 1000}", help="the lab's name")
    a = ap.parse_args(argv)
    size = a.mb * 250_000
    _, rate, m, rate_of = next(s for s in SHAPES if s[0] == a.shape)
    kw = {"path": a.path} if a.path else {}
    spec = LabSpec(name=a.name, workers=WORKERS, aggregators=m, rate=rate, rate_of=rate_of, mtu=a.mtu)
    slots = 2 * max(chunks.capacity(size, max_vals(a.mtu), [1.0] * m))
    print(f"{a.shape}, MTU {a.mtu}, {a.mb} MB, load {os.getloadavg()}", flush=True)
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=slots, start_timeout=600) as aggs:
        for _ in range(a.pairs):
            g = run_gloo(lab, size, rounds=4)
            _print("gloo", g, size, {})
            for tree in ([a.before] if a.before else []) + [""]:
                with _tree(tree):
                    drops = lab.drops()
                    x = run_xagg(lab, aggs, size, rounds=a.rounds, timeout=60, **kw)
                _print("before" if tree else "xagg", x, size, lab.drops_between(drops, lab.drops()))
                print(f"   x gloo {g.seconds / x.seconds:.2f}  load {os.getloadavg()[0]:.1f}", flush=True)
        if a.perf:
            for tree in ([a.before] if a.before else []) + [""]:
                print(f"== perf of {'before' if tree else 'this tree'}", flush=True)
                with _tree(tree):
                    _perf(lab, aggs, size, kw)
    return 0


@contextlib.contextmanager
def _tree(path: str):
    """Workers spawned meanwhile import xagg from ``path`` ("": this tree;
    they start in this process's directory, first on their sys.path)."""
    old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if path:
        os.environ["PYTHONPATH"] = path
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(cwd)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _print(kind, r, size, drops):
    cpu = cpu_columns(r, size)
    first = max(rep.get("cpu_from_round", 0) for rep in r.reports)
    gb = (len(r.all_seconds) - first) * size * 4 / 1e9
    user = sum(rep.get("process_cpu", [0, 0])[0] for rep in r.reports) / gb
    sys_ = sum(rep.get("process_cpu", [0, 0])[1] for rep in r.reports) / gb
    st = [rep.get("stats", {}) for rep in r.reports]
    sent = sum(s.get("packets_sent", 0) for s in st)
    retx = sum(s.get("retransmits", 0) for s in st)
    print(f"{kind:5} {r.seconds * 1e3:7.1f} ms  workers {cpu['workers_cpu_s_per_gb']:5.2f} (user {user:5.2f} "
          f"sys {sys_:5.2f}) rest {cpu['rest_cpu_s_per_gb']:5.2f} machine {cpu['cpu_s_per_gb']:5.2f} s/GB  "
          f"sent {sent} retx {retx} drops {sum(drops.values()) if drops else 0} "
          f"{ {k: v for k, v in drops.items() if v} if drops else ''}", flush=True)


def _perf(lab, aggs, size, kw, rounds=10, settle=15.0):
    """perf record -a -g over the calls of one xagg run after its first (the
    workers make their inputs first: they all start ``settle`` seconds late,
    time enough for that); the report keeps the lab's workers, its daemons
    and the kernel's softirq threads and idle (other processes on a shared
    machine are left out)."""
    data = (OUT / f"perf-worker-cpu{'-before' if os.environ.get('PYTHONPATH') else ''}.data").resolve()
    OUT.mkdir(exist_ok=True)
    t0 = time.time()
    job_id, procs = start_xagg(lab, aggs, size, rounds=rounds, timeout=60,
                               late={w: settle for w in range(len(lab.workers))}, **kw)
    try:
        time.sleep(max(0.0, t0 + 1.0 + 0.1 * len(lab.workers) + settle + 1.0 - time.time()))
        rec = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "999", "-o", str(data)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stat = subprocess.Popen(["perf", "stat", "-x", ",", "-e", ",".join(SYSCALLS), "-p",
                                 ",".join(str(p.pid) for p in procs)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            collect(procs, timeout=600)
        finally:
            rec.send_signal(signal.SIGINT)
            stat.send_signal(signal.SIGINT)
            rec.wait(120)
            counts = stat.communicate(timeout=60)[1]
    finally:
        aggs.remove(job_id)
    print(f"perf: {data} ({rounds} calls)", flush=True)
    per = {line.split(",")[2]: int(line.split(",")[0]) for line in counts.splitlines()
           if line.count(",") > 2 and line.split(",")[0].isdigit()}
    print("per worker and call (all of its calls, the first too): " + ", ".join(
        f"{k.split(':')[-1]} {v / len(procs) / rounds:.0f}" for k, v in per.items()), flush=True)
    _summarise_perf(data, {p.pid for p in procs}, {p.pid for p in aggs.daemons})


def _summarise_perf(data, workers: set, daemons: set, top: int = 25) -> None:
    """Self time by symbol of the workers' samples taken after every worker
    made its inputs and ran its first call (the last sample in
    random_standard_normal or clearing a fresh page: a steady call touches
    no new memory), and of the softirq threads over the same time; shares
    of the whole machine's samples in that time."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,time,ip,sym,dso"],
                         capture_output=True, text=True).stdout
    samples = []        # (pid, comm, time, leaf frame, frames)
    for block in out.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        head = lines[0].split()
        try:
            t, pid = float(head[-1].rstrip(":")), int(head[-2])
        except (ValueError, IndexError):
            continue
        frames = [" ".join(line.split()[1:]) for line in lines[1:]]
        samples.append((pid, " ".join(head[:-2]), t, frames[0] if frames else "?", frames))
    t0 = max((t for pid, _, t, _, frames in samples
              if pid in workers and any(k in f for f in frames for k in ("random_standard_normal", "clear_page"))),
             default=min((s[2] for s in samples), default=0.0))      # none: perf began after them
    # and before the first worker is done (its exit collects garbage)
    t1 = min((max(t for pid, _, t, _, frames in samples if pid == w and any("xagg_" in f for f in frames))
              for w in workers if any(s[0] == w for s in samples)), default=float("inf"))
    steady = [s for s in samples if t0 < s[2] < t1]
    print(f"{len(steady)} samples over {t1 - t0:.2f} s of steady calls (of {len(samples)})")
    mine = [s for s in steady if s[0] in workers]
    kinds = {}
    for s in mine:
        k = next((name for name, keys in CATEGORIES if any(key in f for f in s[4] for key in keys)), "other")
        kinds[k] = kinds.get(k, 0) + 1
    print("workers' samples by what they were doing: " + ", ".join(
        f"{k} {100 * c / max(1, len(mine)):.1f}%" for k, c in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for what, pick in (("workers", lambda s: s[0] in workers), ("daemons", lambda s: s[0] in daemons),
                       ("softirq threads", lambda s: s[1].startswith("ksoftirqd")),
                       ("idle", lambda s: s[1].startswith("swapper"))):
        mine = [s for s in steady if pick(s)]
        print(f"-- {what}: {100 * len(mine) / max(1, len(steady)):.1f}% of the machine's samples")
        if what in ("daemons", "idle"):
            continue
        by = {}
        for s in mine:
            by[s[3]] = by.get(s[3], 0) + 1
        for sym, c in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
            print(f"   {100 * c / len(mine):5.1f}%  {sym[:110]}")


if __name__ == "__main__":
    sys.exit(main())
