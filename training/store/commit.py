"""The store's one commit: payloads, then a create-only marker, then a pointer.

An object store has no atomic rename of a directory, so a commit of several objects is made
visible by one small object written after everything it vouches for (as orbax's
`atomicity.py` finalizes a checkpoint with a commit file where renames are not atomic). Every
commit of an experiment goes through `Commit` (docs/STORE.md, "The commit"):

    commit            payloads                        marker (create-only)  pointer
    pseudo-gradient   {id}-{uuid8}.safetensors        {id}.json             -
    fragment version  v{n}-{uuid8}/*.safetensors      manifest.json         HEAD.json (CAS)
    promotion         full.*.safetensors              full.json             -
    checkpoint        state.safetensors, meta.json    -                     LATEST.json (1 writer)
    FINAL             -                               FINAL.json            -
    BEST              -                               -                     BEST.json (CAS)

The steps, always in this order; each may be left out, none may come back (`CommitOrder`):

1. **Payloads** (`write`, `write_parts`, `write_stream`), under names no other commit writes
   different bytes to (a fresh uuid8; a promotion's names hold what any promoter would write).
   A reader may assume nothing of a payload: without its marker it is an orphan, never read,
   collected by garbage collection (or deleted by its writer when its marker lost).
2. **The marker** (`mark`): one create-only object, the commit point. True: this commit made
   it. False: another writer's marker was there first and stands; this commit's payloads are
   orphans. Once the marker exists, a reader may assume every payload it names is whole: the
   marker is written only after every payload write returned.
3. **The pointer**: `swap` compare-and-swaps it from a generation the caller read (None: it
   must not exist) and reports a lost race (None): the marked objects then stay an
   unreferenced orphan. `repoint` overwrites a pointer that has one writer (an island's
   LATEST.json). Once the pointer names the commit, a reader going through the pointer finds
   the commit whole (and marked, where it has a marker); objects no pointer names (a lost race, a crash before the pointer)
   are ignored by such readers. A commit with a pointer and no marker (a checkpoint) has the
   pointer as its commit point.

So a process killed at any point leaves the whole commit or nothing a reader looks at.

**Fault points** (training/faults/points.py) are named once, here, per kind of commit
(`CommitPoints`): `payload_written` between the last payload and the marker (or the pointer),
`mid_payload` after the first chunk of a streamed payload, `committed` after a marker this commit
created, `before_pointer` and `after_pointer` around the pointer (the latter only when it moved).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from training.store.objectstore import Chunk, Generation, ObjectStore


class CommitOrder(RuntimeError):
    """A commit step out of order (a payload after the marker, a second marker or pointer): a
    bug in the caller, raised before anything is written."""


@dataclass(frozen=True)
class CommitPoints:
    """The fault points one kind of commit passes, by the moment (module docstring)."""

    payload_written: tuple[str, ...] = ()
    mid_payload: str | None = None
    committed: str | None = None
    before_pointer: str | None = None
    after_pointer: str | None = None


# The kinds of commit and their fault points: the only place the store names them.
PSEUDOGRAD = CommitPoints(
    payload_written=("pseudograd.payload-written",), committed="pseudograd.committed"
)
"""A pseudo-gradient: payload, then its manifest (training/store/contributions.py)."""
FULL_VERSION = CommitPoints(
    payload_written=("global.payload-written",),
    before_pointer="global.before-cas",
    after_pointer="global.after-cas",
)
"""A full fragment version: payloads, manifest.json, HEAD.json (training/store/versions.py)."""
LIGHT_VERSION = CommitPoints(
    payload_written=("global.payload-written", "light.before-manifest"),
    before_pointer="global.before-cas",
    after_pointer="global.after-cas",
)
"""A light fragment version: as a full one, `light.before-manifest` just before its manifest."""
PROMOTION = CommitPoints(payload_written=("light.before-promotion",))
"""A light version's promotion: full.*.safetensors, then full.json (promotions.py)."""
CHECKPOINT = CommitPoints(
    mid_payload="checkpoint.mid-state", before_pointer="checkpoint.before-latest"
)
"""An island checkpoint: state, meta.json, then LATEST.json (island_objects.py)."""
RECORD = CommitPoints()
"""A one-object commit (FINAL's marker, BEST's pointer: snapshots.py): no fault point."""

_PAYLOADS, _MARKED, _POINTED = range(3)


class Commit:
    """One commit of `points`' kind on `store`, its keys relative to `root` (an experiment's
    ``{experiment}/``): call the steps in order (module docstring). `hit` is called with each
    fault point the commit passes (`ExperimentStore.hit_fault`, a `FaultPlan`'s `hit`; None:
    no fault code runs). Not thread-safe: one commit, one writer thread."""

    def __init__(
        self,
        store: ObjectStore,
        points: CommitPoints,
        hit: Callable[[str], None] | None = None,
        root: str = "",
    ):
        self.store = store
        self.points = points
        self.hit = hit
        self.root = root
        self._step = _PAYLOADS

    def __repr__(self) -> str:
        return f"Commit({self.store.url}/{self.root}, {self.points})"

    def _hit(self, point: str | None) -> None:
        if point is not None and self.hit is not None:
            self.hit(point)

    def _key(self, relative: str) -> str:
        return f"{self.root}{relative}"

    def _enter(self, step: int, what: str) -> None:
        """Move to `step`; the payloads end at the first later step (their fault points)."""
        if (step == _PAYLOADS and self._step != _PAYLOADS) or (
            step != _PAYLOADS and self._step >= step
        ):
            done = ("marker", "pointer")[self._step - 1]
            raise CommitOrder(f"{self!r}: {what} after the {done}")
        if step != _PAYLOADS and self._step == _PAYLOADS:
            for point in self.points.payload_written:
                self._hit(point)
        self._step = step

    # 1. payloads --------------------------------------------------------------------------------
    def write(self, key: str, data: bytes) -> None:
        """A payload object of `data` (ObjectStore.write)."""
        self._enter(_PAYLOADS, f"payload {key}")
        self.store.write(self._key(key), data)

    def write_parts(self, key: str, parts: Sequence[Any]) -> None:
        """A payload object of the concatenation of `parts` (ObjectStore.write_parts)."""
        self._enter(_PAYLOADS, f"payload {key}")
        self.store.write_parts(self._key(key), parts)

    def write_stream(self, key: str, chunks: Callable[[], Iterable[Chunk]]) -> None:
        """A streamed payload object (ObjectStore.write_stream; every attempt passes the
        `mid_payload` point after its first chunk)."""
        self._enter(_PAYLOADS, f"payload {key}")

        def passing() -> Iterator[Chunk]:
            for i, chunk in enumerate(chunks()):
                yield chunk
                if i == 0:
                    self._hit(self.points.mid_payload)

        self.store.write_stream(self._key(key), passing)

    # 2. the marker ------------------------------------------------------------------------------
    def mark(self, key: str, data: bytes) -> bool:
        """Create the marker `key` (the commit point): True if this commit created it, False if
        another writer's was there (it stands)."""
        self._enter(_MARKED, f"marker {key}")
        created = self.store.create(self._key(key), data)
        if created:
            self._hit(self.points.committed)
        return created

    # 3. the pointer -----------------------------------------------------------------------------
    def swap(self, key: str, data: bytes, expected: Generation | None) -> Generation | None:
        """Compare-and-swap the pointer `key` from generation `expected` (None: absent) to
        `data`: its new generation, or None when another writer moved it first (lost race)."""
        self._enter(_POINTED, f"pointer {key}")
        self._hit(self.points.before_pointer)
        generation = self.store.compare_and_swap_generation(self._key(key), data, expected)
        if generation is not None:
            self._hit(self.points.after_pointer)
        return generation

    def repoint(self, key: str, data: bytes) -> None:
        """Overwrite the pointer `key`, which has one writer (an island's LATEST.json)."""
        self._enter(_POINTED, f"pointer {key}")
        self._hit(self.points.before_pointer)
        self.store.write(self._key(key), data)
        self._hit(self.points.after_pointer)
