"""xaggd without a kernel: configuration layers and errors, the slot
allocator, the job table against a recording backend, the control
dispatcher. Fast; the real daemon is tested in test_daemon.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xagg.wire import chunks
from xagg.wire.control import ControlClient, ControlError, parse_address
from xagg.wire.fanout import Fanout
from xagg.wire.proto import C
from xaggd.config import Config, ConfigError
from xaggd.settings import parse_size
from xaggd.control_server import Dispatcher
from xaggd.backends import Backend
from xaggd.job_request import NoRoom, RequestError
from xaggd.jobs import JobTable
from xaggd.placement import SlotAllocator

XAGGD = [sys.executable, "-m", "xaggd.cli"]


# -- configuration ------------------------------------------------------------------
def write(tmp_path, text, name="xaggd.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    f = write(tmp_path, 'iface = "file0"\nport = 1111\nmax_jobs = 3\nmode = "generic"\n')
    env = {"XAGGD_PORT": "2222", "XAGGD_MAX_JOBS": "5"}
    cfg = Config.resolve({"max_jobs": 7}, env=env, file=f)
    assert cfg.iface == "file0" and cfg.mode == "generic"          # file over defaults
    assert cfg.port == 2222                                          # env over file
    assert cfg.max_jobs == 7                                         # flag over env
    assert cfg.vals == 256 and cfg.name == "xaggd"                   # defaults
    assert cfg.source("port") == "env XAGGD_PORT" and cfg.source("max_jobs") == "--max-jobs"
    # XAGGD_CONFIG names the file when no --config is given
    assert Config.resolve({}, env={"XAGGD_CONFIG": f}).iface == "file0"


def test_memory_sizes_slots_and_the_higher_layer_wins(tmp_path):
    cfg = Config.resolve({"iface": "x", "memory": "1M"}, env={})
    # lock, gen, round, done, count, pad; the contributor set; the values
    assert cfg.max_slots == (1 << 20) // cfg.slot_bytes and \
        cfg.slot_bytes == 24 + 8 * (C.XAGG_SET_WORDS + 1) + 4 * 256
    assert Config.resolve({"iface": "x"}, env={}).max_slots == (256 << 20) // cfg.slot_bytes
    f = write(tmp_path, "max_slots = 100\n")
    assert Config.resolve({"iface": "x", "memory": "1M"}, env={}, file=f).max_slots == cfg.max_slots
    assert Config.resolve({"iface": "x"}, env={"XAGGD_MEMORY": "1M"}, file=f).max_slots == cfg.max_slots
    assert Config.resolve({"iface": "x", "max_slots": 50}, env={"XAGGD_MEMORY": "1M"}).max_slots == 50
    with pytest.raises(ConfigError, match="memory .* and max_slots .* give one"):
        Config.resolve({"iface": "x", "memory": "1M", "max_slots": 10}, env={})
    assert parse_size("512KiB") == 512 << 10 and parse_size("1g") == 1 << 30 and parse_size(4096) == 4096


@pytest.mark.parametrize("flags,env,toml,match", [
    ({"iface": "x", "port": 70000}, {}, None, r"port=70000 \(from --port\): must be a UDP port"),
    ({"iface": "x"}, {"XAGGD_MEMORY": "12Q"}, None, r"memory='12Q' \(from env XAGGD_MEMORY\): expected a size"),
    ({"iface": "x"}, {"XAGGD_PROT": "1"}, None, r"unknown environment variable XAGGD_PROT \(did you mean 'port'"),
    ({}, {}, 'ifcae = "eth0"\n', r"unknown field 'ifcae' \(did you mean 'iface'"),
    ({}, {}, 'iface = "eth0"\nport = "many"\n', r"port='many' \(from .*xaggd.toml: port\): expected an integer"),
    ({}, {}, "iface = \n", r"is not valid TOML"),
    ({}, {}, 'iface = "eth0"\nuserspace = "maybe"\n', r"userspace='maybe'.*expected true or false"),
    ({}, {}, None, r"iface=None .*required: the interface to attach to"),
    ({"iface": "x", "mode": "fast"}, {}, None, r"mode='fast'.*auto, driver, generic"),
    ({"iface": "x", "lock": "maybe"}, {}, None, r"lock='maybe'.*auto, on, off"),
    ({"iface": "x", "vals": 4000}, {}, None, r"vals=4000.*interface's MTU"),
    ({"iface": "x", "max_workers": 1025}, {}, None, r"max_workers=1025.*1024"),
    ({"iface": "x", "listen": "0.0.0.0:9979"}, {}, None, r"listen=.*needs a shared token: add --token-file"),
    ({"iface": "x", "listen": "nohost:9"}, {}, None, r"listen=.*not an IP address"),
    ({"iface": "x", "memory": "1K"}, {}, None, r"memory=1024.*at least 2 slots"),
    ({"iface": "x", "control": "rel/x.sock"}, {}, None, r"control=.*absolute path"),
])
def test_bad_config_names_field_source_and_reason(tmp_path, flags, env, toml, match):
    f = write(tmp_path, toml) if toml is not None else None
    with pytest.raises(ConfigError, match=match):
        Config.resolve(flags, env=env, file=f)


@pytest.mark.parametrize("setting,queues,mode,lock,why", [
    ("auto", 1, "auto", False, "one RX queue in driver mode"),
    ("auto", 1, "driver", False, "one RX queue"),
    ("auto", 2, "auto", True, "2 RX queues"),
    ("auto", 1, "generic", True, "generic mode runs XDP on any CPU"),
    ("on", 1, "driver", True, "--lock on"),
    ("off", 8, "auto", False, "safe only with one RX queue"),
])
def test_the_slot_lock_is_left_out_only_where_one_cpu_runs_xdp_at_a_time(setting, queues, mode, lock, why):
    from xaggd.backends import slot_lock
    got, reason = slot_lock(setting, queues, mode)
    assert got is lock and why in reason


def test_token_file_is_checked(tmp_path):
    short = write(tmp_path, "abc\n", "short")
    with pytest.raises(ConfigError, match="token_file=.*3 characters; use at least 16"):
        Config.resolve({"iface": "x", "listen": "127.0.0.1:0", "token_file": short}, env={})
    with pytest.raises(ConfigError, match="token_file=.*cannot read it"):
        Config.resolve({"iface": "x", "listen": "127.0.0.1:0", "token_file": str(tmp_path / "nope")}, env={})
    good = write(tmp_path, "0123456789abcdef0123\n", "good")
    cfg = Config.resolve({"iface": "x", "listen": "127.0.0.1:0", "token_file": good}, env={})
    assert cfg.read_token() == "0123456789abcdef0123"


def test_cli_reports_bad_config_with_exit_2(tmp_path):
    f = write(tmp_path, 'iface = "eth0"\nmemroy = "1G"\n')
    r = subprocess.run(XAGGD + ["start", "--config", f], capture_output=True, text=True)
    assert r.returncode == 2
    assert "unknown field 'memroy' (did you mean 'memory'?)" in r.stderr
    r = subprocess.run(XAGGD + ["start", "--iface", "x", "--max-jobs", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "max_jobs=0 (from --max-jobs): must be 1..4096" in r.stderr


def test_without_root_xdp_refuses_and_points_at_userspace(tmp_path):
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + XAGGD
                       + ["start", "--iface", "lo", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, cwd="/")
    assert r.returncode == 1
    assert "XDP needs CAP_BPF + CAP_PERFMON + CAP_NET_ADMIN, which this process lacks" in r.stderr
    assert "--userspace" in r.stderr


def test_help_teaches_with_examples():
    r = subprocess.run(XAGGD + ["--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "sudo xaggd start --iface eth0" in r.stdout and "ControlClient" in r.stdout
    for cmd in ("start", "stop", "status", "stats", "cleanup"):
        r = subprocess.run(XAGGD + [cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "Examples:" in r.stdout, cmd


# -- allocation and the job table ---------------------------------------------------
def test_slot_allocator_is_first_fit():
    a = SlotAllocator(100)
    assert [a.alloc(30), a.alloc(30), a.alloc(30)] == [0, 30, 60]
    assert a.alloc(20) is None and a.free_total == 10
    a.free(30)
    assert a.largest_free == 30 and a.alloc(10) == 30 and a.alloc(25) is None and a.alloc(20) == 40
    a.free(0)
    assert a.alloc(30, at=0) == 0 and a.alloc(10, at=92) is None and a.alloc(5, at=95) == 95


class RecordingBackend(Backend):
    kind = "fake"

    def __init__(self):
        self.installed = {}           # job_id -> (spec, slot_base, job_index)
        self.calls = []

    def set_job(self, spec, *, slot_base, job_index):
        self.calls.append(("set", spec.job_id))
        self.installed[spec.job_id] = (spec, slot_base, job_index)

    def remove_job(self, job_id):
        self.calls.append(("remove", job_id))
        self.installed.pop(job_id, None)

    def job_stats(self, job_id, job_index):
        return {"aggregated": 3, "completed": 1, "retransmits": 0, "dropped": 0}


def table(max_slots=1000, max_jobs=4):
    b = RecordingBackend()
    return JobTable(b, max_slots=max_slots, max_jobs=max_jobs, max_workers=8, vals=256,
                    slot_bytes=1048), b


def reg(job_id, elements, **kw):
    return {"op": "register", "job_id": job_id, "cookie": 1, "max_elements": elements,
            "n_workers": 2, **kw}


def test_register_computes_this_aggregators_share_with_plan_capacity():
    t, b = table()
    aggs = [{"addr": "10.0.0.101:9977", "weight": 2.0}, {"addr": "10.0.0.102:9977", "weight": 1.0}]
    for k in (0, 1):
        job, created = t.register(reg(10 + k, 100_000, aggregators=aggs, agg_index=k))
        assert created and job.n_chunks == chunks.capacity(100_000, 256, [2.0, 1.0])[k]
        spec, base, _ = b.installed[10 + k]
        assert spec.n_chunks == job.n_chunks and base == job.slot_base
    with pytest.raises(RequestError, match=r"agg_index: 2 is not an index into aggregators \(0..1\)"):
        t.register(reg(12, 100, aggregators=aggs, agg_index=2))
    with pytest.raises(RequestError, match=r"aggregators\[1\].weight: this aggregator's share .* is empty"):
        t.register(reg(12, 100, aggregators=[{"addr": "a"}, {"addr": "b", "weight": 0}], agg_index=1))


def test_unicast_is_refused_where_the_driver_has_no_xdp_metadata():
    """Unicast results reach tc through XDP metadata: on a NIC without it every
    completion would be dropped (issue 13, item 11). Broadcast still works."""
    t, b = table()
    b.unicast_problem = lambda: "eth9: the driver has no XDP metadata"
    with pytest.raises(RequestError, match=r"^fanout: unicast fan-out cannot work here: eth9: the driver"):
        t.register(reg(20, 1000))
    assert 20 not in b.installed
    job, created = t.register(reg(21, 1000, fanout="bcast"))
    assert created and job.fanout is Fanout.BCAST


def test_xdp_backend_names_the_metadata_problem(tmp_path):
    from xaggd.backends import XdpBackend
    cfg = Config(iface="eth9", xdp_meta=False)
    problem = XdpBackend(cfg).unicast_problem()
    assert "eth9" in problem and "xdp_meta" in problem and "bcast" in problem
    assert XdpBackend(Config(iface="eth9")).unicast_problem() is None     # nothing attached yet
    r = subprocess.run(XAGGD + ["start", "--help"], capture_output=True, text=True)
    assert "--no-xdp-meta" in r.stdout


def test_reregister_same_is_noop_other_needs_replace_and_restores_on_failure():
    t, b = table(max_slots=100)
    job, created = t.register(reg(1, 256 * 10))
    again, created2 = t.register(reg(1, 256 * 10))
    assert created and not created2 and again is job and b.calls == [("set", 1)]
    with pytest.raises(RequestError, match="already registered with other parameters.*replace: true"):
        t.register(reg(1, 256 * 20))
    new, _ = t.register(reg(1, 256 * 20, replace=True))
    assert new.n_chunks == 21 and b.installed[1][0].n_chunks == 21
    with pytest.raises(NoRoom):
        t.register(reg(1, 256 * 200, replace=True))
    assert t.jobs[1] is new and b.installed[1][0].n_chunks == 21 and t.memory()["used_slots"] == 42


def test_no_room_says_how_much_is_free_and_fragmentation():
    t, _ = table(max_slots=100)
    a, _ = t.register(reg(1, 256 * 20))     # 21 chunks -> 42 slots
    t.register(reg(2, 256 * 2))             # 3 chunks -> 6 slots
    t.register(reg(3, 256 * 20))            # 42 slots
    t.remove(1)
    t.remove(3)
    # 94 free, but in blocks of 42 and 52
    with pytest.raises(NoRoom, match=r"needs 60 slots .* but 94 slots \(.*\) are free of 100, the largest "
                                     r"contiguous block being 52 slots; remove a job"):
        t.register(reg(4, 256 * 29))
    with pytest.raises(NoRoom, match=r"needs 204 slots .* but 94 slots .* are free"):
        t.register(reg(4, 256 * 100))


def test_job_indexes_run_out_then_are_reused():
    t, b = table(max_jobs=2)
    t.register(reg(1, 10))
    t.register(reg(2, 10))
    with pytest.raises(NoRoom, match="all 2 job places are in use"):
        t.register(reg(3, 10))
    t.remove(1)
    job, _ = t.register(reg(3, 10))
    assert job.job_index == 0 and b.installed[3][2] == 0


def test_resize_keeps_index_and_base_when_it_can_and_reset_reinstalls():
    t, b = table(max_slots=100)
    j1, _ = t.register(reg(1, 256 * 5))         # 12 slots at 0
    j2, _ = t.register(reg(2, 256 * 5))         # 12 slots at 12
    small = t.resize({"job_id": 1, "max_elements": 256 * 2})
    assert small.slot_base == 0 and small.n_chunks == 3 and small.job_index == j1.job_index
    moved = t.resize({"job_id": 1, "max_elements": 256 * 20})     # does not fit below job 2
    assert moved.slot_base == 24 and t.memory()["used_slots"] == 12 + 42
    with pytest.raises(NoRoom):
        t.resize({"job_id": 1, "max_elements": 256 * 100})
    assert t.jobs[1] is moved and t.memory()["used_slots"] == 54
    n = len(b.calls)
    assert t.reset(2).resets == 1 and b.calls[n:] == [("set", 2)]
    with pytest.raises(RequestError, match=r"job_id: no job 9 on this aggregator \(registered: 1, 2\)"):
        t.reset(9)


# -- the dispatcher: one request line -> one response --------------------------------
class FakeDaemon:
    def __init__(self):
        self.jobs, self.backend_rec = table()
        self.backend = self
        self.config = Config.resolve({"userspace": True}, env={}, for_start=False)

    def describe(self):
        return {"port": 9977}

    def check_health(self):
        return None

    def status(self):
        return {"name": "fake"}

    def stats(self, job_id=None):
        return {"jobs": self.jobs.stats(job_id)}


@pytest.mark.parametrize("line,error", [
    (b"{not json", "request: not valid JSON"),
    (b"[1, 2]", "request: must be a JSON object, got list"),
    (b'{"job_id": 1}', "op: missing"),
    (b'{"op": "explode"}', "op: unknown op 'explode'"),
    (b'{"op": "register", "cookie": 1, "max_elements": 5, "n_workers": 1}', "job_id: missing"),
    (b'{"op": "register", "job_id": -1, "cookie": 1, "max_elements": 5, "n_workers": 1}',
     "job_id: must be an unsigned 32-bit integer"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 0, "n_workers": 1}',
     "max_elements: must be a positive integer"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 99}',
     "n_workers: 99 workers, this aggregator takes at most 8"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "workers": ["10.0.0.1", 7]}',
     "workers[1]: must be an IPv4 address string"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 1, "fanout": "x"}',
     "fanout: must be one of bcast, unicast"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 1, "bcast_ip": "x"}',
     "bcast_ip: not an IPv4 address"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 1, "result_port": 0}',
     "result_port: must be a UDP port"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 1, "vals": 128}',
     "vals: this aggregator runs 256 values per packet"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 1, "colour": 1}',
     "colour: unknown field for register"),
    (b'{"op": "register", "job_id": 1, "cookie": 1, "max_elements": 5, "n_workers": 1, '
     b'"aggregators": [{"addr": "a", "weight": -1}]}', "aggregators[0].weight: must be a finite number >= 0"),
    (b'{"op": "remove", "job_id": 5}', "job_id: no job 5"),
    # the session is not over the Unix socket: no file descriptors for it
    (b'{"op": "dataplane", "addr": "10.0.0.1", "netns": 1}', "dataplane: only over the local Unix"),
    (b'{"op": "dataplane", "addr": "10.0.0.1"}', "netns: missing (required by dataplane)"),
    (b'{"op": "stats", "job_id": "x"}', "job_id: must be an unsigned 32-bit integer"),
])
def test_dispatcher_names_the_field(line, error):
    from xaggd.auth import ADMIN, Session
    resp = Dispatcher(FakeDaemon()).handle_line(line, Session(ADMIN, "test"))
    assert resp["ok"] is False and resp["error"].startswith(error), resp


def test_dispatcher_echoes_the_id_and_takes_no_token_in_requests():
    from xaggd.auth import ADMIN, Session
    d = Dispatcher(FakeDaemon())
    resp = d.handle_line(json.dumps({"op": "status", "id": 42}).encode(), Session(ADMIN, "t"))
    assert resp == {"ok": True, "name": "fake", "id": 42}
    resp = d.handle_line(json.dumps({"op": "status", "token": "x" * 20}).encode(), Session(ADMIN, "t"))
    assert resp["error"].startswith("token: unknown field for status")


def test_control_addresses():
    import socket
    assert parse_address("/run/xaggd/a.sock") == (socket.AF_UNIX, "/run/xaggd/a.sock")
    assert parse_address("unix:rel.sock") == (socket.AF_UNIX, "rel.sock")
    assert parse_address("10.0.0.1:9979") == (socket.AF_INET, ("10.0.0.1", 9979))
    assert parse_address("tcp:host:1") == (socket.AF_INET, ("host", 1))
    assert parse_address(("h", "2")) == (socket.AF_INET, ("h", 2))
    with pytest.raises(ValueError, match="socket path or HOST:PORT"):
        parse_address("justaname")
    assert repr(ControlClient("/x.sock")) == "ControlClient('/x.sock')"


# -- credentials: the admin token, the client token, each job's own token -----------
ADMIN_TOKEN, CLIENT_TOKEN = "admin-token-0123456789", "client-token-0123456789"


def sessions():
    from xaggd.auth import ADMIN, CLIENT, Session
    return Session(ADMIN, "tcp admin"), Session(CLIENT, "tcp alice"), Session(CLIENT, "tcp mallory")


def ask(d, session, **req):
    return d.handle_line(json.dumps(req).encode(), session)


def test_a_job_belongs_to_its_registrant_and_the_admin():
    d = Dispatcher(FakeDaemon())
    admin, alice, mallory = sessions()
    r = ask(d, alice, op="register", job_id=7, cookie=4242, max_elements=500, n_workers=2)
    assert r["ok"] and r["created"] and r["job"]["cookie"] == 4242
    tok = r["job_token"]
    assert isinstance(tok, str) and len(tok) >= 16
    # another client: no cookie, no token, nothing it may change
    listed = ask(d, mallory, op="list")["jobs"]
    assert [j["job_id"] for j in listed] == [7] and "cookie" not in listed[0] and "job_token" not in listed[0]
    for req in ({"op": "reset", "job_id": 7}, {"op": "remove", "job_id": 7},
                {"op": "resize", "job_id": 7, "max_elements": 9},
                {"op": "register", "job_id": 7, "cookie": 4242, "max_elements": 500, "n_workers": 2},
                {"op": "register", "job_id": 7, "cookie": 1, "max_elements": 500, "n_workers": 2,
                 "bcast_ip": "10.9.9.9", "replace": True},
                {"op": "reset", "job_id": 7, "job_token": "x" * 24}):
        resp = ask(d, mallory, **req)
        assert not resp["ok"] and resp["error"].startswith("job_token: job 7 belongs to another registrant"), req
        assert "4242" not in json.dumps(resp)
    assert d.daemon.jobs.jobs[7].cookie == 4242 and d.daemon.jobs.jobs[7].resets == 0
    # its registrant, with its token: everything
    again = ask(d, alice, op="register", job_id=7, cookie=4242, max_elements=500, n_workers=2, job_token=tok)
    assert again["ok"] and again["created"] is False and again["job_token"] == tok
    assert ask(d, alice, op="reset", job_id=7, job_token=tok)["job"]["resets"] == 1
    assert ask(d, alice, op="resize", job_id=7, max_elements=900, job_token=tok)["ok"]
    # the admin: every job, cookies included, no job token needed
    assert ask(d, admin, op="list")["jobs"][0]["cookie"] == 4242
    assert ask(d, admin, op="reset", job_id=7)["job"]["resets"] == 2
    assert ask(d, admin, op="remove", job_id=7)["ok"]
    assert ask(d, alice, op="list")["jobs"] == []


def test_a_registrant_may_bring_its_own_job_token_and_keeps_it_across_replace():
    d = Dispatcher(FakeDaemon())
    admin, alice, mallory = sessions()
    mine = "alice-job-token-0123456789"
    r = ask(d, alice, op="register", job_id=8, cookie=1, max_elements=500, n_workers=2, job_token=mine)
    assert r["job_token"] == mine
    assert ask(d, alice, op="register", job_id=8, cookie=2, max_elements=500, n_workers=2, job_token=mine,
               replace=True)["ok"]
    assert ask(d, admin, op="register", job_id=8, cookie=3, max_elements=500, n_workers=2, replace=True)["ok"]
    assert "job_token" not in ask(d, admin, op="list")["jobs"][0]
    assert ask(d, alice, op="remove", job_id=8, job_token=mine)["ok"]       # the admin kept alice's token
    resp = ask(d, alice, op="register", job_id=9, cookie=1, max_elements=5, n_workers=1, job_token="short")
    assert resp["error"].startswith("job_token: must be a string of 16 to 256")


def test_credentials_authenticate_the_first_line_before_any_json():
    from xaggd.auth import ADMIN, CLIENT, AuthError, Credentials
    creds = Credentials(ADMIN_TOKEN, CLIENT_TOKEN)
    assert creds.authenticate(f"AUTH {ADMIN_TOKEN}\n".encode()) == ADMIN
    assert creds.authenticate(f"AUTH {CLIENT_TOKEN}\r\n".encode()) == CLIENT
    for line, err in [(b"AUTH nope-nope-nope-nope\n", "auth: wrong token"),
                      (b'{"op": "list", "token": "%s"}\n' % ADMIN_TOKEN.encode(), "auth: the first line"),
                      (b"AUTH\n", "auth: the first line"), (b"\xff\xfe\n", "auth: the first line")]:
        with pytest.raises(AuthError, match=err):
            creds.authenticate(line)
    assert Credentials(ADMIN_TOKEN).authenticate(f"AUTH {ADMIN_TOKEN}\n".encode()) == ADMIN
    with pytest.raises(AuthError, match="wrong token"):
        Credentials(ADMIN_TOKEN).authenticate(f"AUTH {CLIENT_TOKEN}\n".encode())


def test_client_token_file_is_read_and_must_differ_from_the_admin_token(tmp_path):
    admin = write(tmp_path, ADMIN_TOKEN + "\n", "admin")
    client = write(tmp_path, CLIENT_TOKEN + "\n", "client")
    cfg = Config.resolve({"iface": "x", "listen": "127.0.0.1:0", "token_file": admin,
                          "client_token_file": client}, env={})
    assert (cfg.read_token(), cfg.read_client_token()) == (ADMIN_TOKEN, CLIENT_TOKEN)
    assert cfg.max_connections == 64
    with pytest.raises(ConfigError, match="client_token_file=.*the same token as token_file"):
        Config.resolve({"iface": "x", "listen": "127.0.0.1:0", "token_file": admin,
                        "client_token_file": admin}, env={})
    with pytest.raises(ConfigError, match="max_connections=0.*1..4096"):
        Config.resolve({"iface": "x", "max_connections": 0}, env={})


def test_the_client_cli_takes_no_token_on_the_command_line(tmp_path):
    """`ps` shows argv to everyone: tokens come from files or the environment."""
    from click.testing import CliRunner

    from xagg.torch.cli import main as client_main
    r = CliRunner().invoke(client_main, ["run", "-a", "127.0.0.1", "--control", "127.0.0.1:9979",
                                         "--token", ADMIN_TOKEN, "--", "x.py"])
    assert r.exit_code == 2 and "tokens are not taken on the command line" in r.output
    r = subprocess.run(XAGGD + ["status", "--help"], capture_output=True, text=True)
    assert "--token-file" in r.stdout and "--token " not in r.stdout


# -- the TCP control server: authenticate first, cap, rate-limited logs --------------
class _Server:
    """A TcpControlServer and a UnixControlServer over one FakeDaemon, in this process."""

    def __init__(self, tmp_path, **kw):
        from xaggd.auth import Credentials
        from xaggd.control_server import TcpControlServer, UnixControlServer
        d = Dispatcher(FakeDaemon())
        self.tcp = TcpControlServer(("127.0.0.1", 0), Credentials(ADMIN_TOKEN, CLIENT_TOKEN), d, **kw)
        self.unix = UnixControlServer(str(tmp_path / "ctl.sock"), d)
        self.tcp.serve_in_thread("test-tcp")
        self.unix.serve_in_thread("test-unix")
        self.port = self.tcp.server_address[1]

    def close(self):
        self.tcp.close_all()
        self.unix.close_all()


def _connect(port):
    import socket
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def test_tcp_control_authenticates_first_and_reads_little_before(tmp_path):
    srv = _Server(tmp_path, auth_timeout=1.0)
    try:
        with _connect(srv.port) as s:              # a big JSON line instead of AUTH: never parsed
            f = s.makefile("rb")
            try:
                s.sendall(b'{"op": "list", "pad": "' + b"x" * 200_000 + b'"}\n')
            except OSError:
                pass
            resp = json.loads(f.readline())
            assert resp["ok"] is False and resp["error"].startswith("auth: the first line")
            assert f.readline() == b""           # closed
        with _connect(srv.port) as s:              # silent: closed at the deadline
            f = s.makefile("rb")
            resp = json.loads(f.readline())
            assert resp["error"].startswith("auth: no AUTH line within 1s") and f.readline() == b""
        with ControlClient(f"127.0.0.1:{srv.port}", token=CLIENT_TOKEN) as c:
            r = c.register(5, cookie=1, max_elements=100, n_workers=1)
            assert "job_token" in r
            c.reset(5)                             # the client remembers its job's token
            assert "cookie" not in c.list_jobs()[0]
            c.remove(5)
        with ControlClient(f"127.0.0.1:{srv.port}", token="wrong-token-0123456789") as c:
            with pytest.raises(ControlError, match="auth: wrong token"):
                c.status()
    finally:
        srv.close()


def _until(cond, what):
    """Poll a state another thread changes (a liveness bound, not a timing)."""
    import time
    for _ in range(600):
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def _refusal(s) -> dict:
    """The one line a refused connection gets; the server then closes it."""
    s.settimeout(60)
    f = s.makefile("rb")
    resp = json.loads(f.readline())
    assert f.readline() == b""
    return resp


def test_tcp_control_caps_connections_and_the_unix_socket_still_answers(tmp_path):
    # no connection here reaches the AUTH deadline (closing at it: the test above)
    srv = _Server(tmp_path, max_connections=8, auth_timeout=600)
    held, idle = [], []
    try:
        for _ in range(8):                          # authenticated: every place taken
            s = _connect(srv.port)
            s.sendall(f"AUTH {CLIENT_TOKEN}\n".encode())
            assert json.loads(s.makefile("rb").readline())["ok"] is True
            held.append(s)
        assert srv.tcp.active == 8
        for _ in range(200):
            idle.append(_connect(srv.port))
        # past the cap: every one refused at once, saying why, and closed
        busy = {"ok": False, "error": "busy: too many control connections; try again later"}
        assert all(_refusal(s) == busy for s in idle)
        with ControlClient(str(tmp_path / "ctl.sock"), timeout=30) as c:
            assert c.status()["name"] == "fake"
        assert srv.tcp.active == 8
        # places freed are taken again, and one address holds at most a
        # quarter of them unauthenticated
        for s in held[5:]:
            s.close()
        _until(lambda: srv.tcp.active == 5, "closed connections' places")
        pending = [_connect(srv.port) for _ in range(2)]
        idle += pending
        _until(lambda: srv.tcp.active == 7, "two unauthenticated connections served")
        late = _connect(srv.port)
        idle.append(late)
        assert _refusal(late)["error"] == ("busy: too many unauthenticated connections from this address; "
                                           "try again later")
        for s in pending:                           # held, unanswered, until their deadline
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in idle + held:
            s.close()
        srv.close()


def test_refused_tokens_are_logged_at_a_limited_rate(tmp_path, caplog, monkeypatch):
    import logging

    from xaggd import control_server
    from xaggd.loglimit import LogLimiter
    now = [0.0]
    # the server's limiter, fresh and on a clock of the test's: what earlier
    # tests logged and how long this one takes do not count
    monkeypatch.setattr(control_server, "limited", LogLimiter(control_server.log, clock=lambda: now[0]))
    srv = _Server(tmp_path)

    def refused(times):
        for _ in range(times):
            with _connect(srv.port) as s:
                s.sendall(b"AUTH wrong-token-0123456789\n")
                assert "wrong token" in json.loads(s.makefile("rb").readline())["error"]
        return [r.getMessage() for r in caplog.records if "wrong token" in r.getMessage()]
    try:
        with caplog.at_level(logging.WARNING, logger="xaggd.control"):
            assert len(refused(60)) == 3                    # the limiter's burst
            now[0] = 61.0                                   # a window later
            lines = refused(1)
        assert len(lines) == 4 and lines[-1].endswith("(57 more like it in the last 60s were not logged)"), lines
    finally:
        srv.close()


def test_log_limiter_counts_what_it_suppresses():
    from xaggd.loglimit import LogLimiter
    seen = []

    class L:
        def warning(self, msg, *a):
            seen.append(msg % a)
    now = [0.0]
    lim = LogLimiter(L(), burst=2, window_s=10.0, clock=lambda: now[0])
    for _ in range(5):
        lim.warning("refused", "x %d", 1)
    assert seen == ["x 1", "x 1"]
    now[0] = 11.0
    lim.warning("refused", "x %d", 2)
    assert seen[-1] == "x 2 (3 more like it in the last 10s were not logged)"


# -- run dir and pid file ------------------------------------------------------------
def test_the_pid_file_does_not_follow_a_symlink(tmp_path):
    from xaggd.server import PidFile
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "x.pid").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        PidFile(str(run / "x.pid"), "x").acquire()
    assert victim.read_text() == "precious\n"


def test_the_run_dir_must_be_ours_and_not_writable_by_others(tmp_path):
    import os
    from xaggd.server import secure_run_dir
    mine = tmp_path / "mine"
    secure_run_dir(str(mine))
    assert mine.is_dir() and (mine.stat().st_mode & 0o022) == 0
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 65534, 65534)
    with pytest.raises(ConfigError, match=r"run_dir=.*owned by uid 65534"):
        secure_run_dir(str(other))
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match=r"run_dir=.*writable by others"):
        secure_run_dir(str(loose))
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(ConfigError, match=r"run_dir=.*symbolic link"):
        secure_run_dir(str(link))


def test_sighup_rereads_the_token_files_and_keeps_running(tmp_path):
    import signal
    import time
    tok = tmp_path / "token"
    tok.write_text(ADMIN_TOKEN + "\n")
    tok.chmod(0o600)
    run = tmp_path / "run"
    log = open(tmp_path / "log", "w")
    p = subprocess.Popen(XAGGD + ["start", "--userspace", "--bind", "127.0.0.1", "--port", "0",
                                  "--memory", "1M", "--listen", "127.0.0.1:0", "--token-file", str(tok),
                                  "--name", "hup", "--run-dir", str(run)], stdout=log, stderr=log)
    try:
        st = ControlClient(str(run / "hup.sock")).wait_ready(timeout=60)
        port = int(st["listen"].rsplit(":", 1)[1])
        new = "rotated-token-0123456789"
        tok.write_text(new + "\n")
        p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "SIGHUP" not in (tmp_path / "log").read_text():
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        assert p.poll() is None
        with ControlClient(f"127.0.0.1:{port}", token=new) as c:
            assert c.status()["name"] == "hup"
        with ControlClient(f"127.0.0.1:{port}", token=ADMIN_TOKEN) as c, \
                pytest.raises(ControlError, match="auth: wrong token"):
            c.status()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        log.close()


def test_register_job_over_tcp_with_the_client_token_and_again(tmp_path):
    """xagg-client's path (engine: job_request, then register_job at start and
    after every back-off): the job token in the request makes re-registration
    and the reset work, and another client holding the client token cannot
    touch the job."""
    from xagg.wire.registration import RegistrationError, job_request, register_job
    srv = _Server(tmp_path)
    try:
        addr = f"127.0.0.1:{srv.port}"
        req = job_request(job_id=77, cookie=5, workers=["10.0.0.1", "10.0.0.2"], max_elements=1000,
                          aggregators=["10.0.0.9:9977"], weights=None, fanout="unicast")
        assert len(req["job_token"]) >= 16
        assert register_job([addr], CLIENT_TOKEN, req) == 256
        assert register_job([addr], CLIENT_TOKEN, req) == 256          # again: idempotent, reset again
        job = srv.tcp.dispatcher.daemon.jobs.jobs[77]
        assert job.resets == 2
        other = job_request(job_id=77, cookie=6, workers=["10.0.0.66"] * 2, max_elements=1000,
                            aggregators=["10.0.0.9:9977"], weights=None, fanout="unicast")
        with pytest.raises(RegistrationError, match="job_token: job 77 belongs to another registrant"):
            register_job([addr], CLIENT_TOKEN, {**other, "replace": True})
        with ControlClient(addr, token=CLIENT_TOKEN) as c, pytest.raises(ControlError, match="job_token"):
            c.remove(77)
        assert srv.tcp.dispatcher.daemon.jobs.jobs[77].cookie == 5
    finally:
        srv.close()


def test_register_job_pins_each_worker_per_aggregator(tmp_path):
    """Multi-rail workers (issue 13, item 10): a worker reaches each aggregator
    from the address its route to that aggregator takes, and each daemon is
    told that one, not the address towards aggregator 0."""
    from xagg.wire.registration import job_request, register_job, worker_source_ips
    for k in range(2):
        (tmp_path / str(k)).mkdir()
    servers = [_Server(tmp_path / str(k)) for k in range(2)]
    try:
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        by_agg = [["10.0.0.1", "10.0.0.2"], ["10.1.0.1", "10.1.0.2"]]
        req = job_request(job_id=78, cookie=5, workers=by_agg[0], max_elements=1000,
                          aggregators=["10.0.0.9:9977", "10.1.0.9:9977"], weights=None, fanout="unicast")
        register_job(addrs, CLIENT_TOKEN, req, workers_by_agg=by_agg)
        for k, s in enumerate(servers):
            job = s.tcp.dispatcher.daemon.jobs.jobs[78]
            assert job.workers == by_agg[k] and job.agg_index == k
    finally:
        for s in servers:
            s.close()
    assert worker_source_ips(["127.0.0.1:9977", "127.0.0.1:9978"]) == ["127.0.0.1"] * 2


def test_a_resize_does_not_block_the_registrants_re_registration(tmp_path):
    """After an operator resized the job, the engine's retry registers it again
    with its own parameters (it holds the job token) instead of failing for
    good with "already registered with other parameters" (issue 13, minor)."""
    from xagg.wire.registration import job_request, register_job
    srv = _Server(tmp_path)
    try:
        addr = f"127.0.0.1:{srv.port}"
        req = job_request(job_id=79, cookie=5, workers=["10.0.0.1", "10.0.0.2"], max_elements=1000,
                          aggregators=["10.0.0.9:9977"], weights=None, fanout="unicast")
        register_job([addr], CLIENT_TOKEN, req)
        with ControlClient(addr, token=ADMIN_TOKEN) as admin:
            admin.resize(79, 5000)
        assert srv.tcp.dispatcher.daemon.jobs.jobs[79].max_elements == 5000
        register_job([addr], CLIENT_TOKEN, req)
        assert srv.tcp.dispatcher.daemon.jobs.jobs[79].max_elements == 1000
    finally:
        srv.close()


def test_jobs_survive_a_daemon_restart(tmp_path):
    """Registered jobs are kept in RUN_DIR/NAME.jobs.json (0600: it holds
    cookies and job-token hashes) and installed again on start; a removed job
    stays removed (issue 13, minor)."""
    import os
    import signal
    import stat
    run = tmp_path / "run"

    def start():
        log = open(tmp_path / "log", "a")
        p = subprocess.Popen(XAGGD + ["start", "--userspace", "--bind", "127.0.0.1", "--port", "0",
                                      "--memory", "1M", "--name", "keep", "--run-dir", str(run)],
                             stdout=log, stderr=log)
        ControlClient(str(run / "keep.sock")).wait_ready(timeout=60)
        return p

    def stop(p):
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0

    p = start()
    try:
        with ControlClient(str(run / "keep.sock")) as c:
            c.register(31, cookie=7, max_elements=1000, workers=["10.0.0.1", ""], job_token="t" * 20)
            c.register(32, cookie=8, max_elements=600, n_workers=3, fanout="bcast")
            c.resize(32, 2000)
            c.remove(31)
            c.register(33, cookie=9, max_elements=300, n_workers=2)
            before = {j["job_id"]: j for j in c.list_jobs()}
    finally:
        stop(p)
    saved = run / "keep.jobs.json"
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    p = start()
    try:
        with ControlClient(str(run / "keep.sock")) as c:
            after = {j["job_id"]: j for j in c.list_jobs()}
    finally:
        stop(p)
    assert sorted(after) == [32, 33]
    for j in (32, 33):
        for k in ("cookie", "workers", "max_elements", "fanout", "n_chunks", "aggregators"):
            assert after[j][k] == before[j][k], (j, k)
    assert "Traceback" not in (tmp_path / "log").read_text()


def test_metrics_are_served_in_prometheus_text(tmp_path):
    """xaggd --metrics HOST:PORT (off by default), scraped with a real HTTP
    client and parsed by prometheus_client's parser: every verdict counter,
    per job_id aggregated/completed/retransmits/dropped, slots in use, every
    data plane mode, the library's process metrics and the build's version."""
    import signal
    import socket
    import urllib.request

    import numpy as np
    from prometheus_client.parser import text_string_to_metric_families

    from xagg.wire.metrics import package_version

    from xagg.wire.proto import VERDICTS, make_packets
    run = tmp_path / "run"
    p = subprocess.Popen(XAGGD + ["start", "--userspace", "--bind", "127.0.0.1", "--port", "0", "--vals", "256",
                                  "--memory", "1M", "--name", "m", "--run-dir", str(run),
                                  "--metrics", "127.0.0.1:0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ControlClient(str(run / "m.sock")) as c:
            st = c.wait_ready(timeout=60)
            c.register(61, cookie=3, max_elements=512, n_workers=2)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for w in (0, 1):
                    s.sendto(make_packets(job_id=61, cookie=3, worker_id=w, round_=0, chunks=np.array([0]),
                                          values=np.ones((1, 256), np.int32)).tobytes(), ("127.0.0.1", st["port"]))
                s.sendto(b"XAGG nonsense", ("127.0.0.1", st["port"]))
            import time
            deadline = time.monotonic() + 10
            while c.stats()["counters"]["completed"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            st = c.status()
            assert st["metrics"].startswith("127.0.0.1:")
            url = f"http://{st['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in families.values() for s in f.samples}
        assert families["xagg_packets"].type == "counter"
        for v in VERDICTS:
            assert ("xagg_packets_total", (("verdict", v),)) in samples, v
        assert samples[("xagg_packets_total", (("verdict", "completed"),))] == 1
        assert samples[("xagg_packets_total", (("verdict", "aggregated"),))] == 1
        assert samples[("xagg_packets_total", (("verdict", "malformed"),))] == 1
        for k, want in (("aggregated", 2), ("completed", 1), ("retransmits", 0), ("dropped", 0)):
            assert samples[(f"xagg_job_{k}_total", (("job_id", "61"),))] == want, k
        assert samples[("xagg_slots_used", ())] == st["memory"]["used_slots"] == st["jobs"][0]["n_slots"]
        assert samples[("xagg_slots_capacity", ())] == st["memory"]["max_slots"]
        assert samples[("xagg_jobs", ())] == 1
        assert samples[("xagg_dataplane_info", (("backend", "userspace"),))] == 1
        from xaggd.metrics import DATAPLANE_MODES
        assert {m: samples[("xagg_dataplane_mode", (("mode", m),))] for m in DATAPLANE_MODES} == \
            {m: int(m == "userspace") for m in DATAPLANE_MODES}
        assert all(f.type != "gauge" or not n.endswith("_total") for n, f in families.items()), \
            "a gauge named like a counter"
        assert samples[("process_resident_memory_bytes", ())] > 0
        assert ("xagg_build_info", (("version", package_version()),)) in samples
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
