"""`make bench` section "train": DDP step time of the demo model on the lab,
xagg (XDP aggregators via xagg-client) vs gloo, same run, unshaped and
with every link shaped to 1 Gbit/s."""
from __future__ import annotations

import os

from .bench import register


def bench_train(quick: bool) -> list[dict]:
    from .experiment import Aggregators
    from .lab import Lab, LabSpec
    from .train_demo import lab_train
    rows = []
    epochs = 1 if quick else 2
    print("\n== training step time, demo CNN, 4 worker hosts, one DDP rank each ==")
    print(f"{'link':9} {'transport':9} {'step ms':>8} {'comm ms':>8} {'x gloo':>7} {'test acc':>9}")
    for rate in (None, "1gbit"):
        m = 4 if rate else 1
        with Lab(LabSpec(name=f"bt{os.getpid() % 1000}", workers=4, aggregators=m, rate=rate)) as lab:
            g = lab_train(lab, None, "gloo", epochs=epochs, echo=False)
            with Aggregators(lab, "xdp") as aggs:
                x = lab_train(lab, aggs, "xagg", epochs=epochs, echo=False)
        for name, r in (("gloo", g), ("xagg", x)):
            row = {"link": rate or "unshaped", "transport": name, **r,
                   "x_gloo": g["step_ms"] / r["step_ms"]}
            rows.append(row)
            print(f"{row['link']:9} {name:9} {r['step_ms']:8.1f} {r['comm_ms']:8.1f} {row['x_gloo']:7.2f} "
                  f"{100 * r['final_test_acc']:8.2f}%", flush=True)
    return rows


register("train", bench_train)
