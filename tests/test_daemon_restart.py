"""A running userspace xaggd as a subprocess: SIGHUP re-reads the log level
from its config file (both ways), and a job's token still controls the job
after the daemon restarts (the saved job list keeps its hash). Each step
waits for a line the daemon logs or for its control socket, never a clock."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xagg.wire.control import ControlClient, ControlError

XAGGD = str(Path(sys.executable).parent / "xaggd")
ADMIN, CLIENT = "admin-token-0123456789abcdef", "client-token-0123456789abcdef"


class Daemon:
    """``xaggd start --userspace`` named ``name`` in ``tmp``, logging to a file."""

    def __init__(self, tmp: Path, name: str, *args: str):
        self.tmp, self.name, self.log_path = tmp, name, tmp / f"{name}.log"
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen([XAGGD, "start", "--userspace", "--bind", "127.0.0.1", "--port", "0",
                                      "--memory", "1M", "--name", name, "--run-dir", str(tmp / "run"), *args],
                                     stdout=self.log, stderr=self.log)
        self.status = ControlClient(str(tmp / "run" / f"{name}.sock")).wait_ready(timeout=120)

    def text(self) -> str:
        return self.log_path.read_text()

    def logged(self, line: str) -> str:
        """The log once it holds ``line`` (polled: a liveness bound only)."""
        for _ in range(1200):
            text = self.text()
            if line in text:
                return text
            assert self.proc.poll() is None, text
            time.sleep(0.05)
        raise AssertionError(f"xaggd never logged {line!r}:\n{self.text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_sighup_rereads_the_log_level(tmp_path):
    conf = tmp_path / "xaggd.toml"
    conf.write_text('log_level = "warning"\n')
    d = Daemon(tmp_path, "hup", "--config", str(conf))
    try:
        assert "ready:" not in d.text()                 # its info lines are not logged...
        conf.write_text('log_level = "info"\n')
        d.proc.send_signal(signal.SIGHUP)
        text = d.logged("SIGHUP: log level info; tokens re-read")   # ...until the level is info
        assert "SIGHUP: reading the configuration again" not in text  # logged while still at warning

        conf.write_text('log_level = "warning"\n')
        d.proc.send_signal(signal.SIGHUP)
        d.logged("SIGHUP: reading the configuration again")
        conf.write_text("log_level = \n")                # not TOML: the next reload keeps the config
        d.proc.send_signal(signal.SIGHUP)
        text = d.logged("SIGHUP: keeping the running configuration")
        # back at warning: neither that reload's summary nor the next one's first line
        assert "SIGHUP: log level warning" not in text
        assert text.count("SIGHUP: reading the configuration again") == 1
        assert d.proc.poll() is None
    finally:
        d.stop()
    assert d.proc.returncode == 0


def test_a_jobs_token_still_controls_it_after_a_restart(tmp_path):
    for name, tok in (("admin", ADMIN), ("client", CLIENT)):
        (tmp_path / name).write_text(tok + "\n")
        (tmp_path / name).chmod(0o600)
    args = ("--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "admin"),
            "--client-token-file", str(tmp_path / "client"))

    def tcp(d, token):
        return ControlClient(d.status["listen"], token=token)
    d = Daemon(tmp_path, "keep", *args)
    try:
        with tcp(d, CLIENT) as c:
            job_token = c.register(90, cookie=3, max_elements=1000, n_workers=2)["job_token"]
    finally:
        d.stop()
    d = Daemon(tmp_path, "keep", *args)
    try:
        assert "restored 1 of 1 saved jobs" in d.text()
        assert [j["job_id"] for j in d.status["jobs"]] == [90]
        with tcp(d, CLIENT) as c:                         # another holder of the client token
            with pytest.raises(ControlError, match="job_token: job 90 belongs to another registrant"):
                c.reset(90)
            with pytest.raises(ControlError, match="job_token: job 90 belongs to another registrant"):
                c.remove(90, job_token="not-the-jobs-token-0123456789")
        with tcp(d, CLIENT) as c:                         # its registrant, with the token it got
            assert c.reset(90, job_token=job_token)["job_id"] == 90
            assert c.remove(90, job_token=job_token)["job_id"] == 90
    finally:
        d.stop()
    assert d.proc.returncode == 0
