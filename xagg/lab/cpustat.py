"""Whole-machine CPU time: what lab experiments charge to a transport.

All the lab's hosts share this machine's CPUs, kernel packet paths
included, so the CPU a run costs is read from /proc/stat, not per process.
"""
from __future__ import annotations

import os


def machine_cpu_seconds() -> float:
    """user + nice + system + irq + softirq of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in parts[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
