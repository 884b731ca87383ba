"""Fault points as an object: parsed once, handed to the island, killing at the planned visit."""

import subprocess
import sys

import pytest

from training.faults.points import FaultPlan, parse_plan


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
