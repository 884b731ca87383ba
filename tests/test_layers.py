"""Imports go one way (docs/DESIGN.md, "Layers"): dags -> plugins -> training (devtools beside
dags, above plugins). Inside `training/`, packages by role import only the roles below them
(`TRAINING_ROLES`): the island and the merge meet only in `protocol` and `store`; only the
benchmarks and the cli import `training.bench`. No module-level import cycle anywhere in
`training/`. No jax under dags/, and none when the plugins and the DAG files are imported (the
dag-processor and the triggerer import them).

A failure names the file and the import that goes the wrong way: move the code to the role it
belongs to (or import it inside the function that needs it, for jax in a plugin task).
"""

from __future__ import annotations

import ast
import json
import os
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
TOP_ROLES = {"cli", "bench"}  # the entry point and the benchmarks


def _imports(path: Path, *, top_level_only: bool = False) -> list[str]:
    """Every module an import statement of `path` names (absolute imports; relative ones stay
    inside their package); `from pkg import name` names `pkg.name` where that is a module.
    `top_level_only`: only the imports that run when the module is imported (not those inside
    functions, nor under `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = _module_level(tree.body) if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append(sub if _is_module(sub) else node.module)
    return out


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    out = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            out += _module_level(node.body + getattr(node, "orelse", []))
            out += _module_level([s for h in getattr(node, "handlers", []) for s in h.body])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
    return out


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _role(path: Path) -> str:
    """The role of a file under training/: its package (training/merge/rules.py: merge), or its
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
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of a directed graph (one per strongly connected component of more than one
    node, or a node importing itself), each as a sorted list of its members."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_level_import_cycle_in_training():
    """A module's import-time imports never lead back to it (a package's own `__init__` is not
    counted as imported by its submodules: Python initialises it first)."""
    graph = {}
    for path in _files("training"):
        name = _module_name(path)
        graph[name] = {
            m
            for m in _imports(path, top_level_only=True)
            if m.startswith("training.") and m != name
        }
    assert _cycles(graph) == []


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
