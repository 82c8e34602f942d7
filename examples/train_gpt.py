"""A small GPT trained with plain torch DDP and AdamW: a third-party-style
script that knows nothing of xagg (``xagg-client run`` patches its DDP).

13.8 M parameters (vocabulary 4096, width 384, 6 layers, 6 heads), tokens
of arithmetic sequences (t, t+k, t+2k, ... mod 4096, k in 1..3: learnable,
and the same on every run), one thread a rank, env:// initialisation as
torchrun sets it up. Rank 0 prints every tenth step and, with ``--out``,
writes each step's time (optimizer, forward, backward and the wait for
the gradients' sums) and loss as JSON.

    xagg-client run --aggregators HOST --nproc-per-node 4 -- examples/train_gpt.py --steps 30
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 4096


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 384, layers: int = 6, heads: int = 6, ctx: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def batch(g: torch.Generator, n: int, seq: int):
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    k = torch.randint(1, 4, (n, 1), generator=g)
    s = (start + k * torch.arange(seq + 1)) % VOCAB
    return s[:, :-1], s[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4, help="sequences a rank a step")
    ap.add_argument("--seq", type=int, default=32, help="tokens a sequence (at most 64)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", help="rank 0 writes step times and losses here (JSON)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for step in range(a.steps):
        x, y = batch(g, a.batch, a.seq)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
        losses.append(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {losses[-1]:.3f} {times[-1]:.0f} ms", flush=True)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"steps_ms": times, "losses": losses,
                       "params": sum(p.numel() for p in model.parameters())}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
