"""An install without an extra says which extra a feature needs, in the
error itself: the planner without scipy names xagg[plan]."""
from __future__ import annotations

import sys

import pytest
from test_planner import G, cluster

from xagg.wire import planner


def test_planning_without_scipy_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "scipy", None)         # what an install without it finds
    with pytest.raises(ModuleNotFoundError, match=r"scipy, which this install lacks: pip install 'xagg\[plan\]'"):
        planner.make_plan(cluster([G] * 4, [G, G]))
