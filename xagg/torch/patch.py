"""Make every DistributedDataParallel of an unmodified script use xagg.

``xagg-client run`` starts each rank as ``python -m xagg.torch.patch SCRIPT
ARGS`` (or ``-m MODULE ARGS``) with its settings in ``XAGG_*`` variables;
this module patches the DDP class, then runs the script as ``__main__``.

A patched DDP attaches the xagg hook at its first forward, not in its
constructor: a script that registers a comm hook of its own between the two
keeps it (DDP takes one hook per model) and we say so. Attaching is a
collective (XaggState agrees on the job); every rank runs its first forward
at the same point, as DDP itself requires. Only DDP's public methods are
wrapped (``__init__``, ``forward``, ``register_comm_hook``): a built-in hook
the script registered is found when DDP refuses ours.

At exit rank 0 says how many buckets went through xagg; a run that asked
for no fallback (``require_xagg``) and met one exits non-zero.
"""
from __future__ import annotations

import atexit
import logging
import os
import runpy
import sys
import time

from xagg.client import XaggError
from xagg.compress import attach as compress_attach
from xagg.compress import get_compressor, make_ddp_hook, optimizers
from xagg.compress.dense import Dense
from xagg.compress.selector import Auto
from xagg.torch.baseline import attach_timed_allreduce
from xagg.torch.compressed import XaggCollectives
from xagg.torch.config import COMPRESS_ENV, TRANSPORT_ENV, VERBOSE_ENV, HookConfig, HookConfigError
from xagg.torch.fallback import agree_max
from xagg.torch.hook import bucket_elements, trainable_elements, xagg_hook
from xagg.torch.hook_trial import HookTrial, trial_hook
from xagg.torch.leave import leave
from xagg.torch.state import XaggRequired, XaggState

log = logging.getLogger("xagg.torch")

_orig: dict = {}
_states: list = []          # to close at exit
_xagg: list = []            # the XaggStates of this process, for the summary at exit
_compressed: list = []      # the compression hooks' states, whose compressor may say what it chose
_said: list = []            # the summary, once said
_hook_said: list = []       # --compress auto: the hook it chose for the job, said again at exit
_refused: list = []         # require_xagg errors raised before a state existed (at its start)
EXIT_REQUIRED = 3           # the run asked for xagg only (require_xagg) and a step fell back


def _transport(env) -> str:
    """What DDP's sums go through: "xagg" (the default) or "gloo" (the baseline)."""
    return env.get(TRANSPORT_ENV) or "xagg"


class PatchError(RuntimeError):
    """The XAGG_* settings cannot be used; the message names the variable."""


def hook_config(env=None) -> HookConfig:
    """The hook's settings from the XAGG_* environment."""
    try:
        return HookConfig.from_env(os.environ if env is None else env)
    except HookConfigError as e:
        raise PatchError(str(e)) from None


def _attach(ddp) -> None:
    """Give one DDP model the hook the XAGG_* settings ask for."""
    env = os.environ
    k = len(_states)
    wire = _wire_bits(env.get(COMPRESS_ENV))
    if _compresses(env.get(COMPRESS_ENV)) and wire is None:
        wire = _attach_compressed(ddp, env)
        if wire is None:
            return
    if _transport(env) == "gloo":
        _states.append(attach_timed_allreduce(ddp))
        return
    cfg = hook_config(env)
    if wire is not None:        # --compress int16 (or auto's choice): the hook's own sums in these lanes
        cfg.wire_bits = wire
    if k and cfg.job_id is not None:
        # one operator-registered job serves one model; its rounds cannot be shared
        log.warning("xagg: DDP model #%d keeps torch's all_reduce: job %d serves model #0 only "
                    "(register jobs through xaggd control to give every model its own)", k, cfg.job_id)
        return
    if k and cfg.status_dir:
        cfg.status_dir = os.path.join(cfg.status_dir, f"model{k}")
    try:
        state = XaggState(max_elements=trainable_elements(ddp), process_group=ddp.process_group, **vars(cfg))
    except XaggRequired as e:       # the job could not start on xagg, and the run asked for nothing else
        _refused.append(str(e).partition(": ")[2])
        raise
    try:
        _orig["hook"](ddp, state, xagg_hook)
    except RuntimeError:    # DDP takes one hook: the script's built-in one is there already
        state.close()
        log.warning("xagg: the script registers its own DDP communication hook; that model "
                    "keeps it and does not use the aggregators")
        return
    _states.append(state)
    _xagg.append(state)


def _compresses(spec: str | None) -> bool:
    """Whether --compress asks for the compression hook. ``none`` (``dense``)
    is the plain hook, as without --compress: the same float32 sum, in its
    lanes, overlapping each other, where the compression hook's dense path
    sums its buckets one after another."""
    return bool(spec) and get_compressor(spec).NAME != Dense.NAME


def _wire_bits(spec: str | None) -> int | None:
    """The lane width a --compress method is (int16: 16), None for a compressor."""
    if not spec:
        return None
    comp = get_compressor(spec)
    wire = comp.WIRE_BITS
    if wire is not None and comp.warmup:
        raise PatchError(f"{COMPRESS_ENV}={spec!r}: {comp.NAME} is the hook's {wire}-bit lanes from the "
                         "first step: warmup does not apply")
    return wire


def _attach_compressed(ddp, env) -> int | None:
    """--compress: the compressor's sums go through the aggregators (XaggCollectives),
    its gathers and broadcasts through torch.distributed; --transport gloo keeps
    all of them on torch.distributed. --compress auto may find the plain hook
    faster for the whole job: then nothing is attached and the lane width it
    chose is returned."""
    collectives, comp = None, get_compressor(env[COMPRESS_ENV])
    _fit_optimizers(ddp, comp)
    if _transport(env) == "xagg":
        settings = vars(hook_config(env))
        if settings["local_reduce"] == "on":
            raise XaggError("--local-reduce on and --compress: compressed sums go rank by rank; "
                            "give one of them (--local-reduce auto leaves it off under --compress)")
        xs = _compressed_state(ddp, env)
        if xs.mode == "xagg":
            collectives = XaggCollectives(xs.client, group=ddp.process_group, state=xs)
            if isinstance(comp, Auto):
                chose = comp.hook_for(collectives, bucket_elements(ddp))
                _say_hook(chose.line())
                if chose.trial or (chose.lanes is None and chose.methods):
                    _states.append(_trial(ddp, env, comp, collectives, xs, chose))
                    _compressed.append(_states[-1])
                    return None
                if chose.lanes:     # the plain hook's job is set up anew, in its lanes
                    _states.remove(xs)
                    xs.close()
                    return chose.lanes
        else:
            log.warning("xagg: compression %s runs over torch.distributed collectives: %s",
                        env[COMPRESS_ENV], xs.reason)
    _states.append(compress_attach(ddp, comp, collectives))
    _compressed.append(_states[-1])
    return None


def _fit_optimizers(ddp, comp) -> None:
    """The optimizers built so far over ``ddp``'s parameters meet the
    compressor: under one that rescales per coordinate auto counts the
    sparse methods' times ``sparse_steps`` times (agreed over ranks: every
    rank must weigh the candidates alike); a sparse method asked for by name
    is kept, and rank 0 says what it costs such an optimizer."""
    names = optimizers.rescaling(ddp.module)
    if isinstance(comp, Auto):
        if comp.sparse == "auto" and agree_max([bool(names)], ddp.process_group)[0]:
            line = comp.fit_optimizers(names or ["another rank's optimizer"])
            if line:
                _say_hook(line)
    elif comp.SPARSE and names and os.environ.get("RANK", "0") == "0":
        log.warning("xagg: %s, and %s sends a few coordinates a step: training may need more steps than with "
                    "the dense sum (--compress int16 keeps every coordinate; auto weighs that against the time; "
                    "docs/compression.md, Known limits)", optimizers.rescale_said(names), comp.NAME)


def _compressed_state(ddp, env) -> XaggState:
    """The compression hook's job: its registration and the rank agreement,
    as for the plain hook; a compressed payload is never larger than the
    model, and the compressors sum each rank's payload: every rank is a
    worker (no local reduce)."""
    st = XaggState(process_group=ddp.process_group, max_elements=trainable_elements(ddp),
                   **{**vars(hook_config(env)), "local_reduce": "off"})
    _states.append(st)
    return st


def _say_hook(line: str) -> None:
    """What --compress auto chose for the job: said now (rank 0) and at exit."""
    _hook_said.append(line)
    if os.environ.get("RANK", "0") == "0":
        print(f"xagg-client: {line}", file=sys.stderr, flush=True)


def _trial(ddp, env, comp, collectives, xs, chose) -> HookTrial:
    """One hook that tries the compression hook's methods (``chose.methods``
    each on every bucket, then the per-bucket choice), then, where
    ``chose.trial``, the plain hook in ``chose.lanes``-bit lanes (where in
    the trial: ``chose.plain_when``), on the job ``xs`` holds
    (hook_trial.py), registered on ``ddp``."""
    lanes = chose.lanes if chose.trial else None

    def open_plain():
        cfg = hook_config(env)
        cfg.wire_bits = lanes
        st = XaggState(max_elements=trainable_elements(ddp), process_group=ddp.process_group, **vars(cfg))
        _states.append(st)
        _xagg.append(st)
        return st
    buckets, _ = make_ddp_hook(comp, collectives, ddp)
    trial = HookTrial(buckets, xs, open_plain, lanes, methods=chose.methods,
                      group=ddp.process_group, window=comp.hook_steps, rounds=comp.hook_rounds,
                      plain_when=chose.plain_when, plain_s=chose.plain_s, sums=chose.sums, said=_say_hook)
    ddp.register_comm_hook(trial, trial_hook)
    return trial


def install() -> None:
    """Patch DistributedDataParallel (idempotent)."""
    if _orig:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP
    _orig.update(init=DDP.__init__, forward=DDP.forward, hook=DDP.register_comm_hook)

    def __init__(self, *args, **kwargs):
        _orig["init"](self, *args, **kwargs)
        self._xagg_pending = True

    def forward(self, *args, **kwargs):
        if getattr(self, "_xagg_pending", False):
            self._xagg_pending = False
            _attach(self)
        return _orig["forward"](self, *args, **kwargs)

    def register_comm_hook(self, *args, **kwargs):
        if getattr(self, "_xagg_pending", False):
            self._xagg_pending = False
            log.warning("xagg: the script registers its own DDP communication hook; that model "
                        "keeps it and does not use the aggregators")
        return _orig["hook"](self, *args, **kwargs)

    import torch.distributed as dist
    _orig["destroy"] = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        # the hooks' I/O threads may still be settling the last step (store,
        # private gloo group): let them finish before the groups go
        _close_all()
        return _orig["destroy"](*args, **kwargs)

    dist.destroy_process_group = destroy_process_group
    optimizers.install()
    DDP.__init__, DDP.forward = __init__, forward
    DDP.register_comm_hook = register_comm_hook
    atexit.register(_close_all)


def _close_all() -> None:
    while _states:
        close = getattr(_states.pop(), "close", None)
        if close:
            close()
    _say_summary()


def _say_summary() -> None:
    """Rank 0, once: how many buckets the aggregators summed, so a run that
    trained on gloo does not end as if it had not."""
    if _said or os.environ.get("RANK", "0") != "0":
        return
    _said.append(True)
    for k, st in enumerate(_xagg):
        print(f"xagg-client: {summary(st.snapshot(), k if len(_xagg) > 1 else None)}", file=sys.stderr, flush=True)
    for line in _hook_said:
        print(f"xagg-client: {line}", file=sys.stderr, flush=True)
    for k, hs in enumerate(_compressed):    # --compress auto: what each bucket ended on
        said = hs.compressor.summary() if hs.compressor is not None else None     # a trial that kept the plain hook
        if said:
            head = f"model {k}: " if len(_compressed) > 1 else ""
            print(f"xagg-client: {head}{said}", file=sys.stderr, flush=True)


def summary(s: dict, model: int | None = None) -> str:
    """One line: buckets through xagg and gloo, and the last fallback's reason."""
    xagg, gloo = s["buckets_xagg"], s["buckets_gloo"]
    head = f"model {model}: " if model is not None else ""
    line = f"{head}{xagg} of {xagg + gloo} buckets through xagg, {gloo} through gloo (job {s['job_id']})"
    if gloo or s["fallbacks"]:
        line += f"; {s['fallbacks']} fallback(s), last: {s['reason']}"
    return line


def _required_failure() -> str | None:
    """Why a run that asked for xagg only (require_xagg) fell back, if it did."""
    for st in _xagg:
        if st.fallback.require and st.fallback.fallbacks:
            return st.fallback.reason
    return _refused[0] if _refused else None


def _setup_logging() -> None:
    lg = logging.getLogger("xagg")
    if not lg.handlers:
        h = logging.StreamHandler(sys.stderr)
        rank = os.environ.get("RANK", "0")
        h.setFormatter(logging.Formatter(f"[xagg rank {rank}] %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO if os.environ.get(VERBOSE_ENV) else logging.WARNING)
        lg.propagate = False


def run(argv: list[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as __main__ with DDP patched."""
    if not argv:
        raise PatchError("nothing to run: give SCRIPT [ARGS] or -m MODULE [ARGS]")
    if _transport(os.environ) == "xagg":
        hook_config()               # bad XAGG_* settings stop here, not at the first forward
    _setup_logging()
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise PatchError("-m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.isfile(script):
            raise PatchError(f"script {script!r} not found")
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def main() -> int:
    t0 = time.time()
    try:
        run(sys.argv[1:])
    except PatchError as e:
        print(f"xagg-client: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return _required_exit() or code
    except Exception:
        if _required_exit():    # the script died of the error the hook raised: said in one line
            return EXIT_REQUIRED
        raise
    log.info("xagg: script finished in %.1fs", time.time() - t0)
    return _required_exit()


def _required_exit() -> int:
    """EXIT_REQUIRED, said once, where a run that asked for xagg only fell back; else 0."""
    why = _required_failure()
    if why is None:
        return 0
    _close_all()
    if os.environ.get("RANK", "0") == "0":
        print(f"xagg-client: --require-xagg: a step fell back to gloo: {why}", file=sys.stderr, flush=True)
    return EXIT_REQUIRED


if __name__ == "__main__":
    # a script that ends (or dies mid-step) with its gloo process group alive
    # can abort the rank in the teardown: see xagg.torch.leave
    leave(main())
