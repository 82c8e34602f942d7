"""Log lines an unauthenticated peer can provoke, at a bounded rate.

``LogLimiter(log).warning(key, msg, *args)`` logs at most ``burst`` lines per
``window_s`` for each key; the first line after a quiet window says how many
were left out, so a flood of refused connections costs a few lines a minute.
"""
from __future__ import annotations

import threading
import time


class LogLimiter:
    def __init__(self, log, burst: int = 3, window_s: float = 60.0, clock=time.monotonic):
        self.log, self.burst, self.window_s, self.clock = log, burst, window_s, clock
        self._lock = threading.Lock()
        self._state: dict[str, list] = {}          # key -> [window start, logged, suppressed]

    def warning(self, key: str, msg: str, *args) -> None:
        now = self.clock()
        with self._lock:
            st = self._state.get(key)
            if st is None or now - st[0] >= self.window_s:
                left_out = st[2] if st else 0
                st = self._state[key] = [now, 0, 0]
            else:
                left_out = 0
            if st[1] >= self.burst:
                st[2] += 1
                return
            st[1] += 1
        if left_out:
            msg += f" ({left_out} more like it in the last {self.window_s:g}s were not logged)"
        self.log.warning(msg, *args)
