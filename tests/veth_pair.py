"""Two network namespaces joined by one veth pair, addressed and up: the
smallest lab a test that attaches XDP to a real interface needs (the
namespaces are created here and always deleted)."""
from __future__ import annotations

import contextlib
import subprocess

from pyroute2 import netns


def sh(*argv) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def veth_pair(a: tuple, b: tuple):
    """``a`` and ``b``: (namespace, interface, IPv4 address) of each end (/24)."""
    ends = (a, b)
    for ns, _, _ in ends:
        netns.create(ns)
    try:
        sh("ip", "link", "add", a[1], "netns", a[0], "type", "veth", "peer", "name", b[1], "netns", b[0])
        for ns, ifname, ip in ends:
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
        yield
    finally:
        for ns, _, _ in ends:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
