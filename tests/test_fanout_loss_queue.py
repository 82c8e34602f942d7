"""xaggd's unicast fan-out needs a queue on its interface
(daemon/xaggd/dataplane/attach.py): tc clones each result once per worker
in one burst, and a veth without a qdisc drops what its peer's ring cannot
take at once. attach() warns when the interface has none."""
from __future__ import annotations

import os

from veth_pair import sh, veth_pair

from xaggd.dataplane.attach import has_queue

NS = (f"fq{os.getpid() % 100000}a", f"fq{os.getpid() % 100000}b")


def test_a_veth_has_no_queue_until_it_is_given_one():
    with veth_pair((NS[0], "eth0", "10.79.0.1"), (NS[1], "eth0", "10.79.0.2")):
        assert not has_queue("eth0", NS[0])             # veth's default: noqueue
        sh("ip", "netns", "exec", NS[0], "tc", "qdisc", "add", "dev", "eth0", "clsact")
        assert not has_queue("eth0", NS[0])             # the tc hook is no queue
        sh("ip", "netns", "exec", NS[0], "tc", "qdisc", "add", "dev", "eth0", "root", "pfifo_fast")
        assert has_queue("eth0", NS[0])
