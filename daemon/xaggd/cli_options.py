"""The flags commands share: one per setting of settings.py's table, the
config file, and how a command finds a running daemon."""
from __future__ import annotations

import click

from xaggd.settings import BY_NAME, parse_bool, parse_int

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def setting_option(name: str):
    """The flag of one setting (settings.py). Its default is None, "not
    given", so the environment and the file show through (config.py)."""
    s = BY_NAME[name]
    decl = f"{s.flag}/{s.off_flag or '--no-' + s.flag[2:]}" if s.parse is parse_bool else s.flag
    kw = {"default": None, "help": s.help_text, "metavar": s.metavar}
    if s.choices:
        kw["type"] = click.Choice(s.choices)
    elif s.parse is parse_int:
        kw["type"] = int
    return click.option(decl, name, **kw)


def setting_options(*names: str):
    """Flags for these settings, listed in this order."""
    def decorate(fn):
        for name in reversed(names):
            fn = setting_option(name)(fn)
        return fn
    return decorate


CONFIG_OPTION = click.option("--config", "config_file", metavar="FILE", type=click.Path(dir_okay=False),
                             help="TOML file with any of the settings [env XAGGD_CONFIG].")


def where_options(fn):
    """How a command finds a running daemon."""
    opts = [
        setting_options("name", "run_dir", "control"),
        CONFIG_OPTION,
        click.option("--connect", metavar="HOST:PORT",
                     help="A remote daemon's TCP control address (with --token-file)"),
        click.option("--token-file", metavar="FILE",
                     help="Token for --connect: the admin or the client token (never on the command line)"),
        click.option("--control-ca", metavar="FILE",
                     help="TLS for --connect: the PEM CA file that signed the daemon's --tls-cert. Without "
                          "it the token crosses the network in clear"),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn
