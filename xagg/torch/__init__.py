"""xagg for PyTorch DDP: a communication hook that sums buckets on the aggregators.

    from xagg.torch import XaggState, xagg_hook, attach
    state = XaggState(["10.0.0.101:9977"], control=["10.0.0.101:9979"], token=T,
                      max_elements=sum(p.numel() for p in model.parameters()))
    ddp.register_comm_hook(state, xagg_hook)
    # or, the same in one line:
    state = attach(ddp, ["10.0.0.101:9977"], control=["10.0.0.101:9979"], token=T)

The hook averages like DDP's default, overlaps communication with backward
(a background I/O thread) and, with ``lanes``, buckets with each other, and
falls back to an all_reduce over gloo, agreed by every rank, whenever the
aggregators do not answer.

    hook.py        xagg_hook and attach(): the comm hook, in torch's ddp_comm_hooks style
    state.py       XaggState: settings, counters, fallback, rounds; pickles with a checkpoint
    config.py      HookConfig: the hook's settings, defaults and checks (kwargs, flags, XAGG_*)
    engine.py      the I/O thread: buckets in order, executes each step's agreement
    agreement.py   the per-step agreement as data: what ranks post, what they decide
    aggregator_set.py  the aggregators a job sums on (register, plan out, adopt) and its clients
    result_path.py how results come back under --fanout auto, and the first round's check of it
    buckets.py     a bucket on its way, and the lane thread that sums it through xagg
    progress.py    a rank's status file, progress line and metrics endpoint
    lanes.py       several buckets in flight: one job per lane, its id and result port
    local_reduce.py  a host's ranks sum in shared memory first; each sends its share as the host
    replan.py      re-plans the split between steps when the plan's rates drift (--plan auto)
    board.py       the per-step agreement through the rendezvous store
    fallback.py    the one fallback policy (back-off, retry, recovery) for the hook and compression
    compressed.py  XaggCollectives: xagg.compress's sums through the aggregators
    hook_trial.py  --compress auto's trial of whole steps: methods on every bucket, per-bucket, plain; the fastest kept
    baseline.py    DDP's own all_reduce, timed like the hook (the gloo baseline)
    metrics.py     a rank's counters as Prometheus text (XAGG_METRICS)
    patch.py       makes every DDP of an unmodified script use the hook (xagg-client run)
    leave.py       a finished rank exits without the interpreter's teardown (where gloo can abort it)
    cli.py         the `xagg-client` command: run, status

Every module here imports the real ``torch`` by absolute import, so nothing
here shadows it; torch itself is imported only when the hook is used, so
``xagg-client --help`` starts fast.
"""

__all__ = ["XaggState", "XaggStateError", "attach", "xagg_hook"]


def __getattr__(name):
    if name in ("attach", "xagg_hook"):
        from xagg.torch import hook
        return getattr(hook, name)
    if name in ("XaggState", "XaggStateError"):
        from xagg.torch import state
        return getattr(state, name)
    raise AttributeError(f"module 'xagg.torch' has no attribute {name!r}")
