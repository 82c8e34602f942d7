"""What crosses the network between xagg hosts, shared by every side.

    proto.py    the packet format, derived from the C headers in bpf/ (never copied)
    jobspec.py  JobSpec: a job as one aggregator holds it, validated once
    fanout.py   Fanout (mirrored from XAGG_FANOUT_*) and ResultPath: how results go back,
                to the job, the data plane and the planner alike
    chunks.py   which aggregator holds which chunk of a tensor (the same split everywhere)
    addresses.py  "HOST:PORT" as people write it: one reading for every door
    control.py  the control protocol (NDJSON ops) and its client
    registration.py  registering one job with every aggregator of it (a tree plan's entries too)
    planner.py  the planner: where a job's gradient goes (split, tree routes) or gloo, and its
                predicted time; planner_inputs.py what it is given (hosts, rates, result path)
                and the operator's file; planner_model.py the exact time model; planner_lp.py its
                LP (scipy HiGHS) and rounding; rates.py "1gbit"
    scaling.py  the planner's model at 16-1,024 ranks: hosts of several ranks, oversubscribed racks,
                xagg (ranks or hosts as workers, flat or the rack tree) next to rings
    probe.py    measured planner inputs: probe samples -> rates (xagg/client/probe.py, xagg/lab/probe.py
                take them), and the drift they show
    metrics.py  Prometheus text exposition and its HTTP server (xaggd's and each rank's)
    syscalls.py the raw bpf(2) commands (test runs, program loads, map lookups): xaggd's, and a
                worker's on an aggregating host

Imports nothing else of xagg's: the client, the torch hook and the daemon
all build on it, so it must not build on them.
"""
