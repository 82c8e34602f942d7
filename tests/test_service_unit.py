"""daemon/xaggd.service and what it asks of the daemon.

The unit passes `systemd-analyze verify`, and its command lines are ones
xaggd takes. What the unit relies on is then tried without systemd (PID 1
here is not systemd, so the unit itself cannot be started): xaggd as a user
that is not root, holding only the unit's ambient capabilities, in a lab
namespace; READY=1 on a fake $NOTIFY_SOCKET once the program is attached;
the jobs kept in the state dir through a restart whose run dir is removed
(as systemd removes RuntimeDirectory= on stop); and, after the daemon was
killed, its refusal to start over a program it may not identify, and the
ExecStopPost cleanup, run with full privileges as the unit's "+" asks.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from veth_pair import veth_pair

from xagg.wire.control import ControlClient
from xaggd.dataplane import LoaderError, caps
from xaggd.dataplane.attach import xdp_attached

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "daemon" / "xaggd.service"
XAGGD = Path(sys.executable).parent / "xaggd"
TAG = f"svc{os.getpid() % 100000}"
NS, PEER_NS = f"{TAG}a", f"{TAG}b"
IFACE = "sv0"
NOBODY = 65534
READY_S = 180          # compiling competes with whatever else runs


def unit_directives() -> dict[str, list[str]]:
    """KEY -> its values, in order, of the [Service] and [Unit] sections."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def unit_command(key: str) -> tuple[str, list[str]]:
    """ExecStart= or ExecStopPost= as (its prefix, argv), with the specifiers
    it uses expanded as for a system service (%t = /run, %S = /var/lib)."""
    (line,) = unit_directives()[key]
    prefix = re.match(r"[-+@:!]*", line).group(0)
    return prefix, shlex.split(line[len(prefix):].replace("%t", "/run").replace("%S", "/var/lib"))


# -- the unit file ----------------------------------------------------------------
def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    """With ExecStart's binary where it is installed here: no error and no
    warning (an unknown key is only a warning, so stderr must be empty)."""
    unit = tmp_path / "xaggd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/xaggd", str(XAGGD)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "", r.stderr + r.stdout
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True)
    level = float(re.search(r"Overall exposure level for xaggd.service: ([\d.]+)", r.stdout).group(1))
    assert level < 5.0, r.stdout[-3000:]


def test_the_unit_runs_a_notifying_daemon_with_capabilities_not_root():
    d = unit_directives()
    assert d["Type"] == ["notify"]
    assert d["User"] == ["xaggd"] and "root" not in d.get("Group", [])
    assert set(d["AmbientCapabilities"][0].split()) == set(caps.NEEDED)
    assert set(d["CapabilityBoundingSet"][0].split()) == set(caps.NEEDED)
    assert d["StateDirectory"] == ["xaggd"] and d["RuntimeDirectory"] == ["xaggd"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert d[key] == ["yes"], key
    assert d["ProtectSystem"] == ["strict"]
    assert all(doc.startswith("file:///usr/share/doc/xagg/") for doc in d["Documentation"])
    assert "docs/daemon.md" in UNIT.read_text() and (ROOT / "docs" / "daemon.md").is_file()


def test_the_units_command_lines_are_ones_xaggd_takes():
    """Parsed by xaggd's own CLI: jobs under the state dir, which systemd
    keeps; pid file and socket under the run dir, which it removes."""
    from xaggd.cli import main
    prefix, start = unit_command("ExecStart")
    assert prefix == "" and start[:2] == ["/usr/local/bin/xaggd", "start"]
    params = main.commands["start"].make_context("start", start[2:]).params
    assert params["run_dir"] == "/run/xaggd" and params["state_dir"] == "/var/lib/xaggd"
    # a program a killed daemon left is opened by id, which takes CAP_SYS_ADMIN: "+" runs it as root
    prefix, stop = unit_command("ExecStopPost")
    assert prefix == "+" and stop[:2] == ["/usr/local/bin/xaggd", "cleanup"]
    assert main.commands["cleanup"].make_context("cleanup", stop[2:]).params["run_dir"] == "/run/xaggd"


# -- what the daemon needs -------------------------------------------------------
def mask(*names) -> int:
    return sum(1 << getattr(caps, n) for n in names)


@pytest.mark.parametrize("have, lack, netns", [
    (("CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"), [], False),
    (("CAP_BPF", "CAP_NET_ADMIN"), ["CAP_PERFMON"], False),
    (("CAP_NET_ADMIN", "CAP_PERFMON"), ["CAP_BPF"], False),
    (("CAP_SYS_ADMIN", "CAP_NET_ADMIN"), [], False),
    (("CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"), ["CAP_SYS_ADMIN"], True),
    ((), ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"], False),
])
def test_the_capabilities_xdp_needs(have, lack, netns):
    assert caps.missing(mask(*have), netns=netns) == lack


def test_preflight_names_the_missing_capabilities(monkeypatch):
    from xaggd.dataplane import program
    monkeypatch.setattr(caps, "effective", lambda: mask("CAP_BPF", "CAP_NET_ADMIN"))
    with pytest.raises(LoaderError, match=r"XDP needs CAP_PERFMON, which this process lacks: run it as root, "
                                          r"give its user these capabilities"):
        program.preflight()


def test_notify_sends_one_datagram_and_nothing_without_a_socket(tmp_path, monkeypatch):
    from xaggd.sdnotify import notify
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(tmp_path / "n"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n"))
        assert notify("READY=1") is True
        assert s.recv(4096) == b"READY=1"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(f"\0{TAG}-notify")
        monkeypatch.setenv("NOTIFY_SOCKET", f"@{TAG}-notify")
        assert notify("STOPPING=1") is True
        assert s.recv(4096) == b"STOPPING=1"


# -- the daemon as the unit runs it, without systemd -------------------------------
def hidden_from(paths) -> dict[str, set[str]]:
    """Directories on the way to ``paths`` that a user other than root
    cannot enter (mode without o+x: /root, where pyenv puts the
    interpreter), each with the entries below it that the paths go through."""
    blocked: dict[str, set[str]] = {}
    for p in paths:
        parts = Path(p).resolve().parts
        for i in range(1, len(parts) - 1):
            d = Path(*parts[:i + 1])
            if not os.stat(d).st_mode & stat.S_IXOTH:
                blocked.setdefault(str(d), set()).add(parts[i + 1])
                break
    return blocked


def as_service_user(argv: list[str], stage: Path) -> list[str]:
    """``argv`` run inside the lab namespace as nobody with exactly the unit's
    ambient capabilities. Directories root keeps to itself are shown to it
    in a private mount namespace (a tmpfs over each, with the entries it
    needs bound back read-only), as an installed xaggd would not need."""
    cap_list = ",".join("+" + c[len("CAP_"):].lower() for c in caps.NEEDED)
    mounts = []
    for i, (d, entries) in enumerate(hidden_from([sys.executable, ROOT, sys.prefix]).items()):
        for j, e in enumerate(sorted(entries)):
            mounts.append(f"mkdir -p {stage}/{i}-{j} && mount --bind {shlex.quote(d)}/{e} {stage}/{i}-{j}")
        mounts.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(d)}")
        for j, e in enumerate(sorted(entries)):
            mounts.append(f"mkdir {shlex.quote(d)}/{e} && mount --bind -o ro {stage}/{i}-{j} {shlex.quote(d)}/{e}")
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            f"--inh-caps=-all,{cap_list}", f"--ambient-caps=-all,{cap_list}", f"--bounding-set=-all,{cap_list}"]
    script = " && ".join([*mounts, "exec " + shlex.join(drop + argv)])
    return ["ip", "netns", "exec", NS, "unshare", "--mount", "sh", "-c", script]


def own_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)
    return path


def status_of(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line)


def test_xaggd_as_the_unit_runs_it_without_root():
    base = Path(tempfile.mkdtemp(prefix="xagg-svc-", dir="/tmp"))
    base.chmod(0o755)
    run, state, stage = own_dir(base / "run"), own_dir(base / "state"), base / "stage"
    args = ["--iface", IFACE, "--name", TAG, "--memory", "8M"]
    start = as_service_user([str(XAGGD), "start", *args, "--run-dir", str(run), "--state-dir", str(state)], stage)
    cleanup = [str(XAGGD), "cleanup", *args[:4], "--run-dir", str(run)]    # ExecStopPost=+: as root
    notify_path = base / "notify"
    log = open(base / "log", "w")

    def started(notes):
        p = subprocess.Popen(start, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "NOTIFY_SOCKET": str(notify_path)})
        try:
            notes.settimeout(READY_S)
            assert notes.recv(4096) == b"READY=1", (base / "log").read_text()[-3000:]
        except BaseException:
            p.kill()
            p.wait()
            raise
        return p

    try:
        with veth_pair((NS, IFACE, "10.97.0.1"), (PEER_NS, "sv1", "10.97.0.2")), \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notes:
            notes.bind(str(notify_path))
            notify_path.chmod(0o666)
            p = started(notes)
            try:
                # ready means attached: already so when READY=1 arrived
                assert xdp_attached(IFACE, NS) == "xdp"
                proc = status_of(p.pid)
                assert proc["Uid"].split()[:2] == [str(NOBODY)] * 2
                assert int(proc["CapEff"], 16) == mask(*caps.NEEDED)
                with ControlClient(str(run / f"{TAG}.sock")) as c:
                    assert c.status()["attached"] is True
                    c.register(71, cookie=5, max_elements=4096, n_workers=2)
                p.send_signal(signal.SIGTERM)
                assert p.wait(60) == 0, (base / "log").read_text()[-3000:]
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            assert notes.recv(4096) == b"STOPPING=1"
            assert xdp_attached(IFACE, NS) is None
            assert (state / f"{TAG}.jobs.json").is_file() and not (run / f"{TAG}.jobs.json").exists()

            shutil.rmtree(run)                    # what RuntimeDirectory= does on stop
            own_dir(run)
            p = started(notes)
            try:
                with ControlClient(str(run / f"{TAG}.sock")) as c:
                    assert [j["job_id"] for j in c.list_jobs()] == [71]
                p.kill()                          # no detach: ExecStopPost's work
                p.wait()
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            assert xdp_attached(IFACE, NS) == "xdp"
            r = subprocess.run(start, capture_output=True, text=True, timeout=120)
            assert r.returncode == 1 and "whose name this process may not read (that takes CAP_SYS_ADMIN)" \
                in r.stderr and f"`sudo xaggd cleanup --iface {IFACE}`" in r.stderr, r.stderr
            r = subprocess.run(["ip", "netns", "exec", NS, *cleanup], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            assert xdp_attached(IFACE, NS) is None, r.stdout + r.stderr
    finally:
        log.close()
        shutil.rmtree(base, ignore_errors=True)
