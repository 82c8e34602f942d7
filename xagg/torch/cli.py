"""`xagg-client`: run unmodified DDP training through the xagg aggregators.

    xagg-client run --aggregators 10.77.0.101 --nproc-per-node 4 -- train.py --epochs 5
    torchrun --nproc-per-node 4 --no-python xagg-client run -a 10.77.0.101 -- train.py
    xagg-client status

``run`` starts the local ranks with torchrun (or, already under torchrun,
runs the script in this process) with DistributedDataParallel patched so
every DDP model the script builds uses the xagg hook (patch.py). The flags
are the hook's settings (config.py), checked here and handed to the ranks
as XAGG_* variables.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time

import click
from click.core import ParameterSource

from xagg.client.config import name_others
from xagg.torch.config import (
    COMPRESS_ENV,
    ENV,
    BOOL,
    LIST,
    REQUIRED,
    SETTINGS,
    TEXT,
    TRANSPORT_ENV,
    VERBOSE_ENV,
    HookConfig,
    HookConfigError,
    Setting,
)
from xagg.wire.fanout import AUTO, Fanout, ResultPath

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
RUNS_DIR = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"xagg-client-{os.getuid()}")
KEEP_RUNS = 20          # run directories kept under RUNS_DIR, besides any a run still writes to
STALE_RUN_S = 86400     # a run going rewrites its rank files every second: a day untouched is over


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


# HookConfig field -> the flag that sets it, as errors name it; the planner's
# routes come from the figures of --plan-inputs
FLAGS = {**{s.name: s.flags[-1] for s in SETTINGS if s.flag}, "routes": "--plan-inputs"}


class _SettingText(click.ParamType):
    """A setting's flag read as its XAGG_* variable is (config.Text), so both say the same."""

    def __init__(self, setting: Setting):
        self.text, self.name = setting.text, setting.text.name

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.text.parse(value)
        except ValueError:
            self.fail(f"{value!r}: expected {self.text.what}", param, ctx)


def _option(s: Setting):
    """The click option of one setting of the table (config.SETTINGS): its
    flag, its variable, its help with the other settings named by their flags."""
    kw = dict(help=name_others(s.help, FLAGS), metavar=s.metavar)
    if s.flag_file:     # a secret: the variable holds the value, never a file name
        return click.option(*s.flags, s.name, type=click.Path(exists=True, dir_okay=False), **kw)
    default = s.default if s.flag_default is None else s.flag_default
    kw.update(envvar=s.env, show_envvar=True, required=default is REQUIRED)
    if default not in (REQUIRED, None, []):
        kw.update(default=default, show_default=True)
    if isinstance(default, bool):
        kw["is_flag"] = True
    elif s.choices:
        kw["type"] = click.Choice(s.choices)
    elif s.text not in (TEXT, LIST, BOOL):
        kw["type"] = _SettingText(s)
    return click.option(*s.flags, s.name, **kw)


def setting_options(command):
    """Every setting that has a flag, in the table's order."""
    for s in reversed(SETTINGS):
        if s.flag:
            command = _option(s)(command)
    return command


def _hook_config(**settings) -> HookConfig:
    """The checked settings; a bad one is named by its flag, and by the
    caller's variable where the value came from there."""
    try:
        return HookConfig(**settings)
    except HookConfigError as e:
        hint = FLAGS.get(e.field, e.field)
        if click.get_current_context().get_parameter_source(e.field) is ParameterSource.ENVIRONMENT:
            hint += f" (from {ENV[e.field]})"
        raise click.BadParameter(e.explain(FLAGS), param_hint=hint) from None


def plan_job(plan_inputs: str | None, settings: dict) -> tuple[str, dict, str]:
    """--plan auto: run the planner (xagg.wire.planner) on the operator's
    figures and apply its answer to the hook's ``settings``. Returns
    (transport, settings, one line saying what and why). Every rank that
    calls it computes the same plan: the inputs are the same file and the
    planner is deterministic."""
    from xagg.wire import planner, planner_inputs
    if not plan_inputs:
        raise click.BadParameter("--plan auto needs the cluster's figures: --plan-inputs FILE (JSON, "
                                 "docs/planner.md; `xagg plan ... --json` writes one) [env XAGG_PLAN_INPUTS]",
                                 param_hint="--plan-inputs")
    if settings.get("weights"):
        raise click.BadParameter("--weights and --plan auto both set the split: give one",
                                 param_hint="--weights")
    try:
        with open(plan_inputs) as f:
            d = json.load(f)
        inputs = planner_inputs.inputs_from_dict(d.get("inputs", d) if isinstance(d, dict) else d)
    except (OSError, ValueError) as e:      # PlanInputError names the field in the file
        raise click.BadParameter(f"{plan_inputs}: {e}", param_hint="--plan-inputs") from None
    n = len([a for a in str(settings["aggregators"]).split(",") if a.strip()])
    if len(inputs.aggregators) != n:
        raise click.BadParameter(f"{plan_inputs} describes {len(inputs.aggregators)} aggregators, "
                                 f"--aggregators lists {n} (same ones, same order)", param_hint="--plan-inputs")
    job_auto = (settings.get("fanout") or AUTO) == AUTO     # resolved at registration, not here
    if not inputs.result_choices and not job_auto:      # the job's --fanout is how results go back
        job_fanout = Fanout.parse(settings["fanout"])
        if Fanout.UNICAST in (job_fanout, inputs.results.fanout):
            inputs.results = ResultPath(job_fanout)
    p = planner.make_plan(inputs)
    if p.kind == "gloo":
        return "gloo", settings, f"plan: gloo, {p.reason}"
    settings = {**settings, "weights": p.weights, "plan": "auto",
                "routes": p.routes if p.kind == "tree" else None,
                # the planner picked how results go back (the file's "fanouts"): bcast
                # fan-out is the subnet broadcast or a group, as the daemons send it
                "fanout": AUTO if job_auto and not inputs.result_choices else p.results.fanout.label}
    shares = ", ".join(f"{a.name} {w:.2f}" for a, w in zip(inputs.aggregators, p.weights))
    tree = "; the ranks register its tree routes (XAGG_ROUTES)" if p.kind == "tree" else ""
    return "xagg", settings, f"plan: {p.kind} xagg ({shares}), {p.reason}{tree}"


def _check_compress(spec: str) -> None:
    from xagg.compress import get_compressor
    try:
        get_compressor(spec)
    except (ValueError, TypeError, KeyError) as e:
        raise click.BadParameter(str(e), param_hint="--compress") from None


def _no_token_flag(value):
    if value is not None:
        raise click.BadParameter("tokens are not taken on the command line, where `ps` shows them to "
                                 "every user: use --token-file FILE or the XAGG_TOKEN environment variable",
                                 param_hint="--token")


@click.group(context_settings=CONTEXT)
def main():
    """Run PyTorch DDP training with its gradients summed by xagg aggregators."""


@main.command(context_settings={**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False})
@setting_options
@click.option("--token", "token_on_command_line", hidden=True, expose_value=False, callback=lambda ctx, p, v: _no_token_flag(v))
@click.option("--nproc-per-node", metavar="N|gpu|cpu|auto", help="ranks to start on this host (torchrun); "
              "omit when already running under torchrun")
@click.option("--nnodes", default="1", show_default=True, help="torchrun --nnodes")
@click.option("--node-rank", type=int, default=0, show_default=True, help="torchrun --node-rank")
@click.option("--master-addr", help="torchrun --master-addr (several nodes)")
@click.option("--master-port", type=int, help="torchrun --master-port")
@click.option("--transport", type=click.Choice(["xagg", "gloo"]), default="xagg", show_default=True,
              help="gloo: DDP's own all_reduce through the same wrapper and counters (a baseline)")
@click.option("--compress", metavar="NAME[:OPT=V,...]",
              help="gradient compression (xagg.compress: rgc, mstopk, iwp, sketch, lossless, int8, int16; "
                   "none or dense: the hook itself, as without --compress); auto: the hook itself in 32- or "
                   "16-bit lanes, or, where predicted 1.5x faster, per bucket dense or the method measured "
                   "fastest on this host and path, revisited as the rates drift; a sparse method's time "
                   "counts as many times as its steps take to train as far as one of exact sums (rgc 1.5, "
                   "iwp 1.6), twice that under Adam-like optimizers (auto:sparse_steps; auto:sparse=off "
                   "leaves them out, on counts them at their time) (said at start and exit; -v logs each change)")
@click.option("--plan-inputs", type=click.Path(exists=True, dir_okay=False), envvar="XAGG_PLAN_INPUTS",
              show_envvar=True,
              help="the figures --plan auto plans from: hosts' rates, racks, aggregators' packet rates "
                   "(JSON; `xagg plan --lab NAME --json` writes one)")
@click.option("--probe", "probe_mb", type=float, metavar="MB",
              help="with --plan auto: every rank in turn measures every aggregator from its host (a short "
                   "probe job, calls of MB megabytes) after the first step and at every re-plan check, and "
                   "the job re-plans when the figures are wrong (docs/planner.md; the ranks' "
                   "XAGG_REPLAN_PROBE_MB)")
@click.option("-v", "--verbose", is_flag=True, help="log every fallback and retry")
@click.argument("script", nargs=-1, required=True, type=click.UNPROCESSED)
def run(script, nproc_per_node, nnodes, node_rank, master_addr, master_port, transport, compress, plan_inputs,
        probe_mb, verbose, **settings):
    """Run SCRIPT (train.py ARGS, or -m MODULE ARGS) with every DDP model on xagg.

    \b
    The script needs no change: DistributedDataParallel is patched in each
    rank so its gradients go through the aggregators, and through gloo
    all_reduce whenever the aggregators do not answer (training goes on).
    The hook's settings come from their flags or, where a flag is not
    given, from their XAGG_* variables.
    Every other torchrun option (--rdzv-endpoint, --max-restarts, --log-dir,
    --tee, ...) may follow ours, before SCRIPT, and goes to torchrun as it
    is; or run torchrun yourself with xagg-client as its program.
    \b
    Examples:
      xagg-client run -a 10.77.0.101 --control 10.77.0.101:9979 --token-file tok \\
          --nproc-per-node 4 -- train.py --epochs 5
      torchrun --nnodes 2 --nproc-per-node gpu --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
          --no-python xagg-client run -a 10.77.0.101 --control 10.77.0.101:9979 -- train.py
      xagg-client run -a 127.0.0.1:9977 --job-id 7 --cookie 99 --nproc-per-node 2 -- \\
          examples/train_digits.py
    """
    torchrun_opts, script = split_torchrun(list(script))
    _check_run_flags(settings["plan"], compress, probe_mb, nproc_per_node)
    settings["token"] = _read_token(settings["token"])
    status_dir = settings["status_dir"] = settings["status_dir"] or os.path.join(
        RUNS_DIR, time.strftime("%Y%m%d-%H%M%S-") + str(os.getpid()))
    aggregators, hook_env = settings["aggregators"], {}
    plan = settings["plan"]
    if transport == "xagg" and plan == "auto":
        transport, settings, why = plan_job(plan_inputs, settings)
        if os.environ.get("RANK", "0") == "0":      # under torchrun every rank plans; one says so
            click.echo(f"xagg-client: {why}", err=True)
    if transport == "xagg":         # (the gloo baseline uses none of the hook's settings)
        cfg = _hook_config(**settings)
        hook_env, aggregators = cfg.to_env(), ",".join(cfg.aggregators)
    _check_script(script)
    for var in (*ENV.values(), TRANSPORT_ENV, COMPRESS_ENV, VERBOSE_ENV):
        os.environ.pop(var, None)   # the ranks see this run's settings, not the caller's
    os.environ.update(hook_env, **{TRANSPORT_ENV: transport, COMPRESS_ENV: compress or "",
                                   VERBOSE_ENV: "1" if verbose else ""})
    if transport == "xagg" and plan == "auto":
        # the ranks' re-planner (xagg/torch/replan.py) re-reads the figures from this file
        os.environ["XAGG_PLAN_INPUTS"] = os.path.abspath(plan_inputs)
        if probe_mb:
            os.environ["XAGG_REPLAN_PROBE_MB"] = repr(probe_mb)
    if nproc_per_node is None and not torchrun_opts and _under_torchrun():
        _link_latest(status_dir)
        from xagg.torch.patch import main as run_patched
        sys.argv = [sys.argv[0], *script]
        sys.exit(run_patched())
    flags = [*torchrun_opts,
             *_our_torchrun_flags(torchrun_opts, nproc_per_node, nnodes, node_rank, master_addr, master_port)]
    _link_latest(status_dir)
    click.echo(f"xagg-client: {transport} via {aggregators}; torchrun {' '.join(flags)}; "
               f"counters: xagg-client status --dir {status_dir}", err=True)
    sys.exit(launch([*flags, "-m", "xagg.torch.patch", *script]))


def launch(args: list[str]) -> int:
    """torchrun ARGS in this process (as its agent); a rank's failure in one
    line after the ranks' own output (torchrun's report of it is 25 more),
    with that rank's exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun
    try:
        torchrun(parse_args(args))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        click.echo(f"xagg-client: rank {rank} exited with status {failure.exitcode} (its output is above); "
                   "torchrun stopped the others", err=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


NO_PYTHON_FORM = ("torchrun [its options] --no-python xagg-client run -a HOST ... -- SCRIPT "
                  "(every torchrun option, xagg-client's flags after `xagg-client run`)")


def split_torchrun(args: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, SCRIPT ARGS) of what follows our own flags:
    torchrun's options (any it takes, in either spelling) come first and go
    to torchrun as they are; torchrun's own parser tells where SCRIPT starts."""
    if not args or not args[0].startswith("-") or args[0] in ("-m", "--"):
        return [], args[1:] if args[:1] == ["--"] else args
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()

    def error(message):
        raise click.UsageError(f"{message} (before SCRIPT: xagg-client's flags, then torchrun's; or run "
                               f"{NO_PYTHON_FORM})")
    parser.error = error
    if "--" in args:
        i = args.index("--")
        parser.parse_args([*args[:i], "SCRIPT"])
        return args[:i], args[i + 1:]
    ns = parser.parse_args(args)
    start = len(args) - len(ns.training_script_args) - 1
    return args[:start], args[start:]


def _option_names(opts: list[str]) -> set[str]:
    """The torchrun options in ``opts``, spelled --with-dashes."""
    return {o.split("=", 1)[0].replace("_", "-") for o in opts if o.startswith("--")}


def _option_value(opts: list[str], name: str) -> str | None:
    """The value torchrun's option ``name`` (--with-dashes) has in ``opts``, if given."""
    for k, o in enumerate(opts):
        key, eq, value = o.partition("=")
        if key.replace("_", "-") == name:
            return value if eq else (opts[k + 1] if k + 1 < len(opts) else None)
    return None


def _our_torchrun_flags(opts, nproc_per_node, nnodes, node_rank, master_addr, master_port) -> list[str]:
    """Our torchrun flags, where torchrun's own options do not give the same."""
    given = _option_names(opts)
    rendezvous = {"--rdzv-endpoint", "--rdzv-backend", "--master-addr", "--standalone"}
    nnodes = _option_value(opts, "--nnodes") or nnodes
    if str(nnodes) != "1" and not master_addr and not given & rendezvous:
        # torchrun would wait for the other nodes at its default endpoint, forever
        raise click.BadParameter(f"{nnodes} nodes meet at a rendezvous: give --master-addr (the node of rank 0) "
                                 "or torchrun's --rdzv-endpoint", param_hint="--nnodes")
    ours = {"--nproc-per-node": nproc_per_node or "1", "--nnodes": nnodes, "--node-rank": node_rank,
            "--master-addr": master_addr, "--master-port": master_port}
    out = [f"{k}={v}" for k, v in ours.items() if v is not None and k not in given]
    if not master_addr and not given & rendezvous and str(nnodes) == "1":
        out.append("--standalone")
    return out


def _check_script(script: list[str]) -> None:
    """SCRIPT is there before any rank starts (else every rank says so, after the launch)."""
    if not script:
        raise click.UsageError("no SCRIPT to run: give SCRIPT [ARGS] or -m MODULE [ARGS]")
    if script[0] == "-m":
        if len(script) < 2:
            raise click.UsageError("-m needs a module name")
    elif script[0].startswith("-"):
        raise click.UsageError(f"{script[0]}: no such option of xagg-client run or torchrun; to give torchrun "
                               f"options of your own, run {NO_PYTHON_FORM}")
    elif not os.path.isfile(script[0]):
        raise click.UsageError(f"script {script[0]!r} not found")


def _check_run_flags(plan: str, compress: str | None, probe_mb: float | None, nproc_per_node: str | None) -> None:
    """The flags of `run` that are not the hook's settings (HookConfig checks those)."""
    if compress:
        _check_compress(compress)
    if probe_mb is not None and (probe_mb <= 0 or plan != "auto"):
        raise click.BadParameter("needs --plan auto and a size > 0 (MB per probe call, e.g. 4)"
                                 if plan == "auto" else "needs --plan auto (a probe re-plans the job)",
                                 param_hint="--probe")
    if nproc_per_node is not None and nproc_per_node not in ("gpu", "cpu", "auto") and not (
            nproc_per_node.isdigit() and int(nproc_per_node) >= 1):
        raise click.BadParameter(f"{nproc_per_node!r}: a number >= 1, gpu, cpu or auto",
                                 param_hint="--nproc-per-node")


def _read_token(token_file: str | None) -> str | None:
    """The control token: from --token-file, else the caller's XAGG_TOKEN."""
    if token_file:
        with open(token_file) as f:
            return f.read().strip()
    return os.environ.get(ENV["token"]) or None


def _link_latest(status_dir: str) -> None:
    """RUNS_DIR/latest -> this run, so a bare `xagg-client status` finds it."""
    os.makedirs(status_dir, exist_ok=True)
    if os.path.dirname(os.path.abspath(status_dir)) != os.path.abspath(RUNS_DIR):
        return
    link = os.path.join(RUNS_DIR, "latest")
    try:
        tmp = f"{link}.{os.getpid()}"
        os.symlink(os.path.basename(status_dir), tmp)
        os.replace(tmp, link)
    except OSError:
        pass
    prune_runs(RUNS_DIR, status_dir)


def prune_runs(runs_dir: str, current: str, now: float | None = None) -> list[str]:
    """Remove the run directories under ``runs_dir`` beyond the KEEP_RUNS
    most recently written that nothing has written to for STALE_RUN_S, never
    ``current``; the ones removed."""
    now = time.time() if now is None else now
    try:
        runs = sorted(((e.stat(follow_symlinks=False).st_mtime, e.path) for e in os.scandir(runs_dir)
                       if e.is_dir(follow_symlinks=False)
                       and os.path.abspath(e.path) != os.path.abspath(current)), reverse=True)
    except OSError:
        return []
    gone = [path for mtime, path in runs[KEEP_RUNS:] if now - mtime >= STALE_RUN_S]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


STATUS_COLS = [("rank", "RANK"), ("mode", "MODE"), ("steps", "STEPS"), ("buckets_xagg", "XAGG"),
               ("buckets_gloo", "GLOO"), ("fallbacks", "FALLBACKS"), ("recoveries", "RECOVERED"),
               ("packets_sent", "PACKETS"), ("retransmits", "RETX"), ("mb", "MB"), ("gbps", "GBIT/S"),
               ("comm_ms", "COMM MS/STEP"), ("age", "AGE")]


def read_status(status_dir: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(status_dir, "rank*.json")),
                       key=lambda p: int(os.path.basename(p)[4:-5])):
        with open(path) as f:
            rows.append(json.load(f))
    return rows


def format_status(rows: list[dict]) -> str:
    now = time.time()
    table = []
    for r in rows:
        table.append({**r, "mb": f"{r['bytes_xagg'] / 1e6:.1f}", "gbps": f"{r['bandwidth_gbps']:.3f}",
                      "comm_ms": f"{1e3 * r['seconds_comm'] / max(1, r['steps']):.2f}",
                      "age": f"{now - r['time']:.0f}s"})
    widths = {k: max([len(h)] + [len(str(t.get(k, ""))) for t in table]) for k, h in STATUS_COLS}
    lines = ["  ".join(h.ljust(widths[k]) for k, h in STATUS_COLS)]
    lines += ["  ".join(str(t.get(k, "")).ljust(widths[k]) for k, _ in STATUS_COLS) for t in table]
    r0 = rows[0]
    head = f"job {r0.get('job_id')} via {','.join(r0.get('aggregators') or [])}, {r0.get('world')} ranks"
    reasons = sorted({r["reason"] for r in rows if r.get("reason")})
    tail = [f"last fallback: {x}" for x in reasons]
    return "\n".join([head, *(line.rstrip() for line in lines), *tail])


@main.command(context_settings=CONTEXT)
@click.option("--dir", "status_dir", type=click.Path(file_okay=False),
              help=f"the run's status directory (default: the latest run under {RUNS_DIR})")
@click.option("--json", "as_json", is_flag=True, help="print the raw counters")
@click.option("--watch", type=float, default=0, help="refresh every SECONDS until interrupted")
def status(status_dir, as_json, watch):
    """Live counters of a run: packets, retransmissions, fallbacks, bandwidth, per rank."""
    status_dir = status_dir or os.path.join(RUNS_DIR, "latest")
    while True:
        rows = read_status(status_dir) if os.path.isdir(status_dir) else []
        if not rows:
            raise click.ClickException(f"no counters in {status_dir} (is a run going, with this --dir?)")
        click.echo(json.dumps(rows, indent=1) if as_json else format_status(rows))
        if not watch:
            return
        time.sleep(watch)
        click.echo()


if __name__ == "__main__":
    main()
