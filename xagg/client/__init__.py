"""One worker's side of an all-reduce through xagg aggregators.

    config.py      ClientConfig, the defaults every layer above takes, XaggError/XaggTimeout
    allreduce.py   Client: the round protocol (predict, exchange, check, redo, remember, decode)
    stats.py       ClientStats: what a client counts
    packets.py     one round's packets and the book of their results; a shape's layout, built once
    exchange.py    the step a round repeats (send under a window, collect, retransmit): the interface
    window.py      that window, halved after a call that was a resend storm, grown back after clean ones
    exchange_numpy.py   its numpy implementation, the reference (rtt.py: its retransmit timeout)
    exchange_native.py  its compiled one, csrc/exchange.c
    exchange_afxdp.py   the compiled one over an AF_XDP socket (csrc/xsk*.c, bpf/xsk_redirect.c),
                        falling back to UDP with the reason (config.path)
    xsk.py         what AF_XDP needs from the host: its build, interface, next hop, frame headers
    udp.py         the worker's socket, and sending runs of packets with UDP GSO
    fixedpoint.py  one exponent per chunk, predicted from past calls and checked in the same round
    codec.py       fixedpoint's encode/decode compiled (csrc/codec.c): one pass each way, no copies;
                   and numpy's behind the same calls
    native.py      builds and loads csrc/exchange.c (the round loop), csrc/codec.c and
                   csrc/local.c into one library (numpy loop and numpy codec as fallback)
    local_link.py  which aggregator is on this host, held and taken again after a failed round
    local.py       an aggregator on this worker's own host: packets through its XDP program
                   (BPF_PROG_TEST_RUN), sums from its slot map, its program from xaggd
    mmsg.py        recvmmsg(2): a burst of result datagrams in one system call
    probe.py       short all-reduces from this host through each aggregator: planner inputs
    handshake.py   one probe packet to each aggregator: its values per packet, its verdict on the job
    host_sum.py    a host's ranks in shared memory: their slices summed in one pass, a futex barrier
                   (csrc/host_sum.c; numpy as fallback)

    from xagg.client import Client, ClientConfig
    with Client(ClientConfig(job_id=7, cookie=99, worker_id=0, n_workers=4,
                             aggregators=["10.0.0.5"])) as c:
        total = c.allreduce(grad)          # float32, the same on every worker
        c.allreduce(grad, out=grad)        # or the sum into grad itself

Imports only xagg.wire: no torch, no daemon.
"""
from xagg.client.allreduce import Client
from xagg.client.config import ClientConfig, XaggError, XaggTimeout
from xagg.client.stats import ClientStats

__all__ = ["Client", "ClientConfig", "ClientStats", "XaggError", "XaggTimeout"]
