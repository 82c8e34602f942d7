"""`xagg lab ...`: the lab's commands, which the `xagg` command (xagg.cli)
adds as its `lab` group. Thin: the logic lives in cluster.py."""
from __future__ import annotations

import functools
import json
import os

import click

from xagg.lab import cluster as labmod
from xagg.lab.cluster import DEFAULT_NAME, Lab, LabError, LabSpec
from xagg.wire.rates import format_bps

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _errors(fn):
    """LabError -> one clear line and exit status 1, no traceback."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except LabError as e:
            raise click.ClickException(str(e)) from None
    return wrapper


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


HOST_COLS = ["name", "kind", "netns", "ip", "mac", "rate", "loss", "drops", "state"]

name_option = click.option(
    "-n", "--name", default=DEFAULT_NAME, show_default=True, envvar="XAGG_LAB",
    help="Lab name; its namespaces are NAME-sw, NAME-w0, ... [env XAGG_LAB]")


@click.group(context_settings=CONTEXT)
def lab():
    """A virtual cluster of network namespaces on one bridge (or racks of them), for tests, demo and bench.

    \b
    Each host (workers w0.., aggregators a0..) is a namespace NAME-HOST with
    one interface, eth0, plugged into a bridge in the namespace NAME-sw.
    Workers get 10.77.0.1.., aggregators 10.77.0.101..; links can be shaped
    (tbf, both directions) and made lossy (random UDP drops at the switch).
    Nothing is created outside those namespaces.

    \b
    Examples:
      xagg lab up -w 4 -a 1 --rate 1gbit --rate-of w3=200mbit
      xagg lab status
      xagg lab exec w0 -- ping -c1 10.77.0.101
      xagg lab exec a0 -- tcpdump -ni eth0 udp
      xagg lab loss 1 --port 9977          # 1% of workers' UDP to :9977 lost
      xagg lab down                        # also cleans up after a crash
    """


@lab.command(context_settings=CONTEXT)
@click.option("-w", "--workers", type=int, default=2, show_default=True, help="Worker hosts w0..")
@click.option("-a", "--aggregators", type=int, default=1, show_default=True,
              help="Aggregator hosts a0..")
@click.option("--rate", metavar="RATE", help="Every host's link, both directions: 1gbit, "
              "200mbit, 500kbit or bits/s.  [default: unshaped]")
@click.option("--rate-of", "rate_of", multiple=True, metavar="HOST=RATE",
              help="Per-host override, repeatable: --rate-of w2=200mbit")
@click.option("--loss", type=float, default=0.0, metavar="PERCENT",
              help="Random loss of the UDP frames workers send.")
@click.option("--loss-port", type=int, help="Only lose UDP to this destination port.")
@click.option("--subnet", default="10.77.0.0/24", show_default=True)
@click.option("--mtu", type=int, default=1500, show_default=True)
@click.option("--queues", type=int, default=2, show_default=True,
              help="rx/tx queues of aggregator veths (2: XDP on both cores at once, so xaggd takes its "
              "slot lock; 1: one CPU at a time, so xaggd leaves the lock out).")
@click.option("--racks", type=int, default=1, show_default=True,
              help="Bridges joined through a core bridge by shaped uplinks; hosts go to "
              "racks in contiguous blocks (w0,w1 | w2,w3).")
@click.option("--uplink", metavar="RATE", help="Each rack's uplink, both directions "
              "(needs --racks > 1).  [default: unshaped]")
@click.option("--rack-of", "rack_of", multiple=True, metavar="HOST=RACK",
              help="Put a host in another rack, repeatable: --rack-of a1=0")
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
@name_option
@_errors
def up(workers, aggregators, rate, rate_of, loss, loss_port, subnet, mtu, queues, racks,
       uplink, rack_of, as_json, name):
    """Build a lab and print its hosts.

    \b
    Examples:
      xagg lab up --workers 3
      xagg lab up -w 8 -a 2 --rate 1gbit --rate-of w7=200mbit --loss 0.5
      xagg lab up --name b --subnet 10.78.0.0/24    # a second lab beside the first
      xagg lab up -w 4 -a 2 --rate 1gbit --racks 2 --uplink 500mbit
    """
    rack_map = {h: r for h, r in _pairs(rack_of, "--rack-of", "HOST=RACK, e.g. a1=0").items()}
    for h, r in rack_map.items():
        if not r.isdigit():
            raise click.BadParameter(f"{h}={r}: RACK is a number 0..{racks - 1}",
                                     param_hint="--rack-of")
        rack_map[h] = int(r)
    spec = LabSpec(workers=workers, aggregators=aggregators, rate=rate,
                   rate_of=_pairs(rate_of, "--rate-of", "HOST=RATE, e.g. w2=200mbit"),
                   loss_percent=loss, loss_udp_port=loss_port, name=name, subnet=subnet,
                   mtu=mtu, agg_queues=queues, racks=racks, uplink=uplink, rack_of=rack_map)
    the_lab = Lab(spec).up()
    _print_hosts(the_lab, the_lab.status(), as_json)


def _pairs(items, hint: str, form: str) -> dict[str, str]:
    """["w2=200mbit", ...] -> {"w2": "200mbit"}; a missing '=' names the option."""
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected {form}", param_hint=hint)
        out[key.strip()] = val.strip()
    return out


def _print_hosts(the_lab: Lab, rows: list[dict], as_json: bool) -> None:
    uplinks = [{"rack": r, "up": format_bps(u, unshaped="-"), "down": format_bps(d, unshaped="-")}
               for r, (u, d) in enumerate(the_lab.uplink_rates())]
    if as_json:
        click.echo(json.dumps({"name": the_lab.name, "switch_netns": the_lab.switch_ns,
                               "broadcast": the_lab.broadcast, "hosts": rows,
                               "uplinks": uplinks}, indent=1))
    else:
        click.echo(f"lab {the_lab.name}: switch netns {the_lab.switch_ns}, "
                   f"broadcast {the_lab.broadcast}")
        click.echo(_table(rows, HOST_COLS + (["rack"] if uplinks else [])))
        for u in uplinks:
            click.echo(f"rack {u['rack']} uplink: {u['up']} up, {u['down']} down")


@lab.command(context_settings=CONTEXT)
@name_option
@click.option("--all", "all_labs", is_flag=True, help="Every lab on this machine.")
@_errors
def down(name, all_labs):
    """Remove a lab: its processes, namespaces, links and state file.

    Works after a crash and without the state file; safe to repeat.

    \b
    Examples:
      xagg lab down
      xagg lab down --name b
      xagg lab down --all
    """
    for n in labmod.list_labs() if all_labs else [name]:
        removed = labmod.destroy(n)
        click.echo(f"lab {n}: removed {len(removed)} namespaces" if removed
                   else f"lab {n}: nothing to remove")


@lab.command(context_settings=CONTEXT)
@click.option("-n", "--name", envvar="XAGG_LAB", help="One lab [default: all labs]")
@click.option("--json", "as_json", is_flag=True)
@_errors
def status(name, as_json):
    """Show labs and their hosts as the kernel sees them (link state, shaping).

    \b
    Examples:
      xagg lab status
      xagg lab status --name b --json
    """
    labmod.need_root()
    names = [name] if name else labmod.list_labs()
    if not names:
        click.echo("no labs; `xagg lab up` builds one")
    for n in names:
        try:
            the_lab = Lab.load(n)
        except labmod.LabNotFound:
            left = labmod.lab_namespaces(n)
            if not left:
                raise
            click.echo(f"lab {n}: no state file, leftover namespaces {', '.join(left)}; "
                       f"`xagg lab down --name {n}` removes them")
            continue
        _print_hosts(the_lab, the_lab.status(), as_json)


@lab.command(context_settings={**CONTEXT, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
@name_option
@click.argument("host")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@_errors
def exec(name, host, cmd):  # noqa: A001 - the subcommand's name
    """Run CMD inside HOST's namespace (HOST: w0.., a0.., or 'switch').

    \b
    Examples:
      xagg lab exec w0 -- ping -c1 10.77.0.101
      xagg lab exec a0 -- ip -s link show eth0
      xagg lab exec switch -- nft list ruleset
    """
    labmod.need_root()
    cmd = list(cmd[1:] if cmd[0] == "--" else cmd)   # click keeps "--" after HOST
    if not cmd:
        raise click.UsageError("no command; e.g. xagg lab exec w0 -- ip addr")
    argv = Lab.load(name).argv_in(host, cmd)
    os.execv(argv[0], argv)   # become the command: its exit status and signals


@lab.command(context_settings=CONTEXT)
@name_option
@click.argument("percent", type=float)
@click.option("--host", "hosts", multiple=True, help="Repeatable [default: every worker]")
@click.option("--port", type=int, help="Only UDP to this destination port.")
@click.option("--dir", "direction", type=click.Choice(["out", "in", "both"]), default="out",
              show_default=True, help="out: frames the host sends; in: frames it receives.")
@_errors
def loss(name, percent, hosts, port, direction):
    """Set random UDP loss on hosts' links (0 removes it).

    \b
    Examples:
      xagg lab loss 1                       # 1% of what every worker sends
      xagg lab loss 5 --host w2 --dir both  # w2's link loses 5% each way
      xagg lab loss 0                       # workers lossless again
    """
    labmod.need_root()
    Lab.load(name).set_loss(percent, hosts=list(hosts) or None, udp_port=port,
                            direction=direction)


@lab.command(context_settings=CONTEXT)
@name_option
@click.argument("rate")
@click.option("--host", "hosts", multiple=True, help="Repeatable [default: every host]")
@click.option("--uplinks", is_flag=True, help="Reshape the racks' uplinks instead of hosts.")
@_errors
def rate(name, rate, hosts, uplinks):
    """Reshape hosts' links, both directions ('none' removes shaping).

    \b
    Examples:
      xagg lab rate 1gbit
      xagg lab rate 200mbit --host w3
      xagg lab rate 250mbit --uplinks     # every rack's uplink (a lab with --racks)
    """
    labmod.need_root()
    if uplinks:
        if hosts:
            raise click.UsageError("--uplinks shapes the rack uplinks; it takes no --host")
        Lab.load(name).set_uplink(rate)
    else:
        Lab.load(name).set_rate(rate, hosts=list(hosts) or None)

