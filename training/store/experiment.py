"""One experiment's layout on an object store and the publish / merge protocol.

The contract (what "committed" means, what a retry may repeat, how exactly-once is kept) is in
docs/STORE.md. In short: payloads go to unique names first, a small marker written last commits
them, readers ignore anything without its marker, each fragment's HEAD advances only by compare-
and-swap, and the ledger of applied pseudo-gradients is create-only. The named fault points
(training/faults/points.py) sit between those steps so chaos tests can kill a process there: a
store built with `faults=` (the process's `FaultPlan`, from its entry point) calls its `hit`
at each; a store without one runs no fault code.

This module holds the I/O helpers and the config; pseudo-gradients, the ledger and the
quarantine are in training/store/contributions.py, heartbeats, checkpoints, metrics and control
in island_objects.py, the per-fragment version chains in versions.py, snapshots in snapshots.py,
promotions of light versions in promotions.py, garbage collection in gc.py, the syncer's leases,
run markers and finalize claim in syncer_control.py, names in keys.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from training.config.experiment import (
    ConfigError,
    ExperimentConfig,
    parse_config,
    without_retired_fields,
)
from training.config.names import validate_name
from training.store import island_records, safejson
from training.store.commit import Commit, CommitPoints
from training.store.contributions import Contributions
from training.store.gc import GarbageCollection, GCPlan
from training.store.island_objects import IslandObjects
from training.store.keys import ObjectName, SkipTally, parse_key_or_none
from training.store.layout import (
    ANY,
    LAYOUT_VERSION,
    DoubleApply,
    ExperimentExists,
    FragmentVersion,
    HeadPointer,
    PseudoGradRef,
    Snapshot,
    dump_json,
    load_json,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import CorruptObject, ObjectNotFound, ObjectStore, StoreError
from training.store.promotions import Promotions
from training.store.record_fields import is_int
from training.store.safejson import JSONLimits
from training.store.snapshots import Snapshots
from training.store.syncer_control import SyncerControl
from training.store.tensors import MAX_HEADER_BYTES, Checksum, decode_tensors
from training.store.versions import FragmentVersions

__all__ = [
    "DoubleApply",
    "ExperimentExists",
    "ExperimentStore",
    "FragmentVersion",
    "GCPlan",
    "HeadPointer",
    "LayoutMismatch",
    "PseudoGradRef",
    "Snapshot",
    "dump_json",
    "load_json",
    "parse_pseudograd_id",
    "pseudograd_id",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class LayoutMismatch(StoreError):
    """config.json records another store layout than the one this code reads."""


class FaultPoints(Protocol):
    """What a store calls at its named fault points: `training.faults.points.FaultPlan` (the
    store does not import it: faults sit above the store)."""

    def hit(self, point: str) -> None: ...


class ExperimentStore(
    Contributions,
    FragmentVersions,
    Snapshots,
    Promotions,
    GarbageCollection,
    IslandObjects,
    SyncerControl,
):
    """The objects of one experiment under `<store root>/<experiment>/` (layout: docs/STORE.md).

    Every method is safe to call from several threads and processes at once; every write is safe
    to repeat after a crash (see "What a retry may repeat" in docs/STORE.md).
    """

    CONFIG = "config.json"
    STOP = "control/STOP"

    def __init__(
        self,
        store: ObjectStore,
        experiment: str,
        max_workers: int = 16,
        faults: FaultPoints | None = None,
    ):
        self.store = store
        self.experiment = validate_name("experiment", experiment)
        self.max_workers = max_workers
        self.faults = faults  # the process's fault points (training/faults/points.py), or None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self.skipped = SkipTally()  # objects readers skipped (junk names, broken records)

    @property
    def url(self) -> str:
        return f"{self.store.url}/{self.experiment}"

    def __repr__(self) -> str:
        return f"ExperimentStore({self.url!r})"

    def with_faults(self, faults: FaultPoints | None) -> ExperimentStore:
        """The same experiment on the same object store, with the fault points `faults`."""
        return ExperimentStore(self.store, self.experiment, self.max_workers, faults)

    def hit_fault(self, point: str) -> None:
        """A named fault point (training/faults/points.py): this store's plan, if any, may
        SIGKILL the process here. The merger's `merge.after-read` goes through it too."""
        if self.faults is not None:
            self.faults.hit(point)

    def commit(self, points: CommitPoints) -> Commit:
        """A new commit of `points`' kind (training/store/commit.py) under this experiment's
        root, passing its fault points through `hit_fault`."""
        return Commit(self.store, points, self.hit_fault, self.object_key(""))

    # low-level helpers (public: the mixins and a few tests use them) ------------------------
    def object_key(self, relative: str) -> str:
        """The object store key of `relative` (a path under the experiment's root)."""
        return f"{self.experiment}/{relative}"

    def read_json(self, relative: str, limits: JSONLimits = ANY) -> dict[str, Any]:
        """The JSON object at `relative`, read and parsed under `limits` (safejson: bounded,
        strict); ObjectNotFound, or CorruptObject naming the object."""
        data = self.store.read(self.object_key(relative), max_bytes=limits.max_bytes)
        return load_json(data, f"{self.url}/{relative}", limits)

    def read_json_or_none(self, relative: str, limits: JSONLimits = ANY) -> dict[str, Any] | None:
        """`read_json`, or None when the object does not exist."""
        try:
            return self.read_json(relative, limits)
        except ObjectNotFound:
            return None

    def note_skipped(self, relative: str, reason: Any) -> None:
        """Count an object no contribution is to blame for, and go on (docs/STORE.md,
        "Threat model")."""
        self.skipped.note(relative, str(reason))
        log.warning("skipped %s/%s: %s", self.url, relative, reason)

    def parse_listed(self, relative: str) -> ObjectName | None:
        """keys.parse_key of a listed name; a name outside the layout is skipped and counted."""
        name = parse_key_or_none(relative)
        if name is None:
            self.note_skipped(relative, "not a name of the layout")
        return name

    def list_named(
        self, relative_prefix: str, kind: str, start_after: str | None = None
    ) -> list[ObjectName]:
        """Parsed names of kind `kind` under a prefix (after `start_after`); names outside the
        layout are skipped and counted (names of other kinds, e.g. payloads next to markers,
        are left alone)."""
        names = []
        for relative in self.list_keys(relative_prefix, start_after):
            name = self.parse_listed(relative)
            if name is not None and name.kind == kind:
                names.append(name)
        return names

    def write_json(self, relative: str, obj: Any) -> None:
        """Write `obj` at `relative` as the store's canonical JSON (dump_json), overwriting."""
        self.store.write(self.object_key(relative), dump_json(obj))

    def create_json(self, relative: str, obj: Any) -> bool:
        """Create `relative` holding `obj` (dump_json) if it does not exist: True if this call
        created it, False if it existed (create-only: the first writer wins)."""
        return self.store.create(self.object_key(relative), dump_json(obj))

    def sizes(self) -> dict[str, int]:
        """Key relative to the experiment root -> bytes, for every object of the experiment
        (one listing with sizes: `ObjectStore.sizes`)."""
        root = self.object_key("")
        return {k[len(root) :]: n for k, n in self.store.sizes(root).items()}

    def list_keys(self, relative_prefix: str, start_after: str | None = None) -> list[str]:
        """Keys under `relative_prefix` (after `start_after`), relative to the experiment root."""
        root = self.object_key("")
        after = None if start_after is None else root + start_after
        return [k[len(root) :] for k in self.store.list(root + relative_prefix, after)]

    def parallel(self, fn: Callable[[str], T], items: Sequence[str]) -> list[T]:
        """map(fn, items) on a thread pool (object stores are latency bound); keeps order."""
        if len(items) <= 2 or self.max_workers <= 1:
            return [fn(item) for item in items]
        with self._pool_lock:
            # Kept between calls (its threads keep their store clients and connections), but
            # never across a fork: a forked child has the pool object without its threads.
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="store")
                self._pool_pid = os.getpid()
            pool = self._pool
        return list(pool.map(fn, items))

    def read_many(
        self, relatives: Sequence[str], max_bytes: int | None = None
    ) -> list[bytes | CorruptObject | None]:
        """Contents of many objects: None for one deleted since it was listed, the
        CorruptObject (ObjectTooLarge) for one over `max_bytes`."""

        def read(relative: str) -> bytes | CorruptObject | None:
            try:
                return self.store.read(self.object_key(relative), max_bytes=max_bytes)
            except ObjectNotFound:
                return None
            except CorruptObject as exc:
                return exc

        return self.parallel(read, relatives)

    def read_records(
        self, relatives: Sequence[str], limit: int, parse: Callable[[bytes, str], T]
    ) -> list[tuple[str, T]]:
        """(relative, parse(bytes, relative)) of many objects read with `limit`; deleted ones
        are left out, unreadable ones skipped and counted."""
        out = []
        for relative, data in zip(relatives, self.read_many(relatives, limit), strict=True):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                out.append((relative, parse(data, relative)))
            except CorruptObject as exc:
                self.note_skipped(relative, exc)
        return out

    def read_verified_tensors(
        self,
        relative: str,
        digest: Any,
        nbytes: Any,
        what: str,
        copy: bool = True,
        max_header: int = MAX_HEADER_BYTES,
        into: Callable[[int], memoryview] | None = None,
    ) -> dict[str, np.ndarray]:
        """Read a payload (never more than the manifest's `nbytes`), check its size and its
        checksum `digest` ((algorithm, hex), record_fields.checksum_field) against the manifest,
        decode it (a header of at most `max_header` bytes). The arrays are views into the one
        buffer read: writable (copy=True: nothing else holds it) or read-only (copy=False).
        The checksum is computed over the buffer's pieces as the store hands them over (on
        gs://, while the later parts of a large payload still download). `into`: where the
        store reads the bytes (a pool's buffers: ObjectStore.read_buffer)."""
        if not is_int(nbytes) or nbytes < 0:
            raise CorruptObject(f"{what}: invalid nbytes {safejson.show(nbytes)}")
        algorithm, expected = digest
        hasher = Checksum(algorithm)
        try:
            data = self.store.read_buffer(
                self.object_key(relative),
                max_bytes=nbytes,
                writable=copy,
                consume=hasher.update,
                into=into,
            )
        except ObjectNotFound:
            raise CorruptObject(f"{what}: payload {relative} is missing") from None
        except CorruptObject as exc:
            raise CorruptObject(f"{what}: {exc}") from None
        if len(data) != nbytes:
            raise CorruptObject(f"{what}: payload {relative} has {len(data)} bytes, not {nbytes}")
        if hasher.hexdigest() != expected:
            raise CorruptObject(f"{what}: payload {relative} fails its {algorithm} checksum")
        view = data if copy else data.toreadonly()  # copy=True: nothing else holds `data`
        return decode_tensors(view, copy=False, max_header_bytes=max_header)[0]

    # config --------------------------------------------------------------------------------
    def write_config(self, cfg: Mapping[str, Any]) -> None:
        """Create config.json (recording `layout`). Re-creating it with equal content (the
        stored one's retired fields aside: `without_retired_fields`) is a no-op; different
        content raises ExperimentExists (a name is never reused)."""
        data = dump_json({**dict(cfg), "layout": LAYOUT_VERSION})
        if self.store.create(self.object_key(self.CONFIG), data):
            return
        existing = without_retired_fields(self.read_json(self.CONFIG, safejson.CONFIG))
        if existing != json.loads(data):
            raise ExperimentExists(
                f"{self.url} exists with a different config.json; pick a new experiment name"
            )

    def read_config(self) -> dict[str, Any]:
        """config.json without its `layout` key and retired fields (parse_config_record);
        ObjectNotFound if the experiment has none,
        BadConfigRecord if it is not a JSON object naming this experiment, LayoutMismatch if it
        was written for another store layout."""
        data = self.store.read(self.object_key(self.CONFIG), max_bytes=safejson.CONFIG.max_bytes)
        cfg = island_records.parse_config_record(data, self.experiment)
        layout = cfg.pop("layout", 1)
        if layout != LAYOUT_VERSION:
            raise LayoutMismatch(
                f"{self.url} uses store layout {layout!r}; this version reads layout "
                f"{LAYOUT_VERSION} only (start a new experiment, or use the release that wrote it)"
            )
        return cfg

    def config(self) -> ExperimentConfig:
        """config.json read (read_config) and validated (parse_config): the one place a
        caller gets the experiment's typed config from the store. Read afresh each call
        (joins add islands to it by compare-and-swap). ConfigError, one line naming the
        object, when the stored config does not validate: a model section beyond the sizes
        any reader builds (ModelConfig.bounded_dims) among them, refused before an island or
        merger builds anything from it."""
        try:
            return parse_config(self.read_config())
        except ConfigError as exc:
            raise ConfigError(f"{self.url}/{self.CONFIG}: {exc}") from None

    def update_config(
        self, change: Callable[[dict[str, Any]], dict[str, Any]], attempts: int = 20
    ) -> dict[str, Any]:
        """Read-modify-write config.json by compare-and-swap on its generation.

        `change(current)` returns the new config (or `current` itself: nothing is written); it
        is called again on the fresh config when another writer changed it in between. Returns
        the config as written. ObjectNotFound if the experiment has no config. The store
        decides nothing here: a join passes the config's join rule as `change`
        (`training.usecases.create.add_islands`).
        """
        key = self.object_key(self.CONFIG)
        for attempt in range(attempts):
            got = self.store.read_versioned(key, max_bytes=safejson.CONFIG.max_bytes)
            if got is None:
                raise ObjectNotFound(f"{self.url}/{self.CONFIG} does not exist")
            data, generation = got
            current = island_records.parse_config_record(data, self.experiment)
            layout = current.pop("layout", 1)
            if layout != LAYOUT_VERSION:
                raise LayoutMismatch(
                    f"{self.url} uses store layout {layout!r}, not {LAYOUT_VERSION}"
                )
            new = change(json.loads(dump_json(current)))
            if new == current:
                return current
            stored = {**new, "layout": LAYOUT_VERSION}
            if self.store.compare_and_swap(key, dump_json(stored), generation):
                return json.loads(dump_json(new))
            time.sleep(min(1.0, 0.05 * 2**attempt))
        raise StoreError(f"{self.url}/{self.CONFIG} kept changing: gave up after {attempts} tries")
