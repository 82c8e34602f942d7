"""scripts/setup.sh's probe of the venv (scripts/venv_ready.py): on a first
run everything is missing, which is expected, so it says so in one line
instead of a traceback, and it passes on a venv `make setup` completed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "scripts" / "venv_ready.py"


def test_setup_runs_the_probe():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"$VENV/bin/python" scripts/venv_ready.py' in setup
    assert "importlib.import_module" not in setup


def test_a_fresh_venv_is_reported_in_one_line(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    r = subprocess.run([str(tmp_path / "v" / "bin" / "python"), str(PROBE)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr == ""
    assert r.stdout.startswith("[setup] the venv lacks torch, numpy, click") and r.stdout.count("\n") == 1


def test_the_project_venv_passes():
    r = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
