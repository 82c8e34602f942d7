"""The per-step agreement of the xagg hook, through the rendezvous store.

Every rank posts a few integers per step (which buckets failed here, which
succeeded, whether all did); every rank reads all posts and takes the
elementwise maximum (what the integers mean: agreement.py). It goes
through torch.distributed's own key-value store (TCPStore, served by a C++
thread in one process) rather than a gloo all_reduce: on a busy host a tiny
gloo all_reduce costs far more CPU and time than a few round trips to the
store. Failures still recover over gloo (engine.py).

Posting never blocks; reading waits for every rank's post, on a thread of
its own, so a rank that did not need to wait learns the outcome without its
training thread's help (which may be blocked in a collective of the
script's). Keys are namespaced by a per-engine nonce, and each rank deletes
its own post of two steps back, which every rank has read by then.
"""
from __future__ import annotations

import queue
import threading

import torch.distributed as dist


def default_store():
    """A connection of our own to torch.distributed's rendezvous store (every
    rank of the default group reaches it; our own connection, so a read that
    waits never holds up torch's use of the store)."""
    store = dist.distributed_c10d._get_default_store()
    return store.clone() if hasattr(store, "clone") else store


class Board:
    def __init__(self, store, prefix: str, rank: int, world: int, on_read=None):
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world = rank, world
        self.on_read = on_read or (lambda: None)     # called when a background read is done
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None

    def post(self, step: int, values: list) -> None:
        self.store.set(f"{step}/{self.rank}", ",".join(str(int(v)) for v in values))
        if step >= 2:
            self.store.delete_key(f"{step - 2}/{self.rank}")

    def read(self, step: int) -> list:
        """The elementwise maximum of every rank's post for ``step`` (waits for all)."""
        keys = [f"{step}/{r}" for r in range(self.world)]
        # multi_get waits for every key itself: one round trip to the store
        rows = [[int(v) for v in raw.decode().split(",")] for raw in self.store.multi_get(keys)]
        return [max(col) for col in zip(*rows)]

    def read_later(self, step: int) -> "Pending":
        """Read ``step`` on the board's thread; on_read() is called when it is done."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"xagg-board-r{self.rank}", daemon=True)
            self._thread.start()
        p = Pending(step)
        self._requests.put(p)
        return p

    def _serve(self) -> None:
        while True:
            p = self._requests.get()
            if p is None:
                return
            try:
                p.result = self.read(p.step)
            except BaseException as e:  # noqa: BLE001 - handed to the engine
                p.error = e
            p.done.set()
            self.on_read()

    def close(self) -> None:
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=5)
            self._thread = None


class Pending:
    __slots__ = ("step", "done", "result", "error")

    def __init__(self, step: int):
        self.step, self.done, self.result, self.error = step, threading.Event(), None, None

    def wait(self) -> list:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result
