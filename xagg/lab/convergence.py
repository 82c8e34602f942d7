"""The compression methods' convergence check, with real torch.distributed.

An MLP (64-256-256-10, 85k parameters) on scikit-learn's digits (shipped
with the package, nothing downloaded), trained with DDP by N processes;
every method is compared with dense DDP from the same seed, same data order.
``run_gloo`` spawns gloo ranks on 127.0.0.1; ``train`` is the per-rank loop,
usable with any Collectives (the xagg transport in the lab).
"""
import faulthandler
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from xagg.compress.collectives import Collectives, TorchCollectives
from xagg.compress.ddp import attach
from xagg.compress.registry import get_compressor

TEST_SIZE = 500
LAST = 5          # accuracy: mean test accuracy over the last LAST epochs


def digits(seed: int = 0):
    """(x_train, y_train, x_test, y_test), a fixed split of the 1797 digits."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    te, tr = perm[:TEST_SIZE], perm[TEST_SIZE:]
    return x[tr], y[tr], x[te], y[te]


def reference_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train(spec, *, collectives: Collectives | None = None, epochs: int = 40, batch: int = 32,
          lr: float = 0.1, seed: int = 0) -> dict:
    """Train the reference model on this rank (process group already up).
    ``spec`` None or "dense" means DDP's own all-reduce. Returns test accuracy,
    bytes this rank sent/received through the compressor, steps and a
    parameter checksum (equal on every rank when decisions are identical)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = digits(seed)
    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(reference_model())
    coll = None
    if spec not in (None, "ddp"):
        coll = collectives or TorchCollectives()
        attach(model, get_compressor(spec), coll)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    per_rank = len(ytr) // world
    steps, t0, accs = 0, time.perf_counter(), []
    for epoch in range(epochs):
        perm = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        mine = perm[rank::world][:per_rank]
        for b in range(0, per_rank - batch + 1, batch):
            i = mine[b:b + batch]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xtr[i]), ytr[i]).backward()
            opt.step()
            steps += 1
        if epoch >= epochs - LAST:
            with torch.no_grad():
                accs.append((model(xte).argmax(1) == yte).float().mean().item())
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # the mean over the last epochs: one test image is 0.2%, so a single
    # final evaluation is too noisy for a 1% comparison
    return {"acc": sum(accs) / len(accs), "final_acc": accs[-1], "steps": steps,
            "seconds": time.perf_counter() - t0,
            "params": flat.numel(), "checksum": float(flat.double().sum()) + float(flat.double().abs().sum()),
            "sent": coll.bytes_sent if coll else 4 * flat.numel() * steps,
            "recv": coll.bytes_recv if coll else 4 * flat.numel() * steps}


def _worker(rank: int, world: int, port: int, specs: list, out: str, kw: dict, make_collectives) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for spec in specs:
            coll = make_collectives(rank, world) if make_collectives else None
            r = train(spec, collectives=coll, **kw)
            every = [None] * world
            dist.all_gather_object(every, r)
            results[spec] = {
                "acc": every[0]["acc"], "final_acc": every[0]["final_acc"], "steps": r["steps"],
                "seconds": max(e["seconds"] for e in every),
                "params": r["params"],
                "same_on_all_ranks": len({e["checksum"] for e in every}) == 1,
                "sent_per_step": sum(e["sent"] for e in every) / world / r["steps"],
                "recv_per_step": sum(e["recv"] for e in every) / world / r["steps"],
            }
            results[spec]["ratio"] = 4 * r["params"] / results[spec]["sent_per_step"]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo(specs: list, world_size: int = 4, make_collectives=None, **kw) -> dict:
    """Train each spec ("ddp" = plain DDP) in one spawn of ``world_size``
    gloo processes; spec -> {acc, ratio, sent/recv_per_step, same_on_all_ranks, ...}.
    ``make_collectives(rank, world)`` (a module-level function, it is pickled
    into the workers) picks the transport, e.g. the xagg aggregator; default
    TorchCollectives over the same gloo group."""
    def once(d: str, port: int) -> dict:
        out = os.path.join(d, "results.json")
        spawn_logged(_worker, (world_size, port, list(specs), out, kw, make_collectives), world_size, d)
        with open(out) as f:
            return json.load(f)
    return spawn_gloo(once, world_size, f"gloo run of {specs}")


def spawn_gloo(once, world_size: int, what: str):
    """``once(dir, port)``, which spawns ``world_size`` ranks through
    spawn_logged(..., dir), with a fresh directory and port. A rank killed by
    a signal (gloo on loopback aborted once in CI, inside C++) is reported
    with every rank's stderr and the run is tried once more; a Python
    exception in a rank, or a second crash, raises with the logs."""
    import torch.multiprocessing as mp
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            try:
                return once(d, free_port())
            except mp.ProcessExitedException as e:
                logs = _rank_logs(d, world_size)
                if e.signal_name is None or attempt == 2:
                    raise RuntimeError(f"{what} failed: {e}\n{logs}") from e
                print(f"{what}: {e}; trying once more. The ranks' stderr:\n{logs}", file=sys.stderr)


def spawn_logged(fn, args: tuple, nprocs: int, log_dir: str) -> None:
    """mp.spawn(fn, args, nprocs), each rank's stderr to log_dir/rank<N>.log
    with Python stacks of every thread on a fatal signal (faulthandler); a
    rank whose ``fn`` returns exits 0 without the interpreter's teardown."""
    import torch.multiprocessing as mp
    mp.spawn(_logged, args=(fn, log_dir, args), nprocs=nprocs)


def _logged(rank: int, fn, log_dir: str, args: tuple) -> None:
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)
    faulthandler.enable(all_threads=True)
    fn(rank, *args)
    from xagg.torch.leave import leave
    leave(0)        # finished: not through the teardown, where gloo's threads can abort the rank


def _rank_logs(d: str, world_size: int, tail: int = 4000) -> str:
    parts = []
    for rank in range(world_size):
        try:
            with open(os.path.join(d, f"rank{rank}.log"), errors="replace") as f:
                text = f.read()[-tail:]
        except OSError:
            text = "(no log)"
        parts.append(f"--- rank {rank} stderr ---\n{text}")
    return "\n".join(parts)


if __name__ == "__main__":
    import sys
    for spec, r in run_gloo(sys.argv[1:] or ["ddp", "dense"]).items():
        print(f"{spec:40s} acc {r['acc']:.4f} ratio {r['ratio']:6.1f} {r['seconds']:.1f}s "
              f"same={r['same_on_all_ranks']}")
