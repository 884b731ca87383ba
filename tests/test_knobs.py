"""The environment knobs: every DILOCO_* name the code reads or sets is declared once."""

from __future__ import annotations

import re
from pathlib import Path

from diloco_airflow import knobs
from diloco_airflow.backends import BACKENDS
from diloco_airflow.backends.registry import _CLASSES

from training.codecs.native import NATIVE_ENV
from training.faults.points import FAULTS_ENV

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bDILOCO_[A-Z][A-Z0-9_]*\b")
NOT_VARIABLES = {"DILOCO_RUNNER_EOF", "DILOCO_SETTINGS"}  # a heredoc marker, a Python constant


def test_every_diloco_variable_in_the_code_is_declared_in_knobs():
    declared = {k.name for k in knobs.KNOBS} | set(knobs.ISLAND_ENV) | {FAULTS_ENV, NATIVE_ENV}
    used = set()
    for folder in ("training", "plugins", "dags", "devtools"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(NAME.findall(path.read_text()))
    assert used - NOT_VARIABLES - declared == set()


def test_no_module_reads_a_diloco_variable_by_its_literal_name():
    readers = []
    for folder in ("training", "plugins", "dags", "devtools"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if re.search(r"environ(\.get)?\(?\[?[\"']DILOCO_", text) or re.search(
                r"getenv\([\"']DILOCO_", text
            ):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == []


def test_a_knob_reads_its_default_when_unset_or_empty_and_parses_a_value():
    assert knobs.ISLAND_RETRIES.get({}) == 5
    assert knobs.ISLAND_RETRIES.get({"DILOCO_ISLAND_RETRIES": ""}) == 5
    assert knobs.ISLAND_RETRIES.get({"DILOCO_ISLAND_RETRIES": "7"}) == 7
    assert knobs.GC_DRY_RUN.get({"DILOCO_GC_DRY_RUN": "yes"}) is True


def test_the_backend_registry_knows_exactly_the_configs_backends():
    assert tuple(_CLASSES) == BACKENDS
