"""The step a round repeats: send every packet of the round, each under its
aggregator's window, and collect every result, retransmitting what is lost.

Two implementations, chosen once per Client: ``NumpyExchange``
(exchange_numpy.py, the reference, numpy codec) and ``NativeExchange``
(exchange_native.py, csrc/exchange.c with the compiled codec). The round
protocol in allreduce.py drives either through this interface: ``run`` and
its ``codecs`` (codec.py, one per lane width), with the capabilities below
declared here with their defaults.
"""
from __future__ import annotations

import numpy as np

from xagg.client.codec import CompiledCodec, NumpyCodec
from xagg.client.config import ClientConfig, XaggError, XaggTimeout
from xagg.client.local_link import LocalLink
from xagg.client.packets import Book
from xagg.client.stats import ClientStats
from xagg.client.udp import open_socket
from xagg.wire.proto import packet_dtype


class Exchange:
    compiled = False        # the compiled round loop and codec (native.py) run the rounds
    codec_in_loop = False   # run() takes a native.InLoopCodec: the codec inside the round loop
    codecs: dict[int, NumpyCodec | CompiledCodec]   # lane width -> its codec (each call picks its own)

    def __init__(self, cfg: ClientConfig, stats: ClientStats):
        self.cfg, self.stats = cfg, stats
        self.window = cfg.window        # packets in flight per aggregator: the client adapts it (window.py)
        self.pkt_size = packet_dtype(cfg.vals).itemsize
        self.send_to = cfg.send_to      # per aggregator: it, or the child its chunks go through
        self.sock = open_socket(cfg)
        try:
            self.local = LocalLink(cfg)
        except BaseException:
            self.sock.close()
            raise

    def run(self, rnd: int, pkts: np.ndarray, book: Book, in_loop=None) -> np.ndarray:
        """Send every packet (book.off says whose), collect every result:
        returns them row for row (but for data rows ``in_loop`` decoded).
        XaggTimeout when nothing arrives for cfg.timeout, XaggError when a
        system call fails: never a partial round."""
        self.local.before_round()
        try:
            self._round(rnd, pkts, book, in_loop)
        except (XaggError, OSError) as e:
            self.local.round_failed()
            if isinstance(e, OSError):
                raise XaggError(f"job {self.cfg.job_id} round {rnd}: {e}") from e
            raise
        return book.results

    def _round(self, rnd: int, pkts: np.ndarray, book: Book, in_loop) -> None:
        raise NotImplementedError

    def timed_out(self, rnd: int, book: Book) -> XaggTimeout:
        cfg = self.cfg
        missing = {str(cfg.aggregators[k]): int((~d).sum()) for k, d in enumerate(book.per_agg(book.done))
                   if (~d).any()}
        return XaggTimeout(f"job {cfg.job_id} round {rnd}: no result for {cfg.timeout:.1f}s; "
                           f"chunks still missing per aggregator: {missing}")

    def close(self) -> None:
        self.sock.close()
        self.local.close()
