"""Imports go one way (docs/DESIGN.md, "Layers"): dags -> plugins -> training (devtools beside
dags, above plugins); nothing shipped imports the test tree. Inside `training/`, packages by role
import only the roles below them (`TRAINING_ROLES`): the island and the merge meet only in
`protocol` and `store`; only the benchmarks and the cli import `training.bench`. No import circle
anywhere in `training/` or `plugins/`, counting the imports inside functions. No jax under dags/,
and none when the plugins and the DAG files are imported (the dag-processor and the triggerer
import them).

A failure names the file and the import that goes the wrong way (or the modules of a circle, in
order): move the code to the role it belongs to (or import it inside the function that needs it,
for jax in a plugin task); break a circle by moving the piece both modules need below them.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# top-level package of a layer -> packages it must never import (at any depth, lazily included)
FORBIDDEN = {
    # the test tree is not shipped: an import of it fails from the wheel and the image
    "training": {"diloco_airflow", "dags", "devtools", "airflow", "tests"},
    "plugins": {"dags", "devtools", "tests"},
    "dags": {"devtools", "jax", "flax", "optax"},
}

# a role under training/ -> the roles it may import (at any depth, lazily included); a role
# not listed (cli.py, bench/) may import every role
TRAINING_ROLES = {
    "config": set(),
    "store": {"config"},
    "data": {"config"},
    "codecs": {"config", "store"},
    "protocol": {"config", "store", "codecs"},
    "model": {"config", "store", "data", "protocol"},
    "faults": {"config", "store"},
    "island": {"config", "store", "data", "codecs", "protocol", "model", "faults"},
    "merge": {"config", "store", "data", "codecs", "protocol", "model", "faults"},
    "views": {
        "config",
        "store",
        "data",
        "codecs",
        "protocol",
        "model",
        "faults",
        "island",
        "merge",
    },
}
# the use cases a command and its Airflow task share (create_or_join): everything the views
# may import, and the views
TRAINING_ROLES["usecases"] = TRAINING_ROLES["views"] | {"views"}
TOP_ROLES = {"cli", "bench"}  # the entry point and the benchmarks


def _imports(path: Path) -> list[str]:
    """Every module an import statement of `path` names, at any depth (inside functions and
    under `if TYPE_CHECKING` included; absolute imports: relative ones stay inside their
    package); `from pkg import name` names `pkg.name` where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += _from_import(node.module, node.names)
    return out


def _from_import(module: str, names: list[ast.alias]) -> list[str]:
    out = []
    for a in names:
        sub = f"{module}.{a.name}"
        out.append(sub if _is_module(sub) else module)
    return out


SOURCE_ROOTS = (ROOT, ROOT / "plugins")  # where a module's dotted name starts


def _is_module(dotted: str) -> bool:
    for root in SOURCE_ROOTS:
        base = root.joinpath(*dotted.split("."))
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _role(path: Path) -> str:
    """The role of a file under training/: its package (training/merge/admit.py: merge), or its
    module name for the files at the top (training/cli.py: cli)."""
    parts = path.relative_to(ROOT / "training").parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def test_no_layer_imports_a_layer_above_it():
    wrong = []
    for layer, banned in FORBIDDEN.items():
        for path in _files(layer):
            for module in _imports(path):
                if module.split(".")[0] in banned:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_every_role_under_training_is_known():
    roles = {_role(p) for p in _files("training")} - {"__init__"}
    assert roles - set(TRAINING_ROLES) - TOP_ROLES == set(), "add the new role to TRAINING_ROLES"


def test_each_role_imports_only_the_roles_below_it():
    """E.g. training/merge/* importing training.island.* fails: the island and the merge meet
    only in protocol/ and store/."""
    wrong = []
    for path in _files("training"):
        role = _role(path)
        if role not in TRAINING_ROLES:
            continue
        allowed = TRAINING_ROLES[role] | {role}
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "training" and len(parts) > 1 and parts[1] not in allowed:
                wrong.append(f"{path.relative_to(ROOT)} ({role}) imports {module}")
    assert wrong == []


def test_the_roles_form_no_cycle():
    for role, below in TRAINING_ROLES.items():
        for other in below:
            assert role not in TRAINING_ROLES[other], f"{role} and {other} import each other"


def _module_name(path: Path) -> str:
    """training/store/__init__.py: training.store; plugins/diloco_airflow/store.py:
    diloco_airflow.store."""
    root = ROOT / "plugins" if path.is_relative_to(ROOT / "plugins") else ROOT
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `folders` its import statements run, wherever they stand
    (module level, inside a function, under `if TYPE_CHECKING`), relative ones resolved.
    Importing `a.b.c` also runs the `__init__` of `a.b` (and of `a`): an edge to it, except to
    the importer's own packages (Python initialises those before the importer) unless an
    import statement names them (`from a.b import name` in `a/b/c.py`)."""
    files = [p for folder in folders for p in _files(folder)]
    names = {_module_name(p) for p in files}
    graph = {}
    for path in files:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set(_imports(path))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
                found.update(_from_import(module, node.names))
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for module in list(found):
            parts = module.split(".")
            found.update({".".join(parts[:i]) for i in range(1, len(parts))} - own)
        graph[name] = (found & names) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (or a node importing
    itself), in import order from the component's first member back to it: the shortest such
    path (["a", "b", "c", "a"]: a imports b, b imports c, c imports a)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_shortest_cycle(graph, min(comp), comp) for comp in comps)


def _shortest_cycle(graph: dict[str, set[str]], start: str, comp: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside `comp` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w in comp and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")


def test_cycle_finder_names_each_cycle_in_import_order():
    graph = {"a": {"c"}, "b": {"a"}, "c": {"b"}, "d": {"a", "e"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "c", "b", "a"], ["e", "e"]]


def test_import_graph_counts_imports_inside_functions_and_package_inits(tmp_path, monkeypatch):
    pkg = tmp_path / "training" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "training" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from training.pkg.low import x\n")
    (pkg / "low.py").write_text("def f():\n    from training.pkg import high\n")
    (pkg / "high.py").write_text("from . import low\n")
    (pkg / "mid.py").write_text("from training.pkg import x\n")  # its own package's __init__
    (tmp_path / "training" / "user.py").write_text("def g():\n    import training.pkg.low\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SOURCE_ROOTS", (tmp_path,))
    graph = _import_graph(("training",))
    assert graph["training.pkg.low"] == {"training.pkg.high"}
    assert graph["training.pkg.high"] == {"training.pkg.low"}
    assert graph["training.user"] == {"training.pkg", "training.pkg.low"}
    assert graph["training.pkg"] == {"training.pkg.low"}
    assert graph["training.pkg.mid"] == {"training.pkg"}
    assert _cycles(graph) == [["training.pkg.high", "training.pkg.low", "training.pkg.high"]]


def test_no_import_cycle_in_training_or_the_plugins():
    """No module's imports lead back to it, whether they run at import time or inside a
    function (an import inside a function only hides a circle: the two modules still cannot
    be understood, tested or moved one without the other)."""
    circles = [" -> ".join(c) for c in _cycles(_import_graph(("training", "plugins")))]
    assert circles == [], "import circles:\n" + "\n".join(circles)


def test_nothing_in_training_but_the_bench_and_its_command_imports_training_bench():
    wrong = []
    for path in _files("training"):
        if _role(path) in TOP_ROLES:
            continue
        rel = str(path.relative_to(ROOT))
        wrong += [f"{rel} imports {m}" for m in _imports(path) if m.startswith("training.bench")]
    assert wrong == []


_PROBE = """
import importlib, json, pkgutil, runpy, sys
import diloco_airflow
mods = [m.name for m in pkgutil.walk_packages(diloco_airflow.__path__, "diloco_airflow.")]
for name in mods:
    importlib.import_module(name)
for dag_file in sys.argv[1:]:
    runpy.run_path(dag_file)
heavy = sorted(m for m in ("jax", "flax", "optax") if m in sys.modules)
print("PROBE " + json.dumps({"modules": len(mods), "heavy": heavy}))
"""


def test_importing_every_plugin_module_and_dag_file_imports_no_jax(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
        "AIRFLOW_HOME": str(tmp_path / "airflow_home"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    dag_files = [str(p) for p in sorted((ROOT / "dags").glob("*.py"))]
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, *dag_files],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("PROBE "))
    probe = json.loads(line.removeprefix("PROBE "))
    assert probe["modules"] > 10 and probe["heavy"] == []


def test_the_map_of_the_tests_lists_every_test_file():
    # tests/README.md: regenerate its rows when a test file is added (area, cost, docstring)
    listed = set(re.findall(r"`(test_\w+\.py)`", (ROOT / "tests" / "README.md").read_text()))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert files - listed == set(), "tests/README.md does not list these"
    assert listed - files == set(), "tests/README.md lists files that are gone"


LONG = 520
"""About 500 lines: a module past it says why in its docstring ("past 500 lines" / "over 500 lines")."""


def test_a_module_past_about_500_lines_says_why_in_its_docstring():
    import ast
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    silent = []
    for name in files:
        text = (ROOT / name).read_text()
        if text.count("\n") <= LONG:
            continue
        doc = (ast.get_docstring(ast.parse(text)) or "").lower()
        if "500 lines" not in doc:
            silent.append(name)
    assert not silent, f"past {LONG} lines with no reason in the docstring: {silent}"
