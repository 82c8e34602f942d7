"""The layout's rules, read from the source (no imports of the code itself):
which room may import which, no private names across modules, and every
package of the tree in pyproject.toml. README.md ("Layout") explains the
rooms; xagg/__init__.py has the map."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = {"xagg": ROOT / "xagg", "xaggd": ROOT / "daemon" / "xaggd"}

# room -> the rooms it may import. The wire format is the floor everything
# stands on; the client never sees the daemon or torch; the daemon sees only
# the wire and itself; the `xagg` command plans (wire), probes from its host
# (client) and adds the lab's commands and figures (lab); lab, bench and
# examples are tools and may use anything.
ANY = {"xagg", "xagg.wire", "xagg.client", "xagg.compress", "xagg.torch", "xagg.cli", "xagg.lab", "xagg.bench",
       "xaggd"}
MAY_IMPORT = {
    "xagg": set(),                       # the package map: a docstring
    "xagg.wire": {"xagg.wire"},
    "xagg.client": {"xagg.wire", "xagg.client"},
    "xagg.compress": {"xagg.compress", "xagg.client"},    # the client's compiled library (top-k)
    "xagg.torch": {"xagg.wire", "xagg.client", "xagg.compress", "xagg.torch"},
    "xaggd": {"xagg.wire", "xaggd"},
    "xagg.cli": {"xagg.wire", "xagg.client", "xagg.lab", "xagg.cli"},
    "xagg.lab": ANY,
    "xagg.bench": ANY,
    "examples": ANY,
}


def room_of(module: str) -> str | None:
    for room in sorted(MAY_IMPORT, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    return None


def sources() -> dict[str, Path]:
    """module name -> file, for the product's code and the examples."""
    out = {}
    for top, base in TREES.items():
        for f in base.rglob("*.py"):
            parts = [top, *f.relative_to(base).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    for f in (ROOT / "examples").glob("*.py"):
        out[f"examples.{f.stem}"] = f
    return out


SOURCES = sources()
TREE = {m: ast.parse(f.read_text(), str(f)) for m, f in SOURCES.items()}


def is_package(module: str) -> bool:
    return SOURCES.get(module, Path()).name == "__init__.py"


def imports(module: str):
    """(line, imported module, names) of every import statement, lazy ones included."""
    pkg = module if is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(TREE[module]):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            yield node.lineno, base, [a.name for a in node.names]


def ours(name: str) -> bool:
    return name.split(".")[0] in TREES


def test_every_module_is_in_a_room():
    assert [m for m in SOURCES if room_of(m) is None] == []


def test_rooms_import_only_what_they_may():
    bad = []
    for module in SOURCES:
        room = room_of(module)
        for line, target, names in imports(module):
            targets = [target] + [f"{target}.{n}" for n in names if f"{target}.{n}" in SOURCES]
            for t in filter(ours, targets):
                if room_of(t) not in MAY_IMPORT[room]:
                    bad.append(f"{SOURCES[module].relative_to(ROOT)}:{line}: {room} imports {t}")
    assert bad == [], "\n".join(bad)


def defined_privates(module: str) -> set[str]:
    """Underscored names a module defines: functions, classes, module globals, self._x."""
    out = set()
    for node in ast.walk(TREE[module]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return {n for n in out if is_private(n)}


def is_private(name: str) -> bool:
    """_name, not __dunder__ nor ctypes' _sunder_ protocol (_fields_)."""
    return name.startswith("_") and not name.endswith("_")


def test_no_private_names_across_modules():
    """A name with a leading underscore is its module's own: no other module
    imports it, calls it or reads it (the dunders excepted)."""
    mine = {m: defined_privates(m) for m in SOURCES}
    bad = []
    for module in SOURCES:
        where = SOURCES[module].relative_to(ROOT)
        for line, target, names in imports(module):
            if ours(target):
                bad += [f"{where}:{line}: imports {target}.{n}" for n in names if is_private(n)]
        elsewhere = set().union(*(p for m, p in mine.items() if m != module)) - mine[module]
        for node in ast.walk(TREE[module]):
            if (isinstance(node, ast.Attribute) and node.attr in elsewhere
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{where}:{node.lineno}: uses {node.attr}, another module's private name")
    assert bad == [], "\n".join(bad)


def test_one_module_makes_bpf_syscalls():
    """Raw bpf(2) is set up in one place per language: xagg/wire/syscalls.py,
    and for the C round loop's aggregator on its own host, csrc/local.c."""
    calls = [str(f.relative_to(ROOT)) for m, f in SOURCES.items()
             if re.search(r"\.syscall\(|SYS_bpf|SYS_BPF\s*=", f.read_text())]
    assert calls == ["xagg/wire/syscalls.py"]
    c_calls = [f.name for f in (ROOT / "xagg" / "client" / "csrc").iterdir()
               if re.search(r"__NR_bpf|SYS_bpf", f.read_text())]
    assert c_calls == ["local.c"]


def test_pyproject_lists_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = sorted(m for m in SOURCES if is_package(m))
    assert sorted(cfg["packages"]) == packages
    # bpf/ ships inside xagg.wire through a link to the top-level directory
    link = ROOT / "xagg" / "wire" / "bpf"
    assert link.is_symlink() and link.resolve() == (ROOT / "bpf").resolve()


@pytest.mark.parametrize("package", sorted(m for m in SOURCES if is_package(m)))
def test_every_package_says_what_it_holds(package):
    """One docstring per package tells a newcomer where a change goes: it names
    every module of the package."""
    doc = ast.get_docstring(TREE[package]) or ""
    base = SOURCES[package].parent
    modules = sorted(f.name for f in base.glob("*.py") if f.name not in ("__init__.py",))
    modules += sorted(f"{d.name}/" for d in base.iterdir() if (d / "__init__.py").exists())
    missing = [m for m in modules if m not in doc]
    assert doc and missing == [], f"{package}'s docstring does not mention {missing}"
