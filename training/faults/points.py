"""Named fault points: where chaos tests and chaos mode kill a process on purpose.

`DILOCO_FAULTS="point@n,point2@m"` makes the process SIGKILL itself the n-th time (1-based) it
reaches `point`. A killed process gets no chance to clean up, exactly like a preempted VM. Points:

    island.step                 after an inner step (n counts steps of this process)
    pseudograd.payload-written  payload stored, commit marker not yet written
    global.payload-written      new global version's tensors stored, manifest not yet
    global.before-cas           manifest written, HEAD not yet swapped
    global.after-cas            HEAD swapped, ledger not yet written
    ledger.partial              one ledger entry of several written
    merge.after-read            merger read its inputs, computed nothing yet

The island's per-step point is a `FaultPlan` object its entry point hands to it
(`FaultPlan.from_env()` in `diloco island`; none in simulators and tests: nothing is looked up
on a step). The store and merge points go through `fault_point`, which follows DILOCO_FAULTS
as it is when they are reached (a merge process arms itself by setting it: chaos.py), parsing
it again only when it changed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping

FAULTS_ENV = "DILOCO_FAULTS"
"""The environment variable naming this process's fault points (read here only)."""


def parse_plan(text: str) -> dict[str, int]:
    """ "point@n,point2" -> {point: n, point2: 1}; ValueError on a bad count."""
    plan = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        point, _, nth = item.partition("@")
        plan[point] = int(nth or 1)
        if plan[point] < 1:
            raise ValueError(f"fault {item!r}: the visit count must be >= 1")
    return plan


class FaultPlan:
    """Named fault points of one process: `hit(point)` SIGKILLs it at the planned visit."""

    def __init__(self, plan: Mapping[str, int]):
        self.plan = dict(plan)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
        """The plan DILOCO_FAULTS names, or None when it names none."""
        plan = parse_plan((os.environ if environ is None else environ).get(FAULTS_ENV, ""))
        return cls(plan) if plan else None

    def hit(self, point: str) -> None:
        """Count a visit of `point`; SIGKILL this process at its planned visit."""
        nth = self.plan.get(point)
        if nth is None:
            return
        with self._lock:
            self._counts[point] = count = self._counts.get(point, 0) + 1
        if count == nth:
            os.kill(os.getpid(), signal.SIGKILL)


_env_plan: tuple[str, FaultPlan] = ("", FaultPlan({}))


def fault_point(point: str) -> None:
    """SIGKILL this process if DILOCO_FAULTS asks for it at this visit of `point`."""
    global _env_plan
    text = os.environ.get(FAULTS_ENV, "")
    if text != _env_plan[0]:
        previous = _env_plan[1]
        plan = FaultPlan(parse_plan(text))
        plan._counts = dict(previous._counts)  # visits already made still count
        _env_plan = (text, plan)
    _env_plan[1].hit(point)
