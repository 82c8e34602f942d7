"""Where jobs sit in the data plane's memory, and their installation.

A job holds ``2 x n_chunks`` consecutive slots (round parity) in
``[0, max_slots)``, placed first-fit, and one job index (its row in the
per-job maps) in ``[0, max_jobs)``; each child entry holds its own slots
and index. ``Placement`` takes both, installs the entries in the backend,
and gives both back when they come out. Its caller (jobs.py) serialises
the calls.
"""
from __future__ import annotations

from xaggd.backends import Backend
from xaggd.job import Job
from xaggd.job_request import NoRoom
from xaggd.settings import format_size


class SlotAllocator:
    """First-fit ranges over [0, total)."""

    def __init__(self, total: int):
        self.total = total
        self.used: dict[int, int] = {}          # base -> size

    def _gaps(self):
        pos = 0
        for base in sorted(self.used):
            if base > pos:
                yield pos, base - pos
            pos = base + self.used[base]
        if pos < self.total:
            yield pos, self.total - pos

    def alloc(self, size: int, at: int | None = None) -> int | None:
        for base, length in self._gaps():
            if at is not None:
                if base <= at and at + size <= base + length:
                    self.used[at] = size
                    return at
            elif length >= size:
                self.used[base] = size
                return base
        return None

    def free(self, base: int) -> None:
        self.used.pop(base, None)

    @property
    def free_total(self) -> int:
        return self.total - sum(self.used.values())

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self._gaps()), default=0)


class Placement:
    """The slots and job indexes of one backend's jobs."""

    def __init__(self, backend: Backend, *, max_slots: int, max_jobs: int, slot_bytes: int):
        self.backend = backend
        self.slots = SlotAllocator(max_slots)
        self.max_jobs = max_jobs
        self.slot_bytes = slot_bytes
        self.indexes: set[int] = set()          # job indexes in use: main and child entries

    def _index(self, job: Job, entry: str = "") -> int:
        """A free job index for the job's main entry, or the child ``entry``."""
        index = next((i for i in range(self.max_jobs) if i not in self.indexes), None)
        if index is None:
            raise NoRoom(f"job {job.job_id} does not fit: " + (f"{entry} needs a job place, and " if entry else "")
                         + f"all {self.max_jobs} job places are in use (max_jobs); remove a job, or restart "
                         "xaggd with more --max-jobs")
        return index

    def no_room(self, job: Job, n_slots: int) -> NoRoom:
        free, largest = self.slots.free_total, self.slots.largest_free
        msg = (f"job {job.job_id} does not fit: it needs {n_slots} slots "
               f"({format_size(n_slots * self.slot_bytes)}: {n_slots // 2} chunks x 2 for round parity, "
               f"{job.max_elements} elements) but {free} slots ({format_size(free * self.slot_bytes)}) "
               f"are free of {self.slots.total}")
        if free >= n_slots:
            msg += f", the largest contiguous block being {largest} slots"
        return NoRoom(msg + "; remove a job, or restart xaggd with more --memory")

    def install(self, job: Job, at: int | None = None, index: int | None = None) -> None:
        """Place and install the job's main entry (at slot ``at`` and job
        index ``index`` where given and free) and its child entries: all or
        nothing."""
        self._install_main(job, at, index)
        placed = []
        try:
            for sub in job.subs:
                self._install_sub(job, sub)
                placed.append(sub)
        except Exception:
            for sub in placed:
                self._uninstall_sub(job, sub)
            self._uninstall_main(job)
            raise

    def uninstall(self, job: Job) -> None:
        for sub in job.subs:
            self._uninstall_sub(job, sub)
        self._uninstall_main(job)

    def reinstall(self, job: Job) -> None:
        """Install the job's entries again where they are: a new generation,
        every partial sum and counter forgotten."""
        self.backend.set_job(job.spec(), slot_base=job.slot_base, job_index=job.job_index)
        for sub in job.subs:
            self.backend.set_job(job.sub_spec(sub), slot_base=sub["slot_base"], job_index=sub["job_index"])

    def move(self, job: Job, new: Job) -> None:
        """``new``, a resized ``job``, in its place: the same job index, and
        the same first slot where it fits. ``job`` stays as it was on failure."""
        self.slots.free(job.slot_base)
        base = self.slots.alloc(new.n_slots, at=job.slot_base)
        if base is None:
            base = self.slots.alloc(new.n_slots)
        if base is None:
            self.slots.alloc(job.n_slots, at=job.slot_base)
            raise self.no_room(new, new.n_slots)
        new.slot_base = base
        try:
            self.backend.set_job(new.spec(), slot_base=base, job_index=job.job_index)
        except Exception:
            self.slots.free(base)
            self.slots.alloc(job.n_slots, at=job.slot_base)
            raise

    def _install_main(self, job: Job, at: int | None, index: int | None) -> None:
        if index is None:
            index = self._index(job)
        base = self.slots.alloc(job.n_slots, at=at)
        if base is None and at is not None:
            base = self.slots.alloc(job.n_slots)
        if base is None:
            raise self.no_room(job, job.n_slots)
        job.slot_base, job.job_index = base, index
        try:
            self.backend.set_job(job.spec(), slot_base=base, job_index=index)
        except Exception:
            self.slots.free(base)
            raise
        self.indexes.add(index)

    def _uninstall_main(self, job: Job) -> None:
        self.backend.remove_job(job.job_id)
        self.slots.free(job.slot_base)
        self.indexes.discard(job.job_index)

    def _install_sub(self, job: Job, sub: dict) -> None:
        """A child entry: its own job index and slots."""
        index = self._index(job, f"its child entry for aggregator {sub['agg_index']}")
        base = self.slots.alloc(2 * sub["n_chunks"])
        if base is None:
            raise self.no_room(job, 2 * sub["n_chunks"])
        sub["slot_base"], sub["job_index"] = base, index
        try:
            self.backend.set_job(job.sub_spec(sub), slot_base=base, job_index=index)
        except Exception:
            self.slots.free(base)
            raise
        self.indexes.add(index)

    def _uninstall_sub(self, job: Job, sub: dict) -> None:
        self.backend.remove_job(job.job_id, sub["agg_index"])
        self.slots.free(sub["slot_base"])
        self.indexes.discard(sub["job_index"])
