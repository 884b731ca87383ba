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
"""

from __future__ import annotations

import os
import signal

FAULTS_ENV = "DILOCO_FAULTS"
"""The environment variable naming this process's fault points (read here only)."""

_counts: dict[str, int] = {}


def _plan() -> dict[str, int]:
    plan = {}
    for item in filter(None, os.environ.get(FAULTS_ENV, "").split(",")):
        point, _, nth = item.strip().partition("@")
        plan[point] = int(nth or 1)
    return plan


def fault_point(point: str) -> None:
    """SIGKILL this process if DILOCO_FAULTS asks for it at this visit of `point`."""
    plan = _plan()
    if point not in plan:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == plan[point]:
        os.kill(os.getpid(), signal.SIGKILL)
