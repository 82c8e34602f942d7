"""What the `xaggd` command says to the people who run it: one line per
failure, and a daemon found (or pointed at) where a user's own run dir has
none."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from xagg.wire.control import ControlClient

XAGGD = [sys.executable, "-m", "xaggd.cli"]
ROOT_RUN_DIR = "/run/xaggd"             # root's run dir (settings.default_run_dir)


def test_start_on_a_missing_interface_says_so_once_as_a_configuration_error(tmp_path):
    r = subprocess.run(XAGGD + ["start", "--iface", "nosuch0", "--name", "nosuch", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "xaggd: config: iface='nosuch0' (from --iface): no such interface (see `ip link`)"]
    r = subprocess.run(XAGGD + ["start", "--iface", "eth0", "--netns", "nosuch-ns", "--name", "nosuch",
                                "--run-dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "xaggd: config: netns='nosuch-ns' (from --netns): no such network namespace (see `ip netns`)"]
    assert not os.path.exists("/run/netns/nosuch-ns")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_status_as_another_user_points_at_roots_daemon(tmp_path):
    """A user's own run dir ($XDG_RUNTIME_DIR/xaggd, /tmp/xaggd-UID) has no
    daemon while root's (/run/xaggd) has one: say so, and how to ask it."""
    name = f"nonroot{os.getpid()}"
    log = open(tmp_path / "log", "w")
    p = subprocess.Popen(XAGGD + ["start", "--userspace", "--bind", "127.0.0.1", "--port", "0", "--memory", "1M",
                                  "--name", name], stdout=log, stderr=log)
    try:
        ControlClient(f"{ROOT_RUN_DIR}/{name}.sock").wait_ready(timeout=60)
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR" and not k.startswith("XAGGD_")}
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        r = subprocess.run(nobody + XAGGD + ["status", "--name", name], capture_output=True, text=True, env=env,
                           cwd="/")
        assert r.returncode == 4, r.stderr
        assert f"xaggd {name} runs (pid {p.pid}) with its files in {ROOT_RUN_DIR}" in r.stderr
        assert f"`sudo xaggd status --name {name}`" in r.stderr and "not running" not in r.stderr
        r = subprocess.run(nobody + XAGGD + ["stop", "--name", name], capture_output=True, text=True, env=env,
                           cwd="/")
        assert r.returncode == 1 and f"`sudo xaggd stop --name {name}`" in r.stderr
        assert p.poll() is None
        # a run dir of the user's own: only that one is asked
        r = subprocess.run(nobody + XAGGD + ["status", "--name", name, "--run-dir", "/tmp/xaggd-none"],
                           capture_output=True, text=True, env=env, cwd="/")
        assert r.returncode == 3 and "is not running" in r.stderr
        r = subprocess.run(XAGGD + ["status", "--name", name], capture_output=True, text=True)
        assert r.returncode == 0 and f"xaggd {name}: running (pid {p.pid})" in r.stdout
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        log.close()
        Path(f"{ROOT_RUN_DIR}/{name}.jobs.json").unlink(missing_ok=True)
