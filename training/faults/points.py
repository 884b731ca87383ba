"""Named fault points: where chaos tests and chaos mode kill a process on purpose.

`DILOCO_FAULTS="point@n,point2@m"` makes the process SIGKILL itself the n-th time (1-based) it
reaches `point`. A killed process gets no chance to clean up, exactly like a preempted VM. Points:

    island.step                 after an inner step (n counts steps of this process)
    pseudograd.payload-written  payload stored, commit marker not yet written
    pseudograd.committed        commit marker written (the island's checkpoint not yet)
    checkpoint.mid-state        an island checkpoint's first chunk of state written, the rest not
    checkpoint.before-latest    an island checkpoint's state and meta written, LATEST.json not yet
    global.payload-written      new global version's tensors stored, manifest not yet
    global.before-cas           manifest written, HEAD not yet swapped
    global.after-cas            HEAD swapped, ledger not yet written
    ledger.partial              one ledger entry of several written
    merge.after-read            merger read its inputs, computed nothing yet
    light.before-manifest       a light version's params and update stored, manifest not yet
    merge.cold-replay           a cold-starting merger re-derived one light version
    light.before-promotion      a light version's promoted payloads stored, full.json not yet

A process's fault points are one `FaultPlan` object, handed over by its entry point and never
looked up on the way: the island takes it (`Island(..., faults=plan)`), the `ExperimentStore`
carries it (`ExperimentStore(..., faults=plan)`), the merger uses its store's. Only the entry
points call `FaultPlan.from_env`, DILOCO_FAULTS's one reader: `diloco island`, `diloco merge`,
the WAN bench's island process, the Airflow tasks that merge (shard tasks, `finalize`). Chaos mode's merge kill adds its
point to that plan (`training.faults.chaos.arm_merge_kill` returns the plan to use). Simulators
and tests build plans themselves, or none: a store or island without a plan runs no fault code.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping

FAULTS_ENV = "DILOCO_FAULTS"
"""The environment variable naming this process's fault points (read by `FaultPlan.from_env`
only)."""


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

    def __repr__(self) -> str:
        return f"FaultPlan({self.plan!r})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
        """The plan DILOCO_FAULTS names, or None when it names none. The only reader of the
        variable: entry points call it once and hand the plan over."""
        plan = parse_plan((os.environ if environ is None else environ).get(FAULTS_ENV, ""))
        return cls(plan) if plan else None

    def with_point(self, point: str, nth: int = 1) -> FaultPlan:
        """A new plan: this one with `point` planned at visit `nth` instead (visits already
        counted still count)."""
        if nth < 1:
            raise ValueError(f"fault {point}@{nth}: the visit count must be >= 1")
        plan = FaultPlan({**self.plan, point: nth})
        with self._lock:
            plan._counts = dict(self._counts)
        return plan

    def hit(self, point: str) -> None:
        """Count a visit of `point`; SIGKILL this process at its planned visit."""
        nth = self.plan.get(point)
        if nth is None:
            return
        with self._lock:
            self._counts[point] = count = self._counts.get(point, 0) + 1
        if count == nth:
            os.kill(os.getpid(), signal.SIGKILL)
