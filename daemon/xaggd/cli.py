"""The `xaggd` command: start/stop/status/stats/cleanup/check.

Thin: the settings and their flags are settings.py's table, their layers
config.py, the daemon server.py, the text status and stats print report.py.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import time

import click

from xagg.wire.control import ControlClient, ControlError, DaemonUnavailable
from xagg.wire.proto import VERDICTS
from xaggd import report
from xaggd.cli_options import CONFIG_OPTION, CONTEXT, setting_options, where_options
from xaggd.config import Config, ConfigError, netns_exists, who
from xaggd.locate import control_client, root_daemon, root_only
from xaggd.settings import ROOT_RUN_DIR, SETTINGS

EXIT_NOT_RUNNING = 3            # like LSB `status`: program is not running
EXIT_UNKNOWN = 4                # LSB: status unknown (it runs, but is not ours to ask)

log = logging.getLogger("xaggd")


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", force=True)


def _fail(msg: str, code: int = 1):
    click.echo(f"xaggd: {msg}", err=True)
    sys.exit(code)


def _errors(fn):
    """ConfigError / ControlError -> one clear line, no traceback."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except ConfigError as e:
            _fail(str(e), 2)
        except DaemonUnavailable as e:
            _fail(str(e), EXIT_NOT_RUNNING)
        except ControlError as e:
            _fail(str(e), 1)
    return wrapper


@click.group(context_settings=CONTEXT)
def main():
    """xaggd: the xagg aggregator daemon. It loads the XDP program that sums
    workers' gradients inside the kernel, attaches it to an interface, and
    serves a control API where training jobs register.

    \b
    Run it (foreground, logs on stderr; systemd: daemon/xaggd.service):
      sudo xaggd start --iface eth0
      sudo xaggd start --iface eth0 --memory 1G --max-jobs 32
      sudo xaggd start --config /etc/xagg/xaggd.toml
      sudo xaggd start --iface eth0 --listen 0.0.0.0:9979 --token-file /etc/xagg/token
      xaggd start --userspace --port 9977        # no root / no XDP: Python aggregator

    \b
    Look at it, stop it:
      sudo xaggd status                # interface, mode, jobs, memory, uptime
      sudo xaggd stats --watch         # packets/s per verdict and per job
      sudo xaggd stop                  # detaches, then exits
      sudo xaggd check                 # can this host run XDP at all?

    \b
    Settings: flags > environment (XAGGD_IFACE, XAGGD_MEMORY, ...) > --config
    FILE (TOML; daemon/xaggd.example.toml documents every field) > defaults.
    Several daemons on one host: give each a --name (pid file and control
    socket are RUN_DIR/NAME.pid and RUN_DIR/NAME.sock).

    \b
    Jobs register over the control socket (newline-delimited JSON), e.g. from Python:
      from xagg.wire.control import ControlClient
      ControlClient("/run/xaggd/xaggd.sock").register(
          7, cookie=1234, max_elements=25_000_000, workers=["10.0.0.1", "10.0.0.2"])
    """


# -- start ------------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@CONFIG_OPTION
@setting_options(*(s.name for s in SETTINGS))
def start(config_file, **flags):
    """Load and attach the aggregator, serve the control API, run in the
    foreground until SIGTERM/SIGINT, then detach.

    \b
    A program left attached by a crashed xaggd is replaced ("replacing a
    stale xagg program"); another tool's XDP program is not, unless
    --replace-foreign. Every flag has an environment variable (--max-jobs:
    XAGGD_MAX_JOBS) and a TOML key (max_jobs); flags win over the
    environment, which wins over the file.

    \b
    Examples:
      sudo xaggd start --iface eth0
      sudo xaggd start --iface eth0 --memory 2G --mode driver
      sudo xaggd start --iface veth0 --netns lab-a0 --name a0
      sudo XAGGD_MEMORY=64M xaggd start --config /etc/xagg/xaggd.toml
      sudo xaggd start --iface eth0 --listen 0.0.0.0:9979 --token-file /etc/xagg/token
      xaggd start --userspace --bind 127.0.0.1 --port 9977
    """
    flags = {k: v for k, v in flags.items() if v is not None}
    try:
        cfg = Config.resolve(flags, file=config_file)
    except ConfigError as e:
        _fail(str(e), 2)
    setup_logging(cfg.log_level)
    from xaggd.dataplane import LoaderError
    from xaggd.dataplane.program import preflight
    from xaggd.server import AlreadyRunning, Server
    # each failure below is said once, on stderr (the journal, under systemd)
    if cfg.userspace:
        log.warning("userspace mode: gradients are summed in Python (xaggd.dataplane.userspace), not in the kernel; "
                    "expect a fraction of XDP's throughput")
    else:
        missing = _missing_iface(cfg)
        if missing:
            _fail(missing, 2)
        try:
            preflight(cfg.netns)
        except LoaderError as e:
            msg = str(e)
            if "--userspace" not in msg:
                msg += "\nhint: `xaggd start --userspace` runs the userspace aggregator instead"
            _fail(f"cannot run XDP here: {msg}", 1)
    server = Server(cfg, reload=lambda: Config.resolve(flags, file=config_file))
    try:
        server.run()
    except AlreadyRunning as e:
        _fail(str(e), 1)
    except LoaderError as e:
        _fail(f"{e}\nhint: `xaggd check` diagnoses XDP support; `xaggd start --userspace` "
              "runs without XDP", 1)
    except ConfigError as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail((f"{e.strerror}: {e.filename}" if e.filename else e.strerror) or str(e), 1)


def _missing_iface(cfg: Config) -> str | None:
    """Why IFACE (or its --netns) is not there, as a configuration error, or
    None. Anything else that stops the data plane is its start's to say."""
    where = f" in netns {cfg.netns}" if cfg.netns else ""
    if not netns_exists(cfg.netns):
        return (f"config: netns={cfg.netns!r} (from {cfg.source('netns')}): no such network namespace "
                "(see `ip netns`)")
    from xaggd.dataplane.attach import iproute
    try:
        with iproute(cfg.netns) as ipr:
            if ipr.link_lookup(ifname=cfg.iface):
                return None
    except Exception:  # noqa: BLE001 - cannot look: the data plane's start reports why
        return None
    return f"config: iface={cfg.iface!r} (from {cfg.source('iface')}): no such interface{where} (see `ip link`)"


# -- stop -------------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@setting_options("name", "run_dir")
@CONFIG_OPTION
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="Seconds to wait for the daemon to detach and exit.")
@_errors
def stop(name, run_dir, config_file, timeout):
    """Stop a running daemon: SIGTERM via its pid file, then wait until it
    has detached from its interface and exited.

    \b
    Examples:
      sudo xaggd stop
      sudo xaggd stop --name a0
    """
    from xaggd.server import pid_status
    cfg = Config.resolve({"name": name, "run_dir": run_dir}, file=config_file, for_start=False)
    pid, alive = pid_status(cfg.pid_file)
    found = root_daemon(cfg) if not alive and pid is None else None
    if found and found[1] is None:
        _fail(root_only(cfg, found[0], "stop"), 1)
    if found:
        _fail(f"{who(cfg.name)} runs (pid {found[0]}) with its files in {ROOT_RUN_DIR}: "
              f"`xaggd stop --name {cfg.name} --run-dir {ROOT_RUN_DIR}`", 1)
    if not alive:
        if pid is not None:
            _try_unlink(cfg.pid_file)
            click.echo(f"{who(cfg.name)} is not running (removed the stale pid file of pid {pid}; "
                       "`xaggd cleanup --iface IFACE` detaches a program a crash left behind)")
        else:
            click.echo(f"{who(cfg.name)} is not running")
        return
    where = None
    try:
        with ControlClient(cfg.control, timeout=2.0) as c:
            st = c.status()
            where = (st.get("iface"), st.get("netns"), st.get("prog_id")) if st.get("backend") == "xdp" else None
    except ControlError:
        pass
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        _fail(f"not allowed to signal pid {pid}: run as root (sudo xaggd stop)")
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while pid_status(cfg.pid_file)[1]:
        if time.monotonic() > deadline:
            _fail(f"{who(cfg.name)} (pid {pid}) did not exit within {timeout:g}s; "
                  f"`kill -9 {pid}` and then `xaggd cleanup` detach it by force")
        time.sleep(0.05)
    if where and where[0]:
        from xaggd.dataplane.attach import xdp_program
        try:
            left = xdp_program(where[0], where[1])
        except Exception:  # noqa: BLE001 - interface gone: nothing attached
            left = None
        if left and left["id"] == where[2]:
            _fail(f"{who(cfg.name)} exited but {where[0]} still has its XDP program (prog id {left['id']}); "
                  "`xaggd cleanup` removes it")
        if left:
            click.echo(f"stopped {who(cfg.name)} (pid {pid}); {where[0]} runs another XDP program "
                       f"({left['name']!r}, prog id {left['id']}), not its own: left attached")
            return
        click.echo(f"stopped {who(cfg.name)} (pid {pid}); {where[0]} has no XDP program attached")
    else:
        click.echo(f"stopped {who(cfg.name)} (pid {pid})")


def _try_unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


# -- status -----------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@where_options
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status object as JSON.")
@_errors
def status(name, run_dir, control, config_file, connect, token_file, control_ca, as_json):
    """Is the daemon running, where is it attached, which jobs does it hold,
    which of them are idle (and so near their lease's end).
    Exit status 0 when running, 3 when not, 1 when it does not answer, 4
    when it runs as root and only root may ask it.

    \b
    Examples:
      sudo xaggd status
      sudo xaggd status --name a0 --json
      xaggd status --connect 10.77.0.101:9979 --token-file token --control-ca ca.pem
    """
    from xaggd.server import pid_status
    cfg, client = control_client(name, run_dir, control, config_file, connect, token_file, control_ca)
    try:
        with client:
            st = client.status()
    except DaemonUnavailable as e:
        pid, alive = pid_status(cfg.pid_file)
        found = root_daemon(cfg) if not connect and not alive else None
        if found and found[1] is None:
            _fail(root_only(cfg, found[0], "status"), EXIT_UNKNOWN)
        if found:
            st = found[1]
        elif connect or not alive:
            if as_json:
                click.echo(json.dumps({"running": False, "name": cfg.name, "stale_pid": pid}))
            stale = f" (stale pid file for pid {pid})" if pid and not alive else ""
            _fail(f"{who(cfg.name)} is not running{stale}" if not connect else str(e), EXIT_NOT_RUNNING)
        else:
            _fail(f"{who(cfg.name)} runs (pid {pid}) but its control socket does not answer: {e}", 1)
    if as_json:
        click.echo(json.dumps({"running": True, **st}, indent=1))
        return
    click.echo(report.status_text(st))


# -- stats ------------------------------------------------------------------------
STATS_HELP = """Per-verdict packet counters and per-job aggregation, with rates from
    two samples INTERVAL apart.

    Verdicts, in the data plane's order (bpf/xagg_consts.h says what each
    means): {verdicts}. "xagg packets" excludes passed (not xagg traffic).

    \b
    Examples:
      sudo xaggd stats
      sudo xaggd stats --watch --interval 2
      sudo xaggd stats --json --job 7
    """.format(verdicts=", ".join(VERDICTS))


@main.command(context_settings=CONTEXT, help=STATS_HELP)
@where_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample: totals and rates.")
@click.option("--watch", is_flag=True, help="Keep printing every --interval until Ctrl-C.")
@click.option("--interval", type=float, default=1.0, show_default=True,
              help="Seconds between the two samples rates are computed from.")
@click.option("--job", "job_id", type=int, help="Only this job.")
@_errors
def stats(name, run_dir, control, config_file, connect, token_file, control_ca, as_json, watch, interval,
          job_id):
    cfg, client = control_client(name, run_dir, control, config_file, connect, token_file, control_ca)
    with client:
        a = client.stats(job_id)
        try:
            while True:
                time.sleep(interval)
                b = client.stats(job_id)
                r = report.rates(a, b)
                if as_json:
                    click.echo(json.dumps({**b, "rates": r}))
                else:
                    if watch:
                        click.echo()
                    click.echo(report.stats_text(b, r, cfg.name))
                if not watch:
                    return
                a = b
        except KeyboardInterrupt:
            return


# -- cleanup ----------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@CONFIG_OPTION
@setting_options("iface", "netns", "name", "run_dir")
@click.option("--force", is_flag=True, help="Also remove an XDP program that is not xagg's.")
@_errors
def cleanup(config_file, iface, netns, name, run_dir, force):
    """Remove what a dead daemon left: its XDP/tc programs on IFACE, its
    pid file and control socket. Refuses while the daemon runs. systemd's
    ExecStopPost runs this.

    \b
    Examples:
      sudo xaggd cleanup --iface eth0
      sudo xaggd cleanup --config /etc/xagg/xaggd.toml
    """
    from xaggd.dataplane.attach import is_xagg, xdp_program
    from xaggd.server import pid_status
    cfg = Config.resolve({"iface": iface, "netns": netns, "name": name, "run_dir": run_dir},
                         file=config_file, for_start=False)
    pid, alive = pid_status(cfg.pid_file)
    if alive:
        _fail(f"{who(cfg.name)} is running (pid {pid}); `xaggd stop --name {cfg.name}` detaches it")
    if pid is not None or os.path.exists(cfg.pid_file):
        _try_unlink(cfg.pid_file)
        click.echo(f"removed stale pid file {cfg.pid_file}")
    if os.path.exists(cfg.control):
        from xaggd.control_server import answers
        if not answers(cfg.control):
            _try_unlink(cfg.control)
            click.echo(f"removed stale control socket {cfg.control}")
    if not cfg.iface or cfg.userspace:
        return
    from xaggd.dataplane import LoaderError
    from xaggd.dataplane.attach import detach, holders, tc_program
    try:
        prog = xdp_program(cfg.iface, cfg.netns)
    except LoaderError as e:
        click.echo(f"{e}: nothing to detach")
        return
    users = holders(prog["id"]) if prog is not None else []
    if prog is None:
        click.echo(f"{cfg.iface}: no XDP program attached")
    elif users and not force:
        _fail(f"{cfg.iface}: XDP program {prog['name']!r} (prog id {prog['id']}) is in use by "
              + ", ".join(f"pid {p} ({c})" for p, c in users)
              + ": a running daemon's, not a dead one's; left attached (`xaggd stop` stops a daemon)")
    elif is_xagg(prog) or force:
        tc = None
        try:
            tc = tc_program(cfg.iface, cfg.netns)
        except LoaderError:
            pass
        keep_tc = tc is not None and holders(tc["id"]) and not force
        detach(cfg.iface, cfg.netns, xdp_id=None if force else prog["id"],
               tc_id=-1 if keep_tc else None)
        click.echo(f"{cfg.iface}: detached {prog['name']!r} (prog id {prog['id']})")
    else:
        click.echo(f"{cfg.iface}: runs XDP program {prog['name']!r}, not xagg's: left alone "
                   "(--force removes it)")


# -- check ------------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.option("--bench-chunks", type=int, metavar="N",
              help="Chunks the in-kernel cost measurement uses [default: xaggd.check's].")
def check(bench_chunks):
    """Can this host run the XDP aggregator? Root, kernel, bcc and headers,
    compiling and verifying the program, its results against the userspace
    aggregator's, its cost per packet. Exit 0 only if every step passes.

    \b
    Examples:
      sudo xaggd check
      sudo xaggd check --bench-chunks 2048
    """
    from xaggd.check import main as run_checks
    sys.exit(run_checks() if bench_chunks is None else run_checks(bench_chunks=bench_chunks))


if __name__ == "__main__":  # pragma: no cover
    main()
