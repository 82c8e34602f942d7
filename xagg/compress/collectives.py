"""The only door from a compressor to the network.

Summable methods use ``allreduce_sum`` (dense float32 or int32) and
``allreduce_or``; that is all an in-network aggregator has to provide.
``allreduce_control`` is a sum too, of a method's few control values (a
transport may send a small one by another way than the gradient's).
``allgather`` (top-k values+indices) and ``broadcast`` (one rank's index
list) are for the methods that need them.

Subclasses implement the underscored methods; the public ones count the
bytes each rank puts on (and takes off) the wire, so benchmarks and tests
report what a transport would actually carry.
"""
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter

import torch

from xagg.client import native
from xagg.compress import bitmap

SUMMABLE = (torch.float32, torch.int32)
STAGED_MAX = 64         # kept staging tensors (stage): callers with ever-new places keep no more


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives(ABC):
    rank: int = 0
    world_size: int = 1
    deferring: bool = False     # set by the DDP hook where settle() ends its steps
    final_round: bool = False   # set by exchange() around a method's last round
    state = None                # the job's XaggState where the transport has one (its fallback's mode)
    SUMS_LANES = False          # True: allreduce_sum_lanes (a gradient in 8/16-bit lanes, the aggregators')
    sum_key = None              # set by exchange() around a sum: its place in a step (a bucket's round), under
                                # which a transport may keep its buffers: its result then holds until the next
                                # sum under the same key

    def pending(self) -> int:
        """Sums returned before every rank was known to have them (see settle)."""
        return 0

    def settle(self) -> set:
        """Agree on the pending sums; the positions of those redone in place."""
        return set()

    def __init__(self):
        self.reset_stats()
        self._staged = {}       # sum_key -> the tensor its sums are staged in (stage)

    def stage(self, parts: list) -> torch.Tensor:
        """``parts`` (1-D, one dtype) one after another in a tensor that a
        sum may write over (allreduce_sum may reuse its storage). Under a
        ``sum_key`` the tensor is kept for the next sum there, whose result
        holds until then anyway: a step's sums then page-fault no fresh
        bucket-sized tensor."""
        n, key = sum(p.numel() for p in parts), self.sum_key
        buf = self._staged.get(key) if key is not None else None
        if buf is None or buf.numel() != n or buf.dtype != parts[0].dtype:
            buf = torch.empty(n, dtype=parts[0].dtype)
            if key is not None:
                if len(self._staged) >= STAGED_MAX:
                    self._staged.clear()
                self._staged[key] = buf
        return torch.cat(parts, out=buf) if len(parts) > 1 else buf.copy_(parts[0])

    def reset_stats(self) -> None:
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.calls = Counter()
        self.seconds = Counter()        # op -> wall seconds inside that collective (waiting included)

    def _count(self, op: str, sent: int, recv: int) -> None:
        self.calls[op] += 1
        self.bytes_sent += sent
        self.bytes_recv += recv

    # -- public API ---------------------------------------------------
    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a 1-D float32/int32 tensor.
        May reuse ``t``'s storage; use the returned tensor."""
        if t.dtype not in SUMMABLE:
            raise TypeError(f"allreduce_sum takes float32 or int32, got {t.dtype}")
        self._count("sum", _nbytes(t), _nbytes(t))
        return self._timed("sum", self._sum, t.contiguous())

    def allreduce_control(self, t: torch.Tensor) -> torch.Tensor:
        """``allreduce_sum`` of a control part (base.Part: a few values a
        method reads to choose its next round, such as head-room bounds),
        which every rank must have before it goes on. The same sum here; a
        transport where such a sum costs more than one reliable round trip
        (the aggregators' exact float32 sum: exponents first, then the
        ranks' agreement) sends a small one where it costs one."""
        return self.allreduce_sum(t)

    def allreduce_or(self, bits: torch.Tensor) -> torch.Tensor:
        """OR over ranks of a bitmap (xagg.compress.bitmap: uint8, a bit an
        index), the result a bitmap. May reuse ``bits``' storage; use the
        returned tensor."""
        if bits.dtype != torch.uint8:
            raise TypeError(f"allreduce_or takes a bitmap (uint8, a bit an index), got {bits.dtype}")
        return self._timed("or", self._or, bits.reshape(-1).contiguous())

    def allreduce_sum_lanes(self, t: torch.Tensor, key, bits: int) -> torch.Tensor:
        """A float32 sum in ``bits``-wide lanes, error feedback kept per
        ``key`` by the transport: where SUMS_LANES."""
        raise NotImplementedError(f"{type(self).__name__} has no lanes")

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked in rank order: shape (world_size, *t.shape)."""
        self._count("gather", _nbytes(t), _nbytes(t) * (self.world_size - 1))
        return self._timed("gather", self._gather, t.contiguous())

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s tensor on every rank (others pass one of the same shape)."""
        mine = self.rank == src
        self._count("bcast", _nbytes(t) if mine else 0, 0 if mine else _nbytes(t))
        return self._timed("bcast", self._bcast, t.contiguous(), src)

    def _timed(self, op: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[op] += time.perf_counter() - t0

    # -- to implement -------------------------------------------------
    @abstractmethod
    def _sum(self, t: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _gather(self, t: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _bcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...

    def _or(self, bits: torch.Tensor) -> torch.Tensor:
        """OR as an int32 sum: each index gets a lane wide enough to count
        world_size ones, so lanes never carry into each other. With 4 ranks:
        3 bits per index, 10 indices per int32 word. Packed and read back in
        C (client/csrc/orlanes.c); ``_or_lanes_reference`` where no compiler is."""
        width = self.world_size.bit_length()
        dll = native.load()
        if dll is None:
            return self._or_lanes_reference(bits, width)
        n = 8 * bits.numel()
        words = torch.empty(-(-n // (32 // width)), dtype=torch.int32)
        dll.xagg_or_pack(bits.data_ptr(), n, width, words.data_ptr())
        total = self.allreduce_sum(words).contiguous()
        out = bitmap.empty(n)
        dll.xagg_or_unpack(total.data_ptr(), n, width, out.data_ptr())
        return out

    def _or_lanes_reference(self, bits: torch.Tensor, width: int) -> torch.Tensor:
        lanes, n = 32 // width, 8 * bits.numel()
        pad = (-n) % lanes
        b = torch.nn.functional.pad(bitmap.unpack(bits, n).to(torch.int64), (0, pad)).view(-1, lanes)
        shifts = torch.arange(lanes, dtype=torch.int64) * width
        words = (b << shifts).sum(1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        total = self.allreduce_sum(words).to(torch.int64) & 0xFFFFFFFF
        counts = (total[:, None] >> shifts) & ((1 << width) - 1)
        return bitmap.pack(counts.reshape(-1)[:n] > 0)


class TorchCollectives(Collectives):
    """torch.distributed, on ``group`` (default: the world)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("TorchCollectives needs torch.distributed.init_process_group() first")
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _sum(self, t):
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, group=self.group)
        return t

    def _or(self, bits):
        # the bitmap itself on the wire: gloo and NCCL both do BOR on uint8
        self._count("or", bits.numel(), bits.numel())
        self.dist.all_reduce(bits, op=self.dist.ReduceOp.BOR, group=self.group)
        return bits

    def _gather(self, t):
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.dist.all_gather(out, t, group=self.group)
        return torch.stack(out)

    def _bcast(self, t, src):
        gsrc = src if self.group is None else self.dist.get_global_rank(self.group, src)
        self.dist.broadcast(t, src=gsrc, group=self.group)
        return t


class ThreadGroup:
    """N ranks simulated by N threads of one process (unit tests, benches).

    Results are computed in rank order on every thread, so all ranks get the
    same bits, as with a real aggregator.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots = [None] * world_size

    def members(self) -> list["ThreadCollectives"]:
        return [ThreadCollectives(self, r) for r in range(self.world_size)]

    def run(self, fn) -> list:
        """fn(collectives) on every rank, each in its own thread; returns the
        results in rank order and re-raises the first failure."""
        results, errors = [None] * self.world_size, []

        def body(c):
            try:
                results[c.rank] = fn(c)
            except BaseException as e:   # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()     # wake the others instead of deadlocking

        threads = [threading.Thread(target=body, args=(c,)) for c in self.members()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return results


class ThreadCollectives(Collectives):
    def __init__(self, group: ThreadGroup, rank: int):
        super().__init__()
        self.g, self.rank, self.world_size = group, rank, group.world_size

    def _all(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.g.slots[self.rank] = t.clone()
        self.g.barrier.wait()
        out = list(self.g.slots)
        self.g.barrier.wait()   # nobody overwrites a slot before everyone has read it
        return out

    def _sum(self, t):
        parts = self._all(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def _gather(self, t):
        return torch.stack(self._all(t))

    def _bcast(self, t, src):
        return self._all(t)[src].clone()
