"""16-bit lanes through the real XDP program (xaggd attached to a lab
aggregator's veth): all-reduce calls summed within the 16-bit bound, the
same bits on every worker, in half the chunks of 32-bit lanes; and the DDP
hook with ``wire_bits=16`` (what ``--compress int16`` runs) in four
torch.distributed ranks, each step's gradient DDP's own within the bound
plus what error feedback carried, in half the packets of 32-bit lanes.

Run as ``python tests/test_wire16_xdp.py rank JSON``, this file is one rank.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WORLD = 4
REPO = Path(__file__).resolve().parent.parent
STEPS = 6


def rank_main(a: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist
    from ddp_replicas import gradients, inputs, reset
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_digits import make_model

    from xagg.client.fixedpoint import tolerance
    from xagg.torch import attach

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"], world_size=WORLD)
    out = {}
    for wire in (32, 16):
        A, X = (DDP(make_model("small", 0)) for _ in range(2))
        local = make_model("small", 0)
        n = sum(p.numel() for p in local.parameters())     # one bucket: DDP's first, index 0
        sX = attach(X, [a["aggregator"]], control=[a["control"]], fanout="unicast", timeout=10.0,
                    wire_bits=wire)
        worst, per_step = 0.0, []
        for step in range(STEPS):
            x, y = inputs(step, a["rank"])
            reset((X.module, local), A.module)
            sent = lambda: sX.stats["packets_sent"] - sX.stats["retransmits"]    # noqa: E731 - a loss's resend aside
            before = sent(), sX.stats["buckets_xagg"]
            r_old = _residual_max(sX, n)
            grads = gradients((local, A, X), x, y)
            assert sX.stats["buckets_xagg"] > before[1], f"wire {wire} step {step} fell back: {sX.reason}"
            per_step.append(sent() - before[0])
            top = torch.tensor([grads[0].abs().max().item(), r_old, _residual_max(sX, n)])
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            gmax, r_in, r_out = top.tolist()
            ga, gx = grads[1], grads[2]
            # xagg's fixed point (16 bits: of g + the residual carried in, less the one carried
            # out, which feedback moves between steps), and gloo's float32 rounding of the sum
            bound = (tolerance(gmax + r_in, WORLD, bits=wire) + WORLD * (r_in + r_out)) / WORLD \
                + WORLD * (gmax + r_in) * 2.0 ** -22
            diff = (gx - ga).abs().max().item()
            assert diff <= bound, f"wire {wire} step {step}: |xagg - gloo| = {diff:.3g} > {bound:.3g}"
            worst = max(worst, diff / bound)
            every = [torch.empty_like(gx) for _ in range(WORLD)]
            dist.all_gather(every, gx)
            assert all(torch.equal(e, gx) for e in every), f"wire {wire} step {step}: ranks hold different sums"
            with torch.no_grad():
                for p in A.parameters():
                    p -= 0.3 * p.grad
        out[wire] = dict(worst=worst, packets=per_step, stats=sX.snapshot(), residual=_residual_max(sX, n))
        sX.close()
        dist.barrier()
    (Path(a["out"]) / f"r{a['rank']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _residual_max(state, n: int) -> float:
    """The largest |residual| error feedback holds for the model's one bucket (0 without)."""
    r = state.client.residual(n, 0)
    return 0.0 if r is None else float(abs(r).max())


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side -------------------------------------------------------------------------
import random  # noqa: E402

import pytest  # noqa: E402

from xagg.lab.cluster import Lab, LabSpec  # noqa: E402
from xagg.lab.experiment import Aggregators, collect, start_xagg  # noqa: E402
from xagg.lab.traffic import check_sums  # noqa: E402

SIZES = [1, 513, 1_000_003]


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"wa{os.getpid() % 100000}", workers=WORLD, aggregators=1)) as lab:
        yield lab


@pytest.fixture(scope="module")
def aggs(lab):
    with Aggregators(lab, "xdp", max_slots=65536) as a:
        yield a


def test_sixteen_bit_lanes_sum_through_the_xdp_program_in_half_the_chunks(lab, aggs, tmp_path):
    """Three rounds of three sizes with each lane width: the sums within
    their bound and alike on every worker, nothing malformed, and the
    program completed about half the chunks for 16-bit lanes."""
    done = {}
    for wire in (32, 16):
        out = tmp_path / str(wire)
        out.mkdir()
        before = aggs.counters()[0]
        collect(start_xagg(lab, aggs, SIZES, rounds=3, fanout="unicast", n_workers=WORLD, out_dir=str(out),
                           wire_bits=wire)[1], timeout=300)
        check_sums(out, WORLD, 3, SIZES, wire_bits=wire)
        after = aggs.counters()[0]
        assert after["malformed"] == before["malformed"]
        done[wire] = after["completed"] - before["completed"]
    assert 0.45 * done[32] <= done[16] <= 0.55 * done[32], done


def test_ddp_hook_with_16_bit_lanes_equals_ddp_within_the_bound(lab, aggs, tmp_path):
    """Four ranks, a ~53k-parameter model: every step through xagg, the
    gradient DDP's within the 16-bit bound and feedback's residuals, the
    same bits on every rank, half the packets of 32-bit lanes per step."""
    master = f"{lab.workers[0].ip}:{random.randrange(20000, 30000)}"
    control = f"/run/xaggd/{lab.name}-a0.sock"
    procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), "rank", json.dumps(dict(
        rank=k, master=master, aggregator=lab.host("a0").ip, control=control, out=str(tmp_path)))],
        stdout=-1, stderr=-1, text=True) for k, w in enumerate(lab.workers)]
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode:
            errors.append(err[-3000:])
    assert not errors, "\n".join(errors)
    ranks = [json.loads((tmp_path / f"r{k}.json").read_text()) for k in range(WORLD)]
    for r in ranks:
        for wire in ("32", "16"):
            s = r[wire]["stats"]
            assert s["buckets_gloo"] == 0 and s["fallbacks"] == 0, s
        assert r["16"]["residual"] > 0                              # feedback carried something
    p32, p16 = ranks[0]["32"]["packets"], ranks[0]["16"]["packets"]
    print(f"\npackets per step, 32-bit lanes {p32}, 16-bit {p16}; "
          f"worst |xagg - gloo| / bound {max(r['16']['worst'] for r in ranks):.3f}")
    # the steps after the first (which sums every chunk twice: no exponents predicted yet)
    assert sum(p16[1:]) <= 0.55 * sum(p32[1:]), (p32, p16)
