"""How a finished chunk's result goes back to the workers: one type for the
job, the data plane, the planner, the CLI and the lab.

``Fanout`` is the data plane's choice, mirrored from the ``XAGG_FANOUT_*``
constants of bpf/xagg_consts.h (the value is what the XDP map holds).
``ResultPath`` adds where a broadcast fan-out sends its one frame: the
subnet broadcast, or a multicast group that only the job's workers joined.
The planner's three cost models ("bcast", "mcast", "unicast") are the three
kinds of ResultPath.

``choose`` is what the hook's default fan-out ("auto") runs at registration:
results to a multicast group, one frame per chunk from each aggregator,
where every worker shares each aggregator's L2 segment; unicast elsewhere.

People, TOML/JSON files and the control API spell a fan-out as its label
("bcast", "unicast"); ``Fanout.parse`` turns a label into the enum where it
comes in, and ``label`` turns it back where it goes out (an IntEnum would
otherwise serialise to JSON as its number).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from xagg.wire.proto import C


class Fanout(IntEnum):
    BCAST = C.XAGG_FANOUT_BCAST       # one frame to one address: the subnet broadcast or a group
    UNICAST = C.XAGG_FANOUT_UNICAST   # one copy per worker, to the address its packets came from

    @property
    def label(self) -> str:
        """The user-facing spelling: CLI values, TOML/JSON fields, the control API."""
        return self.name.lower()

    def __str__(self) -> str:
        return self.label

    @classmethod
    def parse(cls, value: "Fanout | str") -> "Fanout":
        """The Fanout a label (or a Fanout) names; ValueError listing the labels."""
        if isinstance(value, cls):
            return value
        for f in cls:
            if value == f.label:
                return f
        raise ValueError(f"must be one of {', '.join(LABELS)}, got {value!r}")


assert {f.name for f in Fanout} == {k[len("XAGG_FANOUT_"):] for k in vars(C) if k.startswith("XAGG_FANOUT_")}, \
    "Fanout must mirror every XAGG_FANOUT_* of bpf/xagg_consts.h"

LABELS = tuple(sorted(f.label for f in Fanout))
# Unicast works with any number of ranks per host and across routers; a
# broadcast fan-out needs a flat LAN and one rank per host, and costs the
# aggregator one frame per chunk.
DEFAULT_FANOUT = Fanout.UNICAST
# The group a planner "mcast" model and the "auto" fan-out stand for when
# nothing names one: an organisation-local multicast address (RFC 2365 scope).
DEFAULT_GROUP = "239.77.0.1"
# The hook's fan-out choices: "auto" (its default) resolves to a ResultPath at
# registration (``choose``), the others are Fanout labels.
AUTO = "auto"
CHOICES = (AUTO, *LABELS)


@dataclass(frozen=True)
class ResultPath:
    """A fan-out and, for a broadcast fan-out, the multicast group its frame
    goes to ("": the subnet broadcast, which every host of the segment hears)."""
    fanout: Fanout = DEFAULT_FANOUT
    group: str = ""

    def __post_init__(self):
        if self.group and self.fanout is not Fanout.BCAST:
            raise ValueError(f"a result group needs fan-out 'bcast' (one frame to one address), "
                             f"got {self.fanout.label!r}")

    # -- the planner's cost models -------------------------------------------------------
    @property
    def model(self) -> str:
        """The planner's name for this path: "unicast", "mcast" (to a group) or "bcast" (the subnet)."""
        if self.fanout is Fanout.UNICAST:
            return "unicast"
        return "mcast" if self.group else "bcast"

    @classmethod
    def from_model(cls, name: "str | ResultPath") -> "ResultPath":
        """The path a planner model name stands for ("mcast": DEFAULT_GROUP); ValueError otherwise."""
        if isinstance(name, cls):
            return name
        path = {"bcast": cls(Fanout.BCAST), "mcast": cls(Fanout.BCAST, DEFAULT_GROUP),
                "unicast": cls(Fanout.UNICAST)}.get(name)
        if path is None:
            raise ValueError(f"must be one of {list(MODELS)}, got {name!r}")
        return path

    @property
    def one_frame(self) -> bool:
        """One copy of each result per link (a broadcast fan-out), not one per worker."""
        return self.fanout is Fanout.BCAST

    @property
    def reaches_aggregators(self) -> bool:
        """Whether the other aggregators hear each result too (the subnet broadcast does;
        a group only workers joined, through a snooping switch, does not)."""
        return self.fanout is Fanout.BCAST and not self.group


MODELS = ("bcast", "mcast", "unicast")


# -- the "auto" fan-out ------------------------------------------------------------------
@dataclass(frozen=True)
class Reach:
    """How one worker reaches one aggregator, as the worker's routing table
    says (xagg.wire.registration.reach): ``via`` "link" (directly connected:
    the same L2 segment), "router" (through a gateway), "local" (the
    aggregator is the worker's own host) or "" (no route)."""
    source: str = ""        # the worker's address towards the aggregator
    via: str = ""

    VIAS = ("link", "router", "local", "")

    def __post_init__(self):
        if self.via not in self.VIAS:
            raise ValueError(f"Reach.via must be one of {self.VIAS}, got {self.via!r}")


def choose(reach: list, aggregators: list, group: str = "") -> tuple[ResultPath, str]:
    """The result path for ``reach[w][k]`` (worker w's Reach of aggregator k,
    ``aggregators`` their addresses) and why, in words: a multicast group
    (``group``, default DEFAULT_GROUP) when every worker reaches every
    aggregator on its own link, from an address of its own; unicast
    otherwise: a group's frame crosses no router; a worker on an
    aggregator's host sums through the local path (xagg/client/local.py),
    which "auto" leaves at unicast; and ranks sharing a host share one
    address, where the group's result port takes one socket."""
    group = group or DEFAULT_GROUP
    for w, row in enumerate(reach):
        if len(row) != len(aggregators):
            raise ValueError(f"reach[{w}]: one Reach per aggregator ({len(aggregators)}), got {len(row)}")
        for k, r in enumerate(row):
            if r.via != "link":
                how = {"router": "through a router, which a group's frame does not cross",
                       "local": "on its own host", "": "by no route"}[r.via]
                return ResultPath(Fanout.UNICAST), f"worker {w} reaches aggregator {k} ({aggregators[k]}) {how}"
    for k in range(len(aggregators)):
        seen: dict = {}
        for w, row in enumerate(reach):
            if row[k].source in seen:
                return ResultPath(Fanout.UNICAST), (f"workers {seen[row[k].source]} and {w} share address "
                                                    f"{row[k].source}: one host's ranks take one group socket")
            seen[row[k].source] = w
    return ResultPath(Fanout.BCAST, group), "every worker is on each aggregator's own segment"
