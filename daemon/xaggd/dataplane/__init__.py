"""The aggregator's data plane: the XDP program, and the same protocol in Python.

    program.py    compile bpf/xagg_xdp.c with bcc, load it, own its maps (jobs, slots, counters)
    attach.py     attach/detach XDP and the tc fan-out with pyroute2; what is attached where
    caps.py       the capabilities loading and attaching take (not uid 0), and which are missing
    frames.py     Ethernet/IPv4/UDP frames around xagg payloads, for test-run
    cost.py       the program's cost per packet, measured in the kernel (test-run)
    userspace.py  the protocol aggregated in Python: `xaggd start --userspace`, and the
                  reference the kernel program is tested against

Imports only xagg.wire of the client library (the raw bpf(2) commands are
xagg.wire.syscalls, which the client's local path shares).
"""


class LoaderError(RuntimeError):
    """Something stops the data plane from loading or attaching; the message
    says what to do."""
