"""xagg-client under torchrun as users already run it: torchrun's own
options through `xagg-client run`, `torchrun ... --no-python xagg-client
run ...`, an elastic restart after a rank died, and a script's own built-in
DDP hook. Real torchrun, 2 gloo ranks, a userspace xaggd on loopback that
rank 0 registers the job with."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from xagg.wire.control import ControlClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
STEPS = 8
SCRIPT = f"""
    import os
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("STORE_DIR"):     # a store of each attempt's own
        dist.init_process_group("gloo", init_method=f"file://{{os.environ['STORE_DIR']}}/store{{attempt}}",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(300, 10))
    if os.environ.get("BUILTIN_HOOK"):
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range({STEPS}):
        if attempt == 0 and step == int(os.environ.get("DIE_AT", "-1")) and dist.get_rank() == 1:
            os._exit(17)                # a rank lost mid-training
        opt.zero_grad()
        model(torch.randn(16, 300, generator=g)).pow(2).mean().backward()
        opt.step()
    # one write under PIPE_BUF: the ranks share the pipe, and print's pieces interleave
    os.write(1, f"SCRIPT-OK rank {{dist.get_rank()}} attempt {{attempt}}\\n".encode())
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(textwrap.dedent(SCRIPT))
    return str(p)


@pytest.fixture
def xaggd(tmp_path):
    """A userspace xaggd with its control socket in tmp_path; stopped by its pid."""
    run_dir = tmp_path / "xaggd"
    run_dir.mkdir()
    proc = subprocess.Popen([os.path.join(BIN, "xaggd"), "start", "--userspace", "--bind", "127.0.0.1",
                             "--port", "0", "--memory", "8M", "--name", "torchrun", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    control = str(run_dir / "torchrun.sock")
    while True:                           # until it answers (pytest-timeout guards a hang)
        assert proc.poll() is None, proc.stdout.read()
        try:
            with ControlClient(control, timeout=5) as c:
                port = c.status()["port"]
                break
        except Exception:  # noqa: BLE001 - not up yet
            import time
            time.sleep(0.1)
    yield [f"127.0.0.1:{port}", "--control", control]
    proc.terminate()
    proc.wait(30)


def counters(status_dir) -> list[dict]:
    return [json.loads((status_dir / f"rank{k}.json").read_text()) for k in range(2)]


def run(cmd, env=None, timeout=300):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", ""), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def test_torchrun_no_python_runs_xagg_client_as_its_program(script, xaggd, tmp_path):
    """`torchrun [all of torchrun] --no-python xagg-client run ...`: each rank
    is xagg-client, which runs the script patched in its own process."""
    status = tmp_path / "status"
    r = run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", "--no-python",
             "xagg-client", "run", "-a", *xaggd, "--status-dir", str(status), "--progress", "0", "--", script])
    assert r.returncode == 0 and r.stdout.count("SCRIPT-OK") == 2, r.stderr
    assert all(c["buckets_xagg"] == STEPS and c["fallbacks"] == 0 for c in counters(status)), r.stderr


def test_xagg_client_run_passes_torchrun_options_through(script, xaggd, tmp_path):
    status, logs = tmp_path / "status", tmp_path / "logs"
    r = run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", *xaggd, "--status-dir", str(status),
             "--progress", "0", "--rdzv_backend=c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--rdzv-id", "first-day", "--nproc-per-node", "2", "--max_restarts", "0", "--log-dir", str(logs),
             "--tee", "3", script])
    assert r.returncode == 0 and r.stdout.count("SCRIPT-OK") == 2, r.stderr
    assert all(c["buckets_xagg"] == STEPS for c in counters(status)), r.stderr
    assert any(name.endswith(".log") for _, _, files in os.walk(logs) for name in files)    # --log-dir, --tee


def test_an_option_torchrun_does_not_take_points_to_the_no_python_form(script):
    r = run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", "127.0.0.1", "--job-id", "1", "--cookie", "2",
             "--rdzv-endpoint", "127.0.0.1:1", "--no-such-flag", "x", "--", script], timeout=60)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr and "--no-python xagg-client run" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("nodes", [["--nnodes", "2"], ["--nproc-per-node", "1", "--nnodes=1:2"]])
def test_several_nodes_without_a_rendezvous_address_are_refused_before_the_launch(script, nodes):
    """torchrun would wait for the other nodes at its default endpoint forever."""
    r = run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", "127.0.0.1", "--job-id", "1", "--cookie", "2",
             *nodes, "--", script], timeout=60)
    assert r.returncode == 2 and "--master-addr" in r.stderr and "--rdzv-endpoint" in r.stderr, r.stderr


def test_an_elastic_restart_registers_again_and_goes_on_through_xagg(script, xaggd, tmp_path):
    """Rank 1 dies at step 3 of the first attempt; torchrun (--max-restarts 1)
    starts the group again, whose rank 0 registers its job again, and every
    step of the second attempt goes through xagg. (The script keeps a store
    per attempt: torch 2.13's gloo groups read the first attempt's addresses
    from torchrun's store after a restart, and fail to connect, xagg or not.)"""
    status = tmp_path / "status"
    r = run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", *xaggd, "--status-dir", str(status),
             "--progress", "0", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
             "--", script], env={"DIE_AT": "3", "STORE_DIR": str(tmp_path)}, timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("attempt 1") == 2 and "attempt 0" not in r.stdout, r.stdout
    assert all(c["buckets_xagg"] == STEPS and c["fallbacks"] == 0 for c in counters(status)), r.stderr
    with ControlClient(xaggd[2]) as c:
        jobs = c.list_jobs()
    assert counters(status)[0]["job_id"] in [j["job_id"] for j in jobs]


def test_a_script_s_builtin_hook_is_kept_without_patching_torch_private_methods(script, tmp_path):
    """The patch wraps DDP's public methods only: a built-in hook the script
    registers stays, and the model trains on it (with a warning)."""
    probe = run([sys.executable, "-c", "from torch.nn.parallel import DistributedDataParallel as D; "
                 "f = D._register_builtin_comm_hook; from xagg.torch.patch import install; install(); "
                 "assert D._register_builtin_comm_hook is f; print('UNTOUCHED')"], timeout=60)
    assert "UNTOUCHED" in probe.stdout, probe.stderr
    r = run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", "127.0.0.1:9", "--job-id", "5", "--cookie", "6",
             "--nproc-per-node", "2", "--progress", "0", "--", script], env={"BUILTIN_HOOK": "1"})
    assert r.returncode == 0 and r.stdout.count("SCRIPT-OK") == 2, r.stderr
    assert r.stderr.count("registers its own DDP communication hook") == 2
