"""What the docs and help texts tell a user agrees with the code: the
verdicts `xaggd stats --help` lists are the data plane's, and examples send
to the port the daemon listens on (C.XAGG_PORT), not another."""
from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from xagg.wire.proto import VERDICTS, C

ROOT = Path(__file__).resolve().parent.parent
USER_TEXT = ["README.md", "docs/**/*.md", "examples/**/*.py", "xagg/**/*.py", "daemon/**/*.py",
             "daemon/*.toml", "daemon/*.service"]


def test_stats_help_lists_every_verdict():
    from xaggd.cli import main
    r = CliRunner().invoke(main, ["stats", "--help"], terminal_width=200)
    assert r.exit_code == 0
    text = " ".join(r.output.split())          # as wrapped for any terminal
    missing = [v for v in VERDICTS if not re.search(rf"\b{v}\b", text)]
    assert missing == [], f"xaggd stats --help leaves out {missing}"


def test_examples_use_the_daemons_port():
    assert C.XAGG_PORT == 9977
    wrong = []
    for pattern in USER_TEXT:
        for f in sorted(ROOT.glob(pattern)):
            for n, line in enumerate(f.read_text().splitlines(), 1):
                # an address or --port with 9000, the old example port (9000 as an MTU stays)
                if re.search(r"(\d+\.\d+\.\d+\.\d+|localhost):9000\b|--port[ =]9000\b", line):
                    wrong.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert wrong == [], "\n".join(wrong)
