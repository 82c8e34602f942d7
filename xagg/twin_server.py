"""The userspace twin as a process (for labs and `xaggd start --userspace`
tests): serves UDP on --port, reads job specs as JSON lines on stdin."""
from __future__ import annotations

import argparse
import json
import sys

from .job import JobSpec
from .proto import C
from .twin import TwinAggregator, TwinServer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=C.XAGG_PORT)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--vals", type=int, default=C.XAGG_VALS)
    a = ap.parse_args(argv)
    agg = TwinAggregator(vals=a.vals)
    srv = TwinServer(agg, a.host, a.port).start()
    print("ready", srv.port, flush=True)
    for line in sys.stdin:
        try:
            agg.set_job(JobSpec(**json.loads(line)))
            print("ok", flush=True)
        except Exception as e:  # report and keep serving
            print(f"error {e}", flush=True)
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
