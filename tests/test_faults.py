"""Fault points as an object: parsed once by the entry point, handed to the island and the store
(the merger uses its store's), killing at the planned visit; nothing else reads DILOCO_FAULTS."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.faults.points import FAULTS_ENV, FaultPlan, parse_plan
from training.merge.merger import Merger

ROOT = Path(__file__).resolve().parents[1]
MERGE_POINTS = [
    "merge.after-read",
    "global.payload-written",
    "global.before-cas",
    "global.after-cas",
    "ledger.partial",
]


class Recorder(FaultPlan):
    """A plan that records every visit (and kills nobody: it plans no point)."""

    def __init__(self):
        super().__init__({})
        self.visits: list[str] = []

    def hit(self, point: str) -> None:
        self.visits.append(point)
        super().hit(point)


def test_a_plan_is_parsed_once_from_the_environment():
    assert FaultPlan.from_env({}) is None
    assert FaultPlan.from_env({"DILOCO_FAULTS": " , "}) is None
    assert FaultPlan.from_env({"DILOCO_FAULTS": "island.step@3,x"}).plan == {
        "island.step": 3,
        "x": 1,
    }
    with pytest.raises(ValueError):
        parse_plan("island.step@0")


def test_a_plan_kills_the_process_at_the_planned_visit():
    code = (
        "from training.faults.points import FaultPlan\n"
        "plan = FaultPlan({'x': 2})\n"
        "plan.hit('y'); plan.hit('x'); print('first', flush=True); plan.hit('x'); print('second')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (-9, "first\n")


def test_a_point_added_to_a_plan_keeps_the_visits_already_counted():
    code = (
        "from training.faults.points import FaultPlan\n"
        "plan = FaultPlan({'x': 3, 'y': 9}); plan.hit('x')\n"
        "armed = plan.with_point('x', 2); print(armed.plan, plan.plan, flush=True)\n"
        "armed.hit('x'); print('after')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (-9, "{'x': 2, 'y': 9} {'x': 3, 'y': 9}\n")


def test_a_merge_visits_its_fault_points_in_order_through_its_stores_plan():
    cfg = small_config("seq", outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    for n, (island, seq) in enumerate([("a", 0), ("a", 1), ("b", 0)]):
        publish_delta(store, cfg, island, seq, random_delta(theta, n))
    plan = Recorder()
    results = Merger(cfg, store.with_faults(plan)).merge_all()
    assert [r.version for r in results] == [1, None]
    # one version of three contributions (so several ledger entries); then a pass that repairs
    # the new version's ledger entries (all there already) and finds nothing to merge
    assert plan.visits == [*MERGE_POINTS, "ledger.partial", "merge.after-read"]


def test_a_publish_visits_its_fault_point_through_the_stores_plan():
    cfg = small_config("pub")
    plan = Recorder()
    store = new_store(cfg).with_faults(plan)
    publish_delta(store, cfg, "a", 0, random_delta(store.load_params(), 0))
    assert plan.visits == ["pseudograd.payload-written", "pseudograd.committed"]


def test_a_store_without_a_plan_ignores_diloco_faults_in_the_environment(monkeypatch):
    """Every point planned in the environment, none in the store: nothing may kill."""
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setenv(FAULTS_ENV, ",".join(["pseudograd.payload-written", *MERGE_POINTS]))
    cfg = small_config("env", outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    for n, island in enumerate(("a", "b")):
        publish_delta(store, cfg, island, 0, random_delta(theta, n))
    assert Merger(cfg, store).merge_all()[0].version == 1
    assert kills == []


def _reads_of_the_variable(path: Path) -> list[str]:  # "file:line in scope", sorted
    """Where `path`'s code (docstrings aside) names DILOCO_FAULTS: the constant FAULTS_ENV or
    the literal string."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    scopes = {}  # node -> the innermost function or class around it (ast.walk: outer first)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for child in ast.walk(node):
                scopes[id(child)] = node.name
    out = set()
    for node in ast.walk(tree):
        named = (isinstance(node, ast.Name) and node.id == "FAULTS_ENV") or (
            isinstance(node, ast.Attribute) and node.attr == "FAULTS_ENV"
        )
        literal = (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and FAULTS_ENV in node.value
            and id(node) not in docstrings
        )
        if named or literal:
            rel = path.relative_to(ROOT)
            out.add(f"{rel}:{node.lineno} in {scopes.get(id(node), '<module>')}")
    return sorted(out)


def test_only_fault_plan_from_env_reads_diloco_faults():
    found = []
    for folder in ("training", "plugins", "dags", "devtools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += _reads_of_the_variable(path)
    assert found == [
        "training/faults/points.py:36 in <module>",  # FAULTS_ENV = "DILOCO_FAULTS"
        "training/faults/points.py:67 in from_env",
    ]
