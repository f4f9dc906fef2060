"""The package layout is the architecture: each package imports only its own layer and the layers below it,
and no module imports itself back through others (no cycles, lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "harness"
# Lowest first. A module of a package may import from its own package and from packages listed before it.
# Modules directly under harness/ (cli, __main__) sit above every package.
LAYERS = [
    "core",
    "hosts",
    "tasks",
    "workload",
    "models",
    "envs",
    "wheelhouse",
    "serve",
    "proxy",
    "checks",
    "upstream",
    "accuracy",
    "cache",
    "gpu",
    "simbox",
    "render",
    "run",
    "matrix",
    "releases",
    "cluster",
    "e2e",
    "repro",
    "shrink",
    "bench",
    "calibrate",
    "doctor",
    "explore",
    "nightly",
]
# Upward imports known and waiting on a move, each as "module -> module" with why; none today.
KNOWN_UPWARD: set[str] = set()


def modules(root: Path = HARNESS) -> dict[str, Path]:
    """Each module under ``root`` (a ``harness`` folder) by its dotted name."""
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    deps: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "harness":
            subs = {f"{n.module}.{a.name}" for a in n.names} & set(known)
            deps |= subs or {n.module}
        elif isinstance(n, ast.Import):
            deps |= {a.name for a in n.names if a.name.split(".")[0] == "harness"}
    return deps


def package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def graph(root: Path = HARNESS) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(p, known) for m, p in known.items()}


def test_every_package_has_a_layer():
    pkgs = {package(m) for m in modules()} - {None}
    assert pkgs == set(LAYERS), (
        f"packages without a layer: {pkgs - set(LAYERS)}; layers without a package: {set(LAYERS) - pkgs}"
    )


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    """Every import of a package module that points to a package above it (or to a module directly under harness/),
    except those of KNOWN_UPWARD."""
    up = []
    for m, deps in g.items():
        pm = package(m)
        if pm is None:
            continue
        for d in deps:
            pd = package(d)
            if (pd is None or LAYERS.index(pd) > LAYERS.index(pm)) and f"{m} -> {d}" not in KNOWN_UPWARD:
                up.append(f"{m} -> {d}")
    return sorted(up)


def find_cycles(g: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d in g and d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_package_imports_a_package_above_it():
    up = upward_imports(graph())
    assert not up, "imports pointing up: " + ", ".join(up)


def test_every_known_upward_import_is_still_made():
    """An entry of KNOWN_UPWARD whose import is gone is stale: it would let that import come back unnoticed."""
    g = graph()
    stale = [e for e in sorted(KNOWN_UPWARD) if e.split(" -> ")[1] not in g.get(e.split(" -> ")[0], set())]
    assert not stale, "KNOWN_UPWARD entries no module makes (remove them): " + ", ".join(stale)


def test_no_import_cycles():
    cycles = find_cycles(graph())
    assert not cycles, "import cycles: " + "; ".join(cycles)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checkers_see_a_violation(tmp_path):
    """The rules above can fail: in a tiny tree of fake harness packages, read from its files as the real tree is, a
    lazy import of a higher layer and an import of a module directly under harness/ are reported as pointing up, and
    two modules importing each other inside functions as a cycle; once those imports are gone, nothing is reported."""
    tree = tmp_path / "harness"
    write_tree(
        tree,
        {
            "cli.py": "from harness.run import pipeline\n",
            "core/__init__.py": "",
            "core/low.py": "def f():\n    from harness.run.pipeline import PDRun\n",  # up a layer, inside a function
            "core/top.py": "import harness.cli\n",  # a module above every package
            "core/a.py": "def f():\n    from harness.core import b\n",
            "core/b.py": "def g():\n    from harness.core.a import f\n",  # a -> b -> a
            "run/__init__.py": "",
            "run/pipeline.py": "from harness.core import a\n\nPDRun = object\n",  # down a layer: allowed
        },
    )
    g = graph(tree)
    assert set(g) >= {"harness.cli", "harness.core.low", "harness.core.a", "harness.run.pipeline"}
    assert upward_imports(g) == ["harness.core.low -> harness.run.pipeline", "harness.core.top -> harness.cli"]
    assert find_cycles(g) == ["harness.core.a -> harness.core.b -> harness.core.a"]
    write_tree(tree, {"core/low.py": "def f():\n    from harness.core import a\n", "core/top.py": "", "core/b.py": ""})
    g = graph(tree)
    assert upward_imports(g) == [] and find_cycles(g) == []
