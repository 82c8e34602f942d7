"""TCP control over TLS (xaggd --tls-cert/--tls-key; ControlClient tls_ca,
xaggd status --control-ca), with a self-signed certificate made here for
127.0.0.1; and the warning that plain TCP control carries tokens in clear."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import pytest

from xagg.wire.control import ControlClient, ControlError
from xagg.wire.registration import job_request, register_job
from xaggd.config import Config, ConfigError

XAGGD = [sys.executable, "-m", "xaggd.cli"]
TOKEN = "tls-admin-token-0123456789"

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="makes its certificates with openssl")


def self_signed(tmp_path, name: str, ip: str = "127.0.0.1") -> tuple[str, str]:
    """(certificate, key) PEM files: a self-signed certificate for ``ip``,
    its own CA."""
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "2", "-subj", f"/CN={name}", "-addext",
                    f"subjectAltName=IP:{ip}"], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    p.chmod(0o600)
    return str(p)


class Daemon:
    def __init__(self, tmp_path, *flags):
        self.run = tmp_path / "run"
        self.log_path = tmp_path / "log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(XAGGD + ["start", "--userspace", "--bind", "127.0.0.1", "--port", "0",
                                                  "--memory", "1M", "--listen", "127.0.0.1:0", "--name", "tls",
                                                  "--run-dir", str(self.run), *flags], stdout=log, stderr=log)
        st = ControlClient(str(self.run / "tls.sock")).wait_ready(timeout=60)
        self.addr = st["listen"]

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0


def test_control_over_tls_verifies_the_daemon_and_refuses_plain_text(tmp_path, token_file):
    cert, key = self_signed(tmp_path, "xaggd")
    other, _ = self_signed(tmp_path, "stranger")
    d = Daemon(tmp_path, "--token-file", token_file, "--tls-cert", cert, "--tls-key", key)
    try:
        with ControlClient(d.addr, token=TOKEN, tls_ca=cert) as c:
            st = c.status()
            assert st["tls"] is True and st["name"] == "tls"
            c.register(5, cookie=1, max_elements=300, n_workers=2)
            assert c.keepalive(5)["job_id"] == 5
        with ControlClient(f"tls:{d.addr}", token=TOKEN, tls_ca=cert) as c:
            assert c.list_jobs()[0]["job_id"] == 5
        # the client's own path: register_job with the CA
        req = job_request(job_id=6, cookie=2, workers=["10.0.0.1", "10.0.0.2"], max_elements=1000,
                          aggregators=["10.0.0.9:9977"], weights=None, fanout="unicast")
        assert register_job([d.addr], TOKEN, req, tls_ca=cert) == 256
        with ControlClient(d.addr, token=TOKEN, tls_ca=other) as c, \
                pytest.raises(ControlError, match="tls: the certificate of xaggd at .* does not verify"):
            c.status()
        with ControlClient(d.addr, token=TOKEN) as c, \
                pytest.raises(ControlError, match="closed the connection without answering AUTH .*serves TLS"):
            c.status()
        r = subprocess.run(XAGGD + ["status", "--connect", d.addr, "--token-file", token_file, "--control-ca", cert],
                           capture_output=True, text=True)
        assert r.returncode == 0 and f"tcp {d.addr} (TLS)" in r.stdout, r.stderr
        # the Unix socket is unchanged
        with ControlClient(str(d.run / "tls.sock")) as c:
            assert sorted(j["job_id"] for j in c.list_jobs()) == [5, 6]
        deadline = time.monotonic() + 10
        while "TLS handshake failed" not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        assert "in clear" not in d.log() and TOKEN not in d.log()
    finally:
        d.stop()


def test_plain_tcp_control_says_the_token_travels_in_clear(tmp_path, token_file):
    d = Daemon(tmp_path, "--token-file", token_file)
    try:
        with ControlClient(d.addr, token=TOKEN) as c:
            assert c.status()["tls"] is False
        assert "TCP control on 127.0.0.1:" in d.log() and "in clear; --tls-cert FILE" in d.log()
        r = subprocess.run(XAGGD + ["status", "--connect", d.addr, "--token-file", token_file],
                           capture_output=True, text=True)
        assert r.returncode == 0 and f"tcp {d.addr} (in clear)" in r.stdout
    finally:
        d.stop()
    r = subprocess.run(XAGGD + ["start", "--help"], capture_output=True, text=True)
    assert "cross the network in clear" in " ".join(r.stdout.split())
    assert "--tls-cert FILE" in r.stdout and "--tls-key FILE" in r.stdout


def test_tls_settings_are_checked(tmp_path, token_file):
    cert, key = self_signed(tmp_path, "xaggd")
    base = {"userspace": True, "listen": "127.0.0.1:0", "token_file": token_file}
    with pytest.raises(ConfigError, match=r"tls_cert=.*serves TCP control over TLS: give --listen"):
        Config.resolve({"userspace": True, "tls_cert": cert, "tls_key": key}, env={})
    with pytest.raises(ConfigError, match=r"tls_key=.*needs tls_cert"):
        Config.resolve({**base, "tls_key": key}, env={})
    with pytest.raises(ConfigError, match=r"tls_cert=.*\(from --tls-cert\): cannot read it"):
        Config.resolve({**base, "tls_cert": str(tmp_path / "none.crt")}, env={})
    other_cert, other_key = self_signed(tmp_path, "other")
    with pytest.raises(ConfigError, match=r"tls_key=.*not a PEM certificate and the private key that matches"):
        Config.resolve({**base, "tls_cert": cert, "tls_key": other_key}, env={})
    assert Config.resolve({**base, "tls_cert": cert, "tls_key": key}, env={}).tls_context() is not None
    with pytest.raises(ValueError, match="control_ca: .*not a readable PEM CA file"):
        ControlClient("127.0.0.1:9979", token=TOKEN, tls_ca=str(tmp_path / "none.pem"))
    r = subprocess.run(XAGGD + ["status", "--control-ca", cert], capture_output=True, text=True)
    assert r.returncode == 2 and "--control-ca is for --connect" in r.stderr
