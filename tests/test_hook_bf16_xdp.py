"""bfloat16 and float16 models through the DDP hook on the real data plane:
four torch.distributed ranks, one per worker namespace of a lab, against
xaggd with its XDP program on the aggregator's veth (as
tests/test_hook_xdp.py), the model's parameters, and so its gradient
buckets, in the 16-bit dtype.

Every step trains plain DDP (gloo's all-reduce of the 16-bit buckets) and
DDP with the xagg hook from the same parameters on the same inputs: the
hook's gradients are within the fixed-point bound of gloo's, within the
fixed-point bound plus one rounding of the exact mean of the ranks' own
gradients, the same bits on every rank, and no bucket was copied to
float32 on its way (the hook's ``staged_f32`` counter stays 0; its bytes
counted are 2 per element).

With XAGG_TEST_DEVICE=cuda (`make gpu-test`) the models live on the GPU and
the buckets are staged through pinned host memory in their own dtype.

Run as ``python tests/test_hook_bf16_xdp.py rank JSON``, this file is one rank.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WORLD = 4
STEPS = 5
DTYPES = ("bfloat16", "float16")
DEVICE = os.environ.get("XAGG_TEST_DEVICE", "cpu")
REPO = Path(__file__).resolve().parent.parent
LR = 0.3


# -- one rank ------------------------------------------------------------------------------
def rank_main(a: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist

    from ddp_replicas import deterministic
    torch.set_num_threads(1)
    deterministic()
    dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"], world_size=WORLD)
    out = {name: run_dtype(name, a) for name in DTYPES}
    (Path(a["out"]) / f"r{a['rank']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def gradients(models, x, y) -> list:
    """Each model's flat gradient (in its dtype) on (x, y), the loss taken in float32."""
    import torch
    import torch.nn.functional as F
    grads = []
    for m in models:
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x).float(), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    return grads


def run_dtype(name: str, a: dict) -> dict:
    import torch
    import torch.distributed as dist
    from ddp_replicas import inputs, reset
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_digits import make_model

    from xagg.client.fixedpoint import tolerance
    from xagg.torch import attach

    dtype, dev = getattr(torch, name), torch.device(a["device"])
    fin = torch.finfo(dtype)
    A, X = (DDP(make_model("tiny", 0).to(dev, dtype)) for _ in range(2))
    local = make_model("tiny", 0).to(dev, dtype)        # no DDP: this rank's own gradient
    sX = attach(X, [a["aggregator"]], control=[a["control"]], fanout="unicast", timeout=10.0, rto=0.05)
    path, worst = "", 0.0
    for step in range(STEPS):
        x, y = inputs(step, a["rank"], dev)
        reset((X.module, local), A.module)
        before = sX.stats["buckets_xagg"]
        own, ga, gx = gradients((local, A, X), x.to(dtype), y)
        path += "x" if sX.stats["buckets_xagg"] > before else "g"
        assert gx.dtype == ga.dtype == dtype and gx.device.type == dev.type, f"{name} step {step}"
        own, ga, gx = own.cpu().double(), ga.cpu().double(), gx.cpu()
        every = [torch.empty_like(own) for _ in range(WORLD)]
        dist.all_gather(every, own)
        gmax = max(e.abs().max().item() for e in every)
        fixed = tolerance(gmax, WORLD) / WORLD          # the fixed-point sum's error, averaged
        # gloo: each rank's gradient divided, then summed, in the 16-bit dtype (a rounding each time)
        bound = fixed + (WORLD + 1) * fin.eps * gmax
        diff = (gx.double() - ga).abs().max().item()
        assert diff <= bound, f"{name} step {step}: |xagg - gloo| = {diff:.3g} > {bound:.3g}"
        worst = max(worst, diff / bound)
        # the exact mean of the ranks' gradients, rounded once (fp16's subnormals: an absolute unit)
        mean = torch.stack(every).mean(0)
        room = fixed * (1 + fin.eps) + fin.eps / 2 * mean.abs() + fin.smallest_normal * fin.eps
        assert bool(((gx.double() - mean).abs() <= room).all()), f"{name} step {step}: off the exact mean"
        gathered = [torch.empty_like(gx) for _ in range(WORLD)]
        dist.all_gather(gathered, gx)
        assert all(torch.equal(g, gx) for g in gathered), f"{name} step {step}: ranks hold different sums"
        with torch.no_grad():
            for p in A.parameters():
                p -= LR * p.grad
    out = dict(path=path, worst=worst, stats=sX.snapshot(), elements=sum(p.numel() for p in A.parameters()))
    sX.close()
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side: the lab, xaggd and the ranks ---------------------------------------------
import random  # noqa: E402

import pytest  # noqa: E402
from test_hook_xdp import Xaggd, serve  # noqa: E402

from xagg.lab.cluster import Lab, LabSpec  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if DEVICE != "cpu":
        import torch
        if not torch.cuda.is_available():
            pytest.fail(f"XAGG_TEST_DEVICE={DEVICE}, but torch {torch.__version__} sees no CUDA device")
    out = tmp_path_factory.mktemp("hook_bf16_xdp")
    with Lab(LabSpec(name=f"hf{os.getpid() % 100000}", workers=WORLD, aggregators=1)) as lab:
        daemon = Xaggd(lab, out)
        try:
            daemon.start()
            master = f"{lab.workers[0].ip}:{random.randrange(20000, 30000)}"
            procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), "rank", json.dumps(dict(
                rank=k, master=master, aggregator=lab.host("a0").ip, control=daemon.socket, out=str(out),
                device=DEVICE))], stdout=-1, stderr=-1, text=True)
                for k, w in enumerate(lab.workers)]
            serve(procs, out, daemon)
        finally:
            daemon.close()
    return [json.loads((out / f"r{k}.json").read_text()) for k in range(WORLD)]


@pytest.mark.parametrize("name", DTYPES)
def test_16_bit_buckets_sum_through_the_xdp_program_without_a_float32_copy(runs, name):
    res = [r[name] for r in runs]
    print(f"\n{name}: path {res[0]['path']}, worst |xagg - gloo| / bound {max(r['worst'] for r in res):.3f}")
    for r in res:
        s = r["stats"]
        assert r["path"] == "x" * STEPS, r["path"]
        assert s["buckets_xagg"] == STEPS and s["buckets_gloo"] == 0 and s["fallbacks"] == 0, s
        assert s["staged_f32"] == 0, s                              # no float32 copy of a bucket
        assert s["bytes_xagg"] == STEPS * r["elements"] * 2, s     # the buckets went out as 2-byte ones
        assert s["redone"] == res[0]["stats"]["redone"]
