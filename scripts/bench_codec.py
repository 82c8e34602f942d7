"""Encode + decode of one allreduce call, numpy codec vs C codec (no network).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_codec.py [--elements 4194304] [--workers 4]

The steps Client.allreduce takes around its round trip, on a steady-state
call (the prediction holds, so one round):

  numpy  encode: padded copy, chunk_exponents, quantise_predicted, copy into
                 the packets; decode: the data rows out of the results,
                 dequantise, the final slice (a view)
  C      encode: codec.chunk_exponents, send_exponents, quantise_into the
                 packets; decode: dequantise_into the output

The round trip is stood in for by the packets' values taken as the sums
(one copy, not timed). Prints the median and best of --repeat runs.

Then a 16-bit bucket (--half-elements, bf16 and fp16), as the DDP hook
sums one, in C both ways:

  direct   encode straight from the 16-bit bucket; decode the average
           straight into a 16-bit buffer (the codec divides and rounds)
  staged   the float32 staging the hook did before: a float32 copy of the
           bucket, encode and decode float32, divide, round back (torch)

with ns per element and the load average beside them (timings on a shared
machine are only comparable within one run).
"""
from __future__ import annotations

import argparse
import statistics
import time

import os

import numpy as np
import torch

from xagg.client import codec, fixedpoint, native
from xagg.wire.proto import C, make_packets


def timed(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=4 << 20)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--vals", type=int, default=C.XAGG_VALS)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--half-elements", type=int, default=6_500_000,
                    help="elements of the 16-bit bucket (0: skip that section)")
    a = ap.parse_args()
    dll = native.load()
    if dll is None:
        raise SystemExit("the C codec did not build (see the warning above)")
    n, vals, nw = a.elements, a.vals, a.workers
    count = codec.n_chunks(n, vals)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * np.repeat(2.0 ** rng.integers(-20, 5, count), vals)[:n]).astype(np.float32)
    own = codec.chunk_exponents(dll, x, vals)
    pred = fixedpoint.predict([own], count, nw)          # steady state: last call's exponents
    rows = np.arange(count, dtype=np.int64)
    pkts = make_packets(job_id=1, cookie=1, worker_id=0, round_=0, chunks=rows,
                        values=np.zeros((count, vals), np.int32))
    results = np.empty((count, vals), np.int32)
    scale = fixedpoint.send_exponents(own, pred)         # as check_predicted gives when it holds

    def numpy_encode():
        padded = np.zeros(count * vals, np.float32)
        padded[:n] = np.ascontiguousarray(x, np.float32).reshape(-1)
        chunks = padded.reshape(count, vals)
        e = fixedpoint.chunk_exponents(chunks)
        pkts["vals"][rows] = fixedpoint.quantise_predicted(chunks, e, pred, nw)

    def numpy_decode():
        sums = results[rows]
        return fixedpoint.dequantise(sums, scale, nw).reshape(-1)[:n].reshape(x.shape)

    out = np.empty(n, np.float32)

    def c_encode():
        e = codec.chunk_exponents(dll, x, vals)
        codec.quantise_into(dll, x, fixedpoint.send_exponents(e, pred), nw, pkts, rows)

    def c_decode():
        codec.dequantise_into(dll, results, rows, scale, nw, out)

    numpy_encode()
    results[:] = pkts["vals"]
    want = numpy_decode()
    c_encode()
    assert np.array_equal(results, pkts["vals"]), "C and numpy packets differ"
    c_decode()
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), "C and numpy sums differ"

    print(f"{n} float32 ({n * 4 / 2**20:.0f} MiB), {nw} workers, {vals} values per packet; "
          f"median / best of {a.repeat}, ms")
    rows_out = {}
    for name, enc, dec in (("numpy", numpy_encode, numpy_decode), ("C", c_encode, c_decode)):
        e, d = timed(enc, a.repeat), timed(dec, a.repeat)
        both = timed(lambda: (enc(), dec()), a.repeat)
        rows_out[name] = both[0]
        print(f"  {name:6s} encode {1e3 * e[0]:7.2f} / {1e3 * e[1]:7.2f}   decode {1e3 * d[0]:7.2f} / "
              f"{1e3 * d[1]:7.2f}   both {1e3 * both[0]:7.2f} / {1e3 * both[1]:7.2f}")
    print(f"  C takes {rows_out['C'] / rows_out['numpy']:.2f}x numpy's time")
    if a.half_elements:
        for dtype in (torch.bfloat16, torch.float16):
            half_bucket(dll, a.half_elements, nw, vals, dtype, a.repeat)
    return 0


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy().view(fixedpoint.BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()


def half_bucket(dll, n: int, nw: int, vals: int, dtype, repeat: int) -> None:
    """One 16-bit bucket's encode + decode, direct against float32 staging."""
    count = codec.n_chunks(n, vals)
    g = torch.Generator().manual_seed(0)
    scale = torch.pow(2.0, torch.randint(-12, 4, (count,), generator=g).float()).repeat_interleave(vals)[:n]
    x = (torch.randn(n, generator=g) * scale).to(dtype)
    own = codec.chunk_exponents(dll, as_numpy(x), vals)
    pred = fixedpoint.predict([own], count, nw)
    scale_e = fixedpoint.send_exponents(own, pred)
    rows = np.arange(count, dtype=np.int64)
    pkts = make_packets(job_id=1, cookie=1, worker_id=0, round_=0, chunks=rows,
                        values=np.zeros((count, vals), np.int32))
    results = np.empty((count, vals), np.int32)
    out16, out32 = torch.empty(n, dtype=dtype), np.empty(n, np.float32)
    cc = codec.CompiledCodec(dll, vals)

    def direct():
        src = as_numpy(x)
        codec.quantise_into(dll, src, fixedpoint.send_exponents(codec.chunk_exponents(dll, src, vals), pred), nw,
                            pkts, rows, biased=True)
        cc.dequantise_into(results, rows, scale_e, nw, as_numpy(out16), nw)
        return out16

    def staged():
        x32 = x.to(torch.float32).numpy()                  # the float32 copy of the bucket
        codec.quantise_into(dll, x32, fixedpoint.send_exponents(codec.chunk_exponents(dll, x32, vals), pred), nw,
                            pkts, rows, biased=True)
        cc.dequantise_into(results, rows, scale_e, nw, out32)
        return torch.from_numpy(out32).div_(nw).to(dtype)

    direct()
    results[:] = pkts["vals"]
    d = direct().clone()
    assert torch.equal(d, staged()), "direct and staged sums differ"
    t_direct, t_staged = timed(direct, repeat), timed(staged, repeat)
    name = str(dtype).removeprefix("torch.")
    print(f"{n} {name} ({n * 2 / 2**20:.1f} MiB), {nw} workers, encode + decode in C, median / best of {repeat} "
          f"(load {os.getloadavg()[0]:.1f}):")
    for label, (med, best) in (("direct", t_direct), ("staged", t_staged)):
        print(f"  {label:6s} {1e3 * med:7.2f} / {1e3 * best:7.2f} ms   {1e9 * med / n:5.2f} / {1e9 * best / n:5.2f} "
              f"ns per element")
    print(f"  direct takes {t_direct[0] / t_staged[0]:.2f}x float32 staging's time")


if __name__ == "__main__":
    raise SystemExit(main())
