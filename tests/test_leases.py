"""Job leases: a job with neither packets nor requests from its registrant
for ``job_lease`` is removed, and its slots go back to the pool.

No clocks: the lease check takes the clock value it runs at, and the data
plane's packet counters are read at each check; the real daemons' tests
call the check themselves, or wait (bounded) for a state.
"""
from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from xagg.wire.control import ControlClient, ControlError
from xagg.wire.proto import C, make_packets
from xaggd import report
from xaggd.backends import Backend
from xaggd.config import Config
from xaggd.control_server import Dispatcher
from xaggd.job_request import RequestError
from xaggd.jobs import JobTable
from xaggd.lease import IDLE_AFTER_S, Activity, check_every, expired
from xaggd.settings import parse_duration

XAGGD = [sys.executable, "-m", "xaggd.cli"]
LEASE = 600.0


# -- the rule ---------------------------------------------------------------------
def test_activity_moves_with_requests_and_with_any_change_of_the_counters():
    a = Activity(at=100.0)
    assert a.idle_s(160.0) == 60.0
    assert a.observe(0, 160.0) == a                   # counters where they were: no sign of life
    b = a.observe(5, 160.0)
    assert (b.at, b.packets) == (160.0, 5)
    assert b.observe(0, 200.0).at == 200.0            # cleared (a reset): changed, alive
    assert b.seen(170.0) == Activity(at=170.0, packets=5)
    assert b.seen(150.0) == b                         # a request never moves it back
    assert expired({1: 600.0, 2: 599.9, 3: 10_000.0}, 600.0) == [1, 3]
    assert expired({1: 10_000.0}, 0) == []            # 0: never
    assert check_every(0) is None and check_every(8.0) == 2.0 and check_every(3600.0) == 5.0


def test_the_lease_is_a_setting_with_a_duration():
    assert parse_duration("10m") == 600 and parse_duration("90s") == 90 and parse_duration("1.5h") == 5400
    assert parse_duration(0) == 0 and parse_duration("30") == 30
    assert Config.resolve({"userspace": True}, env={}).job_lease == 600
    cfg = Config.resolve({"userspace": True}, env={"XAGGD_JOB_LEASE": "2h"})
    assert cfg.job_lease == 7200 and cfg.source("job_lease") == "env XAGGD_JOB_LEASE"
    with pytest.raises(ValueError, match=r"job_lease='soon' \(from --job-lease\): expected a duration"):
        Config.resolve({"userspace": True, "job_lease": "soon"}, env={})
    r = subprocess.run(XAGGD + ["start", "--help"], capture_output=True, text=True)
    assert "--job-lease DURATION" in r.stdout and "[default: 10m]" in r.stdout


# -- the job table, against counters and a clock the test holds ------------------------
class CountingBackend(Backend):
    """Per-job packet counters the test sets: what XDP's job_stats holds."""
    kind = "fake"

    def __init__(self):
        self.packets = {}

    def set_job(self, spec, *, slot_base, job_index):
        if not spec.is_child:
            self.packets[spec.job_id] = 0       # an install starts the job's counters at 0

    def remove_job(self, job_id, agg=C.XAGG_AGG_MAIN):
        self.packets.pop(job_id, None)

    def job_stats(self, job_id, job_index, agg=C.XAGG_AGG_MAIN):
        return {"aggregated": self.packets.get(job_id, 0), "completed": 0, "retransmits": 0, "dropped": 0}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lease_table():
    saved = []
    clock = Clock()
    t = JobTable(CountingBackend(), max_slots=1000, max_jobs=4, max_workers=8, vals=256, slot_bytes=1048,
                 on_change=saved.append, clock=clock)
    return t, clock, saved


def reg(job_id, **kw):
    return {"job_id": job_id, "cookie": 1, "max_elements": 2000, "n_workers": 2, **kw}


def test_a_job_without_packets_or_requests_is_removed_after_its_lease(caplog):
    t, clock, saved = lease_table()
    t.register(reg(1))
    t.register(reg(2))
    used = t.memory()["used_slots"]
    clock.now += 500
    t.backend.packets[1] += 40                     # job 1's workers send
    assert t.expire(LEASE) == []                   # nobody is past the lease yet
    clock.now += 200                               # job 2: 700 s without a sign of life
    with caplog.at_level(logging.WARNING, logger="xaggd.jobs"):
        gone = t.expire(LEASE)
    assert [j.job_id for j in gone] == [2] and sorted(t.jobs) == [1]
    assert t.memory()["used_slots"] == used - gone[0].n_slots
    assert [r["job_id"] for r in saved[-1]] == [1]          # the saved list forgets it too
    msg = caplog.records[-1].getMessage()
    assert msg.startswith("removed job 2: neither packets nor requests") and "job_lease 600s" in msg
    clock.now += LEASE                             # job 1: no packet since its last
    assert [j.job_id for j in t.expire(LEASE)] == [1] and t.jobs == {}


def test_requests_from_the_registrant_renew_the_lease():
    t, clock, _ = lease_table()
    t.register(reg(1, job_token="t" * 20))
    t.register(reg(2))
    t.register(reg(3))
    t.register(reg(4))
    clock.now += LEASE - 1
    t.keepalive(1, admin=False, token="t" * 20)
    t.reset(2)
    t.register(reg(3))                              # the same again: a no-op, but a sign of life
    with pytest.raises(RequestError, match="job_token: job 4 belongs to another registrant"):
        t.keepalive(4, admin=False, token="u" * 20)    # only its registrant (or the admin) may
    clock.now += 2
    assert [j.job_id for j in t.expire(LEASE)] == [4]
    assert t.idle() == {1: 2.0, 2: 2.0, 3: 2.0}
    t.resize({"job_id": 1, "max_elements": 4000})
    assert t.idle()[1] == 0.0
    assert t.expire(0, now=clock.now + 10 * LEASE) == []   # lease 0: jobs stay until removed


def test_restored_jobs_get_a_fresh_lease():
    t, clock, saved = lease_table()
    t.register(reg(1))
    records = saved[-1]
    clock.now += 10 * LEASE
    t2 = JobTable(CountingBackend(), max_slots=1000, max_jobs=4, max_workers=8, vals=256, slot_bytes=1048,
                  clock=clock)
    t2.restore(records)
    assert t2.idle() == {1: 0.0} and t2.expire(LEASE) == []


def test_status_reports_each_jobs_idle_time_and_the_slots_idle_jobs_hold():
    t, clock, _ = lease_table()
    t.register(reg(1))
    t.register(reg(2))
    clock.now += IDLE_AFTER_S + 30
    t.backend.packets[1] = 7
    jobs = t.list()
    assert {j["job_id"]: j["idle_s"] for j in jobs} == {1: 0.0, 2: IDLE_AFTER_S + 30}
    idle = t.idle_report({j["job_id"]: j["idle_s"] for j in jobs})
    assert idle == {"after_s": IDLE_AFTER_S, "jobs": [2], "slots": t.jobs[2].n_slots}
    st = {"name": "xaggd", "pid": 1, "uptime_s": 5, "backend": "userspace", "bind": "127.0.0.1", "port": 9977,
          "vals": 256, "memory": t.memory(), "control": "/run/xaggd/xaggd.sock", "lease_s": LEASE, "idle": idle,
          "jobs": jobs}
    text = report.status_text(st)
    assert f"job lease 10m0s; {idle['slots']} slots held by 1 job(s) idle over 1m0s: 2" in text
    assert "IDLE" in text and "1m30s" in text
    assert "no job lease" in report.status_text({**st, "lease_s": 0, "idle": {"jobs": []}})


def test_keepalive_over_the_control_protocol():
    class Daemon:
        def __init__(self):
            self.jobs, self.clock, _ = lease_table()
            self.backend = self
            self.config = Config.resolve({"userspace": True, "job_lease": "5m"}, env={}, for_start=False)

        def describe(self):
            return {"port": 9977}

        def check_health(self):
            return None

    d = Dispatcher(Daemon())
    from xaggd.auth import ADMIN, CLIENT, Session
    admin, client = Session(ADMIN, "test"), Session(CLIENT, "tcp test")
    r = d.handle_line(b'{"op": "register", "job_id": 5, "cookie": 1, "max_elements": 100, "n_workers": 2}', client)
    assert r["ok"] and r["lease_s"] == 300
    token = r["job_token"]
    assert d.handle_line(b'{"op": "keepalive", "job_id": 5}', client)["error"].startswith("job_token: job 5")
    line = f'{{"op": "keepalive", "job_id": 5, "job_token": "{token}"}}'.encode()
    assert d.handle_line(line, client) == {"ok": True, "job_id": 5, "lease_s": 300}
    assert d.handle_line(b'{"op": "keepalive", "job_id": 6}', admin)["error"].startswith("job_id: no job 6")
    assert d.handle_line(b'{"op": "keepalive"}', admin)["error"] == "job_id: missing (required by keepalive)"


def test_packets_through_the_xdp_program_count_as_activity(xdp_program):
    """The counters the lease check reads on XDP: the program's per-job
    job_stats, which it keeps anyway; nothing is added per packet."""
    from types import SimpleNamespace

    from xaggd.backends import XdpBackend
    from xaggd.dataplane.frames import udp_frame
    from xagg.wire.syscalls import prog_test_run
    backend = XdpBackend(SimpleNamespace())
    backend.prog = xdp_program
    clock = Clock()
    t = JobTable(backend, max_slots=xdp_program.config.max_slots, max_jobs=xdp_program.config.max_jobs,
                 max_workers=8, vals=xdp_program.config.vals, slot_bytes=1, clock=clock)
    try:
        for j in (9101, 9102):
            t.register(reg(j, cookie=77, max_elements=4 * xdp_program.config.vals, fanout="bcast"))
        clock.now += LEASE
        payload = make_packets(job_id=9101, cookie=77, worker_id=0, round_=0, chunks=np.array([0]),
                               values=np.ones((1, xdp_program.config.vals), np.int32)).tobytes()
        prog_test_run(xdp_program.xdp_fn.fd, udp_frame(payload, dport=xdp_program.config.port))
        assert backend.job_stats(9101, t.jobs[9101].job_index)["aggregated"] == 1
        assert [j.job_id for j in t.expire(LEASE)] == [9102] and sorted(t.jobs) == [9101]
    finally:
        for j in list(t.jobs):
            t.remove(j)


# -- a real daemon (userspace data plane) in this process: the check called here ------
@pytest.fixture
def daemon(tmp_path):
    from xaggd.server import Server
    cfg = Config.resolve({"userspace": True, "bind": "127.0.0.1", "port": 0, "vals": 256, "memory": "1M",
                          "name": "lease", "run_dir": str(tmp_path / "run")}, env={})
    server = Server(cfg)
    t = threading.Thread(target=server.run, name="xaggd-under-test", daemon=True)
    t.start()
    assert server.started.wait(60) and server.jobs is not None
    try:
        yield server
    finally:
        server.stop()
        t.join(30)


def send_round(port, job_id, cookie, workers, round_=0):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for w in workers:
            s.sendto(make_packets(job_id=job_id, cookie=cookie, worker_id=w, round_=round_, chunks=np.array([0]),
                                  values=np.ones((1, 256), np.int32)).tobytes(), ("127.0.0.1", port))


def test_the_daemon_keeps_jobs_with_packets_or_keepalives_and_removes_the_rest(daemon, caplog):
    """The daemon's own lease checks run on its schedule with the test's
    clock too, so what is asserted is the state after a check, whoever ran it."""
    clock = daemon.jobs.clock = Clock()
    lease = daemon.config.job_lease
    with ControlClient(daemon.config.control) as c:
        for j in (11, 12, 13):
            c.register(j, cookie=j, max_elements=512, n_workers=2)
        st = c.status()
        clock.now += lease - 1
        send_round(st["port"], 11, 11, workers=[0])      # job 11: its workers send
        deadline = time.monotonic() + 30
        while c.stats(11)["jobs"]["11"]["aggregated"] < 1:
            assert time.monotonic() < deadline, "the packet never reached the aggregator"
            time.sleep(0.02)
        c.keepalive(12)                                  # job 12: its registrant is there
        clock.now += 2                                   # job 13: a lease and a second without either
        with caplog.at_level(logging.WARNING, logger="xaggd.jobs"):
            daemon.check_leases()
        assert sorted(j["job_id"] for j in c.list_jobs()) == [11, 12]
        assert "removed job 13: neither packets nor requests" in caplog.text
        assert c.status()["memory"]["free_slots"] > st["memory"]["free_slots"]
        clock.now += lease                               # a lease with neither: both go
        daemon.check_leases()
        assert c.list_jobs() == [] and c.status()["memory"]["used_slots"] == 0
        with pytest.raises(ControlError, match="job_id: no job 11"):
            c.keepalive(11)


# -- the daemon as users start it: a short lease, and a bounded wait for the job to go ----
def test_xaggd_with_a_short_lease_removes_an_abandoned_job(tmp_path):
    run = tmp_path / "run"
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(XAGGD + ["start", "--userspace", "--bind", "127.0.0.1", "--port", "0", "--memory", "1M",
                                      "--job-lease", "1s", "--name", "short", "--run-dir", str(run)],
                             stdout=log, stderr=log)
    try:
        with ControlClient(str(run / "short.sock")) as c:
            c.wait_ready(timeout=60)
            c.register(21, cookie=3, max_elements=512, n_workers=2)       # and then its owner is gone
            deadline = time.monotonic() + 60
            while c.list_jobs():
                assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
            assert c.status()["memory"]["used_slots"] == 0
        assert "removed job 21: neither packets nor requests from its registrant" in log_path.read_text()
        assert '"jobs": []' in (run / "short.jobs.json").read_text()     # gone after a restart too
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
