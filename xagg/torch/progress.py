"""What a rank tells about its progress: the status file `xagg-client status`
reads (``status_dir``), the progress line on stderr (``progress_every``,
rank 0) and the Prometheus endpoint (``metrics``, metrics.py)."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from xagg.torch.metrics import serve as serve_metrics

log = logging.getLogger("xagg.torch")


class Reporter:
    def __init__(self, state, rank: int):
        self.state, self.rank = state, rank
        self.last_status = self.last_progress = 0.0
        self.metrics = None
        if state.config.metrics:
            try:
                self.metrics = serve_metrics(state, state.config.metrics, rank)
            except OSError as e:        # training goes on; the operator is told once
                log.warning("xagg: rank %d: metrics: cannot serve at %s (+ local rank): %s",
                            rank, state.config.metrics, e)

    def step_ended(self, now: float) -> None:
        """After every step: the status file at most once a second, the
        progress line every ``progress_every`` seconds."""
        cfg = self.state.config
        if cfg.status_dir and now - self.last_status >= 1.0:
            self.last_status = now
            self.write_status()
        if cfg.progress_every and self.rank == 0 and now - self.last_progress >= cfg.progress_every:
            self.last_progress = now
            print(progress_line(self.state.snapshot()), file=sys.stderr, flush=True)

    def write_status(self) -> None:
        st = self.state
        try:
            os.makedirs(st.config.status_dir, exist_ok=True)
            path = os.path.join(st.config.status_dir, f"rank{self.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({**st.snapshot(), "time": time.time()}, f)
            os.replace(path + ".tmp", path)
        except OSError as e:
            log.debug("xagg: status file: %s", e)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.state.config.status_dir:
            self.write_status()


def progress_line(s: dict) -> str:
    steps = s["steps"] or 1
    return (f"xagg: step {s['steps']} [{s['mode']}] | buckets xagg {s['buckets_xagg']} "
            f"gloo {s['buckets_gloo']} | fallbacks {s['fallbacks']} | "
            f"{s['bytes_xagg'] / 1e6:.1f} MB at {s['bandwidth_gbps']:.2f} Gbit/s | "
            f"comm {1e3 * s['seconds_comm'] / steps:.1f} ms/step | retransmits {s['retransmits']}")
