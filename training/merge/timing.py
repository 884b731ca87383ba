"""Where one merge's time goes: seconds per named stage, for the merge's metrics and the merge
benchmark (training/bench/merge.py, docs/BENCHMARKS.md "Merge at the real size").

The stages of a merge, in order: `state` (the fragment's arrays: kept warm, read back, or
replayed from a promotion or full version), `read` (the contributions' payloads: downloaded,
checksummed, or waited for when fetched ahead), `norms` (each contribution checked and its
norms taken from its codes), `fold` (the votes folded into the accumulators, with the
averaging step's norm), `outer` (the outer step, with the new params' norm and, where the C loops
take them, the broadcast update's codes and the new shadow made in the same pass), `encode`
(the rest of the version's payloads: the update's tensors the outer step did not encode), `write` (checksums, payloads,
manifest, HEAD and ledger).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGES = ("state", "read", "norms", "fold", "outer", "encode", "write")


class Stages:
    """Seconds per stage, added up over a merge (`with stages("fold"): ...`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
