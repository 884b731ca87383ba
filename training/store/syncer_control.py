"""The syncer's control objects and their I/O: a merge shard's lease, the marker that a DAG run's
islands ended, the claim of the experiment's one finalize (docs/STORE.md, "The syncer's
objects"; records: training/store/syncer_records.py; names: training/store/keys.py).

The syncer (training/merge/syncer.py) decides; these methods read and write. A lease is read with
its generation and written only by compare-and-swap; an object at a lease's name that is not a
lease counts as a free lease (taken over by the next swap), one too large to read is deleted by
the syncer that finds it. The run marker is overwritten by a repeat; the finalize claim is
create-only and read bounded.

A mixin of `ExperimentStore` (training/store/experiment.py): `self.store` is the object store,
`self.experiment` the experiment's prefix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from training.store.keys import FINALIZED, lease_key, run_marker_key
from training.store.objectstore import CorruptObject, ObjectStore
from training.store.safejson import FINALIZED as CLAIM_LIMITS
from training.store.safejson import LEASE
from training.store.syncer_records import (
    BadLease,
    Lease,
    finalized_record,
    lease_record,
    parse_finalized,
    parse_lease,
    run_marker_record,
)

log = logging.getLogger("diloco.syncer")

UNREADABLE_CLAIM = "(an unreadable claim)"
"""What `claim_finalize` names as the holder of a claim that does not parse."""


class SyncerControl:
    store: ObjectStore
    experiment: str

    def _lease_key(self, shard: int) -> str:
        return f"{self.experiment}/{lease_key(shard)}"

    def read_lease(self, shard: int) -> tuple[Lease | None, Any]:
        """(shard `shard`'s lease or None, its generation or None when absent). An object there
        that `parse_lease` refuses (broken, hostile) counts as a free lease: (None, its
        generation), so that a syncer takes it over by compare-and-swap. ObjectTooLarge past
        the lease's size cap (read no further)."""
        key = self._lease_key(shard)
        got = self.store.read_versioned(key, max_bytes=LEASE.max_bytes)
        if got is None:
            return None, None
        data, generation = got
        try:
            return parse_lease(data), generation
        except BadLease as exc:
            log.warning("%s: %s: counted as a free lease", key, exc)
            return None, generation

    def swap_lease(self, shard: int, lease: Lease, generation: Any) -> bool:
        """Write `lease` as shard `shard`'s if its lease is still at `generation` (None: absent);
        False on a lost race."""
        return self.store.compare_and_swap(self._lease_key(shard), lease_record(lease), generation)

    def drop_lease(self, shard: int) -> None:
        """Delete whatever is at shard `shard`'s lease (an object too large to be a lease)."""
        self.store.delete(self._lease_key(shard))

    def mark_run_ended(self, run_id: str, islands: Iterable[str]) -> None:
        """Record that the island tasks of DAG run `run_id` are over (its syncer shards may
        end): `run_marker_record` at `run_marker_key(run_id)` (overwritten by a repeat)."""
        data = run_marker_record(run_id, time.time(), islands)
        self.store.write(f"{self.experiment}/{run_marker_key(run_id)}", data)

    def run_ended(self, run_id: str | None) -> bool:
        """Whether DAG run `run_id`'s islands ended: its marker exists (its content is for people
        and tools: `syncer_records.parse_run_marker`)."""
        if not run_id:
            return False
        return self.store.exists(f"{self.experiment}/{run_marker_key(run_id)}")

    def claim_finalize(self, run_id: str) -> str | None:
        """Claim the experiment's one finalize for DAG run `run_id`: a create-only write of
        `control/finalized.json`. None when the claim is this run's (new, or a retry of the same
        run); else the run id that holds it (its finalize ran: do not evaluate or restore
        again), `UNREADABLE_CLAIM` for a claim that does not read."""
        key = f"{self.experiment}/{FINALIZED}"
        if self.store.create(key, finalized_record(run_id, time.time())):
            return None
        try:  # bounded before it is read: a claim is a run id and a time
            holder = parse_finalized(self.store.read(key, max_bytes=CLAIM_LIMITS.max_bytes)).run_id
        except CorruptObject as err:  # ObjectTooLarge, BadFinalized: held, by whom unknown
            log.warning("%s: %s: a finalize claim that does not read holds it", key, err)
            return UNREADABLE_CLAIM
        return None if holder == run_id else holder
