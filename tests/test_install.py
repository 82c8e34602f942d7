"""`pip install .` (not editable) into a fresh venv gives a working product:
built without a warning; an aggregator host's install, without torch or
scipy (those are the extras xagg[torch] and xagg[plan]); every package that
does not need torch, bpf/ and the client's C source inside site-packages,
the three commands, and an all-reduce through `xaggd --userspace` on
loopback, all run from outside the checkout so nothing can come from it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS_TORCH = {"xagg.compress"}       # packages whose modules import torch at the top

SMOKE = textwrap.dedent("""
    import importlib, importlib.util, json, os, pkgutil, signal, subprocess, sys, threading, tomllib
    from pathlib import Path
    import numpy as np

    site = Path(sys.prefix)
    assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("scipy") is None, \
        "xagg's own dependencies brought torch or scipy"
    packages = tomllib.loads(Path(sys.argv[1]).read_text())["tool"]["setuptools"]["packages"]
    need_torch = set(json.loads(sys.argv[2]))
    for name in packages:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            assert name in need_torch and e.name == "torch", f"{name}: {e}"
            continue
        assert name not in need_torch, f"{name} imports without torch: take it off NEEDS_TORCH"
        assert site in Path(mod.__file__).parents, f"{name} from {mod.__file__}, not the venv"
    import xaggd                     # the daemon, every module of it, needs neither
    for m in pkgutil.walk_packages(xaggd.__path__, "xaggd."):
        importlib.import_module(m.name)

    from xagg.wire import proto
    assert site in proto.BPF_DIR.parents and not proto.BPF_DIR.is_symlink(), proto.BPF_DIR
    assert (proto.BPF_DIR / "xagg_xdp.c").is_file() and proto.C.XAGG_MAGIC
    from xagg.client import native
    assert native.load() is not None, "the C round loop did not build from the installed source"

    from xagg.client import Client, ClientConfig
    from xagg.wire.control import ControlClient
    run = Path(os.environ["RUN_DIR"])
    daemon = subprocess.Popen([str(site / "bin" / "xaggd"), "start", "--userspace", "--bind", "127.0.0.1",
                               "--port", "0", "--run-dir", str(run), "--name", "smoke"])
    try:
        with ControlClient(str(run / "smoke.sock")) as c:
            port = c.wait_ready(timeout=60)["port"]
            c.register(5, cookie=6, max_elements=10_000, n_workers=2)
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(10_000).astype(np.float32) for _ in range(2)]
        out = [None, None]

        def worker(w):
            cfg = ClientConfig(job_id=5, cookie=6, worker_id=w, n_workers=2,
                               aggregators=[f"127.0.0.1:{port}"], timeout=20)
            with Client(cfg) as cl:
                out[w] = cl.allreduce(xs[w])
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        want = xs[0].astype(np.float64) + xs[1]
        assert all(o is not None and np.max(np.abs(o - want)) < 1e-4 for o in out), "wrong sum"
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
    print("SMOKE-OK")
""")


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, f"{cmd}: {r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def test_non_editable_install_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    # the build's own output (-v shows the backend's), without the dependencies, whose
    # lookups print this machine's index configuration; PYTHONDONTWRITEBYTECODE would
    # add "byte-compiling is disabled" of its own
    quiet = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = run([venv / "bin" / "pip", "install", "-v", "--no-deps", "--disable-pip-version-check", ROOT], env=quiet)
    warnings = [line for line in out.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert warnings == [], "\n".join(warnings)
    run([venv / "bin" / "pip", "install", "-q", "--disable-pip-version-check", ROOT])
    env = {"PATH": f"{venv / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin", "RUN_DIR": str(tmp_path / "run"),
           "XAGG_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    assert "SMOKE-OK" in run([venv / "bin" / "python", "-c", SMOKE, ROOT / "pyproject.toml",
                              json.dumps(sorted(NEEDS_TORCH))], cwd=tmp_path, env=env)
    for cmd in (["xaggd", "--help"], ["xagg-client", "run", "--help"], ["xagg", "lab", "--help"]):
        assert "Usage" in run([venv / "bin" / cmd[0], *cmd[1:]], cwd=tmp_path, env=env)
