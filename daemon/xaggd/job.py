"""A job as one aggregator holds it: what its registrant asked for, where
its slots and job index are, and the data plane entries (JobSpec) it
installs: its main entry, and one child entry per other aggregator whose
chunks it sums some workers for."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from xagg.wire.addresses import parse_addr
from xagg.wire.fanout import Fanout
from xagg.wire.jobspec import JobSpec
from xaggd.lease import Activity


@dataclass
class Job:
    job_id: int
    cookie: int
    workers: list                       # IPv4 per worker id, "" = any source
    max_elements: int
    fanout: Fanout                      # the request's label, parsed by JobSpec
    bcast_ip: str
    result_port: int
    aggregators: list                   # [{"addr", "weight"}]
    agg_index: int
    n_chunks: int                       # chunks this aggregator holds
    slot_base: int = 0
    job_index: int = 0
    registered_at: float = field(default_factory=time.time)
    resets: int = 0
    token_hash: bytes | None = field(default=None, repr=False)     # its job token's SHA-256
    children: list = field(default_factory=list)    # [{"addr", "workers"}]: partial sums for our chunks
    child_for: list = field(default_factory=list)   # [{"agg_index", "workers", "parent"}]
    # one placed child entry per child_for: {"agg_index", "n_chunks", "slot_base", "job_index", "parent_mac"}
    subs: list = field(default_factory=list)
    activity: Activity = field(default_factory=lambda: Activity(at=time.monotonic()), repr=False, compare=False)

    @property
    def n_slots(self) -> int:
        return 2 * self.n_chunks

    def spec(self) -> JobSpec:
        return JobSpec(job_id=self.job_id, cookie=self.cookie, n_workers=len(self.workers),
                       n_chunks=self.n_chunks, fanout=self.fanout, bcast_ip=self.bcast_ip,
                       result_port=self.result_port,
                       worker_ips=self.workers if any(self.workers) else [],
                       # packets naming another of the job's aggregators are dropped (wrong_agg)
                       agg_id=self.agg_index, n_aggs=len(self.aggregators),
                       children=[(c["addr"], c["workers"]) for c in self.children])

    def sub_spec(self, sub: dict) -> JobSpec:
        """The child entry for aggregator sub["agg_index"]'s chunks."""
        cf = next(c for c in self.child_for if c["agg_index"] == sub["agg_index"])
        ip, port = parse_addr(cf["parent"])
        return JobSpec(job_id=self.job_id, cookie=self.cookie, n_workers=len(self.workers),
                       n_chunks=sub["n_chunks"], fanout=self.fanout, bcast_ip=self.bcast_ip,
                       result_port=self.result_port, worker_ips=self.workers if any(self.workers) else [],
                       agg_id=cf["agg_index"], n_aggs=len(self.aggregators), mask=cf["workers"],
                       parent_ip=ip, parent_port=port, parent_mac=sub.get("parent_mac") or "")

    def params(self) -> dict:
        """What the client asked for (compared on re-registration)."""
        return {"cookie": self.cookie, "workers": self.workers, "max_elements": self.max_elements,
                "fanout": self.fanout.label, "bcast_ip": self.bcast_ip, "result_port": self.result_port,
                "aggregators": self.aggregators, "agg_index": self.agg_index,
                "children": self.children,
                "child_for": [{"agg_index": c["agg_index"], "workers": c["workers"]} for c in self.child_for]}

    def describe(self, slot_bytes: int) -> dict:
        return {"job_id": self.job_id, "job_index": self.job_index, **self.params(),
                "n_workers": len(self.workers), "n_chunks": self.n_chunks,
                "slot_base": self.slot_base, "n_slots": self.n_slots,
                "memory_bytes": self.n_slots * slot_bytes,
                "registered_at": self.registered_at, "resets": self.resets,
                "child_entries": [{k: s[k] for k in ("agg_index", "n_chunks", "slot_base", "job_index",
                                                     "parent_mac")} for s in self.subs]}
