"""The lab's per-packet floor beside gloo: how long the lab takes only to
carry one direction of an all-reduce's packets, with no codec, no sum and
no result, against gloo's whole all-reduce of the same size in the same lab.

Every worker sends the datagrams its share of a SIZE all-reduce takes at the
lab's MTU (one per chunk, a full frame each) to the aggregator, as the round
loop sends them (UDP GSO, SEGS datagrams per sendmsg), all workers at once;
the aggregator runs xaggd with its XDP program, which drops them at its
first check (no job of theirs is registered: counted, never summed). The
time is the slowest worker's, from the common start to its last send
returning (the kernel carries a frame across the switch and through the
aggregator's XDP program inside the sender's system call, so a returned
send has been dropped). An all-reduce through the aggregators carries each
datagram once more on the way back to every worker, so half the time of the
cheapest possible xagg exchange in the CPU-bound lab is at least this.

    sudo .venv/bin/python scripts/packet_floor.py [--mb 16] [--mtu 1500] [--pairs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import sys
import time

SEGS = 33                       # datagrams per GSO sendmsg, as the round loop batches them
UDP_SEGMENT = 103


def sender(a: list[str]) -> None:
    """One worker: ``count`` datagrams of ``size`` bytes to ``dest`` from ``start``."""
    dest, count, size, start = a[0], int(a[1]), int(a[2]), float(a[3])
    from xagg.wire.proto import C
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    buf = bytes(size * SEGS)
    cmsg = [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("H", size))]
    addr = (dest, C.XAGG_PORT)
    time.sleep(max(0.0, start - time.time()))
    t0, cpu0, sent = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), 0
    while sent < count:
        k = min(SEGS, count - sent)
        s.sendmsg([buf[:k * size]], cmsg if k > 1 else [], 0, addr)
        sent += k
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": time.perf_counter() - t0,
                      "cpu": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=16, help="all-reduce size (MB of float32)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3, help="gloo / floor pairs")
    a = ap.parse_args(argv)
    from xagg.lab import Lab, LabSpec
    from xagg.lab.experiment import Aggregators, run_gloo
    from xagg.wire.proto import max_vals
    size = a.mb * 250_000
    vals = max_vals(a.mtu)
    count = -(-size // vals)
    dgram = a.mtu - 20 - 8                  # a full frame: the IP and UDP headers, the rest payload
    with Lab(LabSpec(name=f"pf{os.getpid() % 1000}", workers=a.workers, aggregators=1, mtu=a.mtu)) as lab, \
            Aggregators(lab, "xdp"):
        dest = lab.host("a0").ip
        print(f"lab: {a.workers} workers, one aggregator (XDP), unshaped, MTU {a.mtu}; {a.mb} MB all-reduce = "
              f"{count} datagrams of {dgram} bytes per worker each way ({vals} values each), {SEGS} per sendmsg")
        best = []
        for _ in range(a.pairs):
            g = run_gloo(lab, size, rounds=4)
            start = time.time() + 0.5
            procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), "send", dest, str(count),
                                   str(dgram), str(start)], stdout=-1, text=True) for w in lab.workers]
            runs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
            floor = max(r["seconds"] for r in runs)
            print(f"gloo all-reduce {g.seconds * 1e3:6.1f} ms | one direction's packets only {floor * 1e3:6.1f} ms "
                  f"(worker CPU {sum(r['cpu'] for r in runs) * 1e3:5.1f} ms) = {floor / g.seconds:.2f}x gloo's "
                  f"whole all-reduce", flush=True)
            best.append((g.seconds, floor))
        g, floor = min(b[0] for b in best), min(b[1] for b in best)
        print(f"fastest of each: gloo {g * 1e3:.1f} ms, one direction's packets {floor * 1e3:.1f} ms: xagg through "
              f"this lab is at most {g / floor:.2f}x gloo before anything comes back ({g / (2 * floor):.2f}x if the "
              f"way back costs as much)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["send"]:
        sender(sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
