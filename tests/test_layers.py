"""Imports go one way (docs/DESIGN.md, "Layers"): dags -> plugins -> training (devtools beside
dags, above plugins); inside training, only the benchmarks and the cli's bench command import
training.bench. No jax under dags/, and none when the plugins and the DAG files are imported
(the dag-processor and the triggerer import them).

A failure names the file and the import that goes the wrong way: move the code to the layer it
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
    "training": {"diloco_airflow", "dags", "devtools", "airflow"},
    "plugins": {"dags", "devtools"},
    "dags": {"devtools", "jax", "flax", "optax"},
}
BENCH_USERS = {"training/cli.py"}  # the `diloco bench` command dispatches to the benchmarks


def _imports(path: Path) -> list[str]:
    """Every module an import statement of `path` names (absolute imports; relative ones stay
    inside their package)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_layer_imports_a_layer_above_it():
    wrong = []
    for layer, banned in FORBIDDEN.items():
        for path in _files(layer):
            for module in _imports(path):
                if module.split(".")[0] in banned:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_nothing_in_training_but_the_bench_and_its_command_imports_training_bench():
    wrong = []
    for path in _files("training"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("training/bench/") or rel in BENCH_USERS:
            continue
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
