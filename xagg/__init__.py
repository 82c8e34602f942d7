"""xagg: gradient all-reduce summed inside the Linux kernel (XDP).

The client library, one room per concern (daemon/xaggd is the daemon):

    wire/      what crosses the network: the packet format derived from bpf/, the
               chunk split, JobSpec and the fan-out, the control protocol, the planner
    client/    one worker's all-reduce: fixed point, packets, the C round loop, recvmmsg
    torch/     the DDP communication hook, its settings and fallback; `xagg-client`
    compress/  gradient compression methods and their torch transports
    cli/       the `xagg` command: `xagg plan` (and the lab's `xagg lab`)
    lab/       a virtual cluster in network namespaces, traffic generators and
               experiments (`xagg lab`): a dev tool
    bench/     `make bench`: each benchmark against its peer in the same run

Who may import whom (tests/test_rooms.py): wire imports nothing of ours;
client only wire; compress nothing; torch wire, client and compress; the
daemon (xaggd) only wire; cli wire, client and lab; lab, bench and
examples/ anything.
"""
