"""Finding a running daemon from the command line: through its own control
socket, a remote TCP address, or (for a user other than root) root's run dir."""
from __future__ import annotations

import os

from xagg.wire.control import ControlClient, ControlError
from xaggd.config import Config, ConfigError, read_token_file, who
from xaggd.settings import ROOT_RUN_DIR


def control_client(name, run_dir, control, config_file, connect, token_file, control_ca, timeout=10.0):
    flags = {"name": name, "run_dir": run_dir, "control": control}
    cfg = Config.resolve(flags, file=config_file, for_start=False)
    if connect:
        if not token_file:
            raise ConfigError("config: --connect needs --token-file (TCP control requires the token)")
        try:
            client = ControlClient(connect, token=read_token_file(token_file), timeout=timeout, tls_ca=control_ca)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
        return cfg, client
    if control_ca:
        raise ConfigError("config: --control-ca is for --connect HOST:PORT (TLS over TCP)")
    return cfg, ControlClient(cfg.control, timeout=timeout)


def root_daemon(cfg: Config):
    """For a user other than root whose own run dir has no daemon of this
    name: (pid, its status, or None when its control socket is not ours to
    use) of the one in root's run dir, or None. Only where the user gave no
    run dir or socket of their own."""
    from xaggd.server import pid_status
    if os.geteuid() == 0 or cfg.source("run_dir") != "default" or cfg.source("control") != "default":
        return None
    pid, alive = pid_status(os.path.join(ROOT_RUN_DIR, f"{cfg.name}.pid"))
    if not alive:
        return None
    try:
        with ControlClient(os.path.join(ROOT_RUN_DIR, f"{cfg.name}.sock"), timeout=5.0) as c:
            return pid, c.status()
    except ControlError:
        return pid, None


def root_only(cfg: Config, pid: int, command: str) -> str:
    return (f"{who(cfg.name)} runs (pid {pid}) with its files in {ROOT_RUN_DIR}, whose control socket only "
            f"root and the daemon's user may use: `sudo xaggd {command}"
            + (f" --name {cfg.name}`" if cfg.name != "xaggd" else "`"))
