"""One experiment's layout on an object store and the publish / merge protocol.

The contract (what "committed" means, what a retry may repeat, how exactly-once is kept) is in
docs/STORE.md. In short: payloads go to unique names first, a small marker written last commits
them, readers ignore anything without its marker, each fragment's HEAD advances only by compare-
and-swap, and the ledger of applied pseudo-gradients is create-only. The named fault points
(training/faults.py) sit between those steps so chaos tests can kill a process there.

This module holds the experiment's own objects (config, pseudo-gradients, ledger, quarantine,
heartbeats, checkpoints, metrics, control); the per-fragment version chains and snapshots are in
training/store/versions.py, garbage collection in training/store/gc.py, names in layout.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from training.faults import fault_point
from training.names import validate_name
from training.store.gc import GarbageCollection, GCPlan
from training.store.layout import (
    _LEDGER_ENTRY,
    _METRIC,
    _NAME_RE,
    _PER_ISLAND,
    _PG_MARKER,
    _PG_RESERVED,
    _QUARANTINE_ENTRY,
    LAYOUT_VERSION,
    DoubleApply,
    ExperimentExists,
    FragmentVersion,
    HeadPointer,
    PseudoGradRef,
    Snapshot,
    _is_int,
    _now,
    _unique_time_ns,
    _uuid8,
    dump_json,
    iso,
    load_json,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import CorruptObject, ObjectNotFound, ObjectStore, StoreError
from training.store.tensors import decode_tensors, encode_tensors, sha256
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


class ExperimentStore(FragmentVersions, GarbageCollection):
    """The objects of one experiment under `<store root>/<experiment>/` (layout: docs/STORE.md).

    Every method is safe to call from several threads and processes at once; every write is safe
    to repeat after a crash (see "What a retry may repeat" in docs/STORE.md).
    """

    CONFIG = "config.json"
    STOP = "control/STOP"

    def __init__(self, store: ObjectStore, experiment: str, max_workers: int = 16):
        self.store = store
        self.experiment = validate_name("experiment", experiment)
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"{self.store.url}/{self.experiment}"

    def __repr__(self) -> str:
        return f"ExperimentStore({self.url!r})"

    # low-level helpers ---------------------------------------------------------------------
    def _key(self, relative: str) -> str:
        return f"{self.experiment}/{relative}"

    def _read_json(self, relative: str) -> dict[str, Any]:
        return load_json(self.store.read(self._key(relative)), f"{self.url}/{relative}")

    def _read_json_or_none(self, relative: str) -> dict[str, Any] | None:
        try:
            return self._read_json(relative)
        except ObjectNotFound:
            return None

    def _write_json(self, relative: str, obj: Any) -> None:
        self.store.write(self._key(relative), dump_json(obj))

    def _create_json(self, relative: str, obj: Any) -> bool:
        return self.store.create(self._key(relative), dump_json(obj))

    def _list(self, relative_prefix: str, start_after: str | None = None) -> list[str]:
        """Keys under `relative_prefix` (after `start_after`), relative to the experiment root."""
        root = self._key("")
        after = None if start_after is None else root + start_after
        return [k[len(root) :] for k in self.store.list(root + relative_prefix, after)]

    def _parallel(self, fn: Callable[[str], T], items: Sequence[str]) -> list[T]:
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

    def _read_many(self, relatives: Sequence[str]) -> list[bytes | None]:
        """Contents of many objects (None for one deleted since it was listed)."""

        def read(relative: str) -> bytes | None:
            try:
                return self.store.read(self._key(relative))
            except ObjectNotFound:
                return None

        return self._parallel(read, relatives)

    def _verified_tensors(
        self, relative: str, digest: Any, nbytes: Any, what: str, copy: bool = True
    ) -> dict[str, np.ndarray]:
        """Read a payload, check its size and sha256 against the manifest, decode it."""
        try:
            data = self.store.read(self._key(relative))
        except ObjectNotFound:
            raise CorruptObject(f"{what}: payload {relative} is missing") from None
        if len(data) != nbytes:
            raise CorruptObject(f"{what}: payload {relative} has {len(data)} bytes, not {nbytes}")
        if sha256(data) != digest:
            raise CorruptObject(f"{what}: payload {relative} fails its sha256 check")
        return decode_tensors(data, copy=copy)[0]

    # config --------------------------------------------------------------------------------
    def write_config(self, cfg: Mapping[str, Any]) -> None:
        """Create config.json (recording `layout`). Re-creating it with equal content is a
        no-op; different content raises ExperimentExists (a name is never reused)."""
        data = dump_json({**dict(cfg), "layout": LAYOUT_VERSION})
        if self.store.create(self._key(self.CONFIG), data):
            return
        if self._read_json(self.CONFIG) != json.loads(data):
            raise ExperimentExists(
                f"{self.url} exists with a different config.json; pick a new experiment name"
            )

    def read_config(self) -> dict[str, Any]:
        """config.json without its `layout` key; ObjectNotFound if the experiment has none,
        LayoutMismatch if it was written for another store layout."""
        cfg = self._read_json(self.CONFIG)
        layout = cfg.pop("layout", 1)
        if layout != LAYOUT_VERSION:
            raise LayoutMismatch(
                f"{self.url} uses store layout {layout!r}; this version reads layout "
                f"{LAYOUT_VERSION} only (start a new experiment, or use the release that wrote it)"
            )
        return cfg

    def update_config(
        self, change: Callable[[dict[str, Any]], dict[str, Any]], attempts: int = 20
    ) -> dict[str, Any]:
        """Read-modify-write config.json by compare-and-swap on its generation.

        `change(current)` returns the new config (or `current` itself: nothing is written); it
        is called again on the fresh config when another writer changed it in between. Returns
        the config as written. ObjectNotFound if the experiment has no config.
        """
        key = self._key(self.CONFIG)
        for attempt in range(attempts):
            got = self.store.read_versioned(key)
            if got is None:
                raise ObjectNotFound(f"{self.url}/{self.CONFIG} does not exist")
            data, generation = got
            current = load_json(data, f"{self.url}/{self.CONFIG}")
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

    def add_islands(self, islands: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Join `islands` to the experiment: append them to config.json's island list.

        Nothing else in the config can change this way; `data.num_shards` stays fixed, so a
        joiner needs a free shard (the rule: `training.config.join_islands`, docs/STORE.md).
        Islands already in the config with the same settings are fine (a no-op); ConfigError
        otherwise. Compare-and-swap: racing joins both land. Returns the new config.
        """
        from training.config import join_islands

        wanted = [dict(i) for i in islands]
        return self.update_config(lambda current: join_islands(current, wanted))

    # pseudo-gradients ----------------------------------------------------------------------
    def _pg_ref(self, island: str, seq: int, fragment: int, manifest: dict[str, Any]):
        payload = manifest.get("payload")
        return PseudoGradRef(
            island=island,
            seq=seq,
            fragment=fragment,
            id=pseudograd_id(island, seq, fragment),
            manifest=manifest,
            payload_key=payload if isinstance(payload, str) else "",
        )

    def publish_pseudograd(
        self,
        island: str,
        seq: int,
        fragment: int,
        tensors: Mapping[str, np.ndarray],
        manifest: Mapping[str, Any] | None = None,
    ) -> PseudoGradRef:
        """Write the payload to a unique name, then create the manifest (the commit marker).

        The manifest gets experiment, island, seq, fragment, payload, nbytes, sha256 and
        created_at (`manifest` may not set them: ValueError). If the marker already exists (a
        retry after a crash, or a racing duplicate), the existing commit wins: its ref is
        returned and no second commit is made.
        """
        pg_id = pseudograd_id(island, seq, fragment)
        caller = dict(manifest or {})
        clash = sorted(_PG_RESERVED & caller.keys())
        if clash:
            raise ValueError(f"manifest may not set {clash}")
        stem = f"pseudograds/{pg_id}"
        existing = self._read_json_or_none(f"{stem}.json")
        if existing is not None:
            return self._pg_ref(island, seq, fragment, existing)

        data = encode_tensors(tensors)
        payload = f"{stem}-{_uuid8()}.safetensors"
        self.store.write(self._key(payload), data)
        fault_point("pseudograd.payload-written")
        full = {
            **caller,
            "experiment": self.experiment,
            "island": island,
            "seq": seq,
            "fragment": fragment,
            "payload": payload,
            "nbytes": len(data),
            "sha256": sha256(data),
            "created_at": _now(),
        }
        if self._create_json(f"{stem}.json", full):
            return self._pg_ref(island, seq, fragment, json.loads(dump_json(full)))
        # Someone committed this pseudo-gradient in between; theirs stands, ours is unreferenced.
        self.store.delete(self._key(payload))
        return self._pg_ref(island, seq, fragment, self._read_json(f"{stem}.json"))

    @staticmethod
    def _after_seq(folder: str, island: str, after_seq: int | None) -> str | None:
        """The listing offset that skips every object of `island` with seq <= after_seq."""
        return None if after_seq is None else f"{folder}/{island}/{after_seq:08d}~"

    def list_pseudograds(
        self,
        island: str | None = None,
        exclude: Collection[str] = (),
        after_seq: int | None = None,
    ) -> list[PseudoGradRef]:
        """Committed pseudo-gradients (those with a manifest), by (island, seq, fragment).

        Payloads without a manifest are ignored. Ids in `exclude` (e.g. applied or quarantined
        ones) are skipped without reading their manifests. `after_seq` (with `island`): only
        seqs above it, listed from there (a merger's cursor: the history is never re-listed).
        A manifest that is not valid JSON yields a ref with an empty manifest, which
        load_pseudograd rejects (so it can be quarantined rather than silently ignored).
        """
        if after_seq is not None and island is None:
            raise ValueError("after_seq needs an island")
        prefix = (
            "pseudograds/" if island is None else f"pseudograds/{validate_name('island', island)}/"
        )
        excluded = set(exclude)
        ids = []
        for relative in self._list(prefix, self._after_seq("pseudograds", island, after_seq)):
            match = _PG_MARKER.fullmatch(relative)
            if match is None or match[1] in excluded:
                continue
            # the offset relies on the 8-digit padding; this keeps the promise past 10^8
            if after_seq is None or parse_pseudograd_id(match[1])[1] > after_seq:
                ids.append(match[1])
        refs = []
        for pg_id, data in zip(
            ids, self._read_many([f"pseudograds/{i}.json" for i in ids]), strict=True
        ):
            if data is None:
                continue
            try:
                manifest = load_json(data, f"{self.url}/pseudograds/{pg_id}.json")
            except CorruptObject as exc:
                log.warning("%s", exc)
                manifest = {}
            refs.append(self._pg_ref(*parse_pseudograd_id(pg_id), manifest))
        return refs

    def load_pseudograd(self, ref: PseudoGradRef) -> dict[str, np.ndarray]:
        """The tensors of a committed pseudo-gradient, verified against its manifest.

        CorruptObject unless: the manifest names this experiment, island, seq and fragment; the
        payload key is `pseudograds/{island}/{seq:08d}-f{fragment:03d}-<8 hex>.safetensors`
        (so never outside this island's prefix); and the payload's size and sha256 match.
        """
        what = f"{self.url} pseudo-gradient {ref.id}"
        pg_id = pseudograd_id(ref.island, ref.seq, ref.fragment)
        m = ref.manifest
        if ref.id != pg_id or [m.get(k) for k in ("experiment", "island", "seq", "fragment")] != [
            self.experiment,
            ref.island,
            ref.seq,
            ref.fragment,
        ]:
            raise CorruptObject(f"{what}: manifest does not describe this pseudo-gradient")
        payload = m.get("payload")
        pattern = re.escape(f"pseudograds/{pg_id}-") + r"[0-9a-f]{8}\.safetensors"
        if not isinstance(payload, str) or re.fullmatch(pattern, payload) is None:
            raise CorruptObject(
                f"{what}: payload key {payload!r} is not inside pseudograds/{ref.island}/"
            )
        if payload != ref.payload_key:
            raise CorruptObject(f"{what}: ref payload_key {ref.payload_key!r} != manifest")
        # read-only views over the downloaded bytes: the merger decodes them, never mutates them
        return self._verified_tensors(payload, m.get("sha256"), m.get("nbytes"), what, copy=False)

    # ledger and quarantine -----------------------------------------------------------------
    def applied_ids(self) -> set[str]:
        """Ids of applied pseudo-gradients, from a listing only (no reads)."""
        return {m[1] for k in self._list("ledger/") if (m := _LEDGER_ENTRY.fullmatch(k))}

    def is_applied(self, pg_id: str) -> bool:
        """Whether `pg_id` has a ledger entry (one existence check, whatever the history)."""
        parse_pseudograd_id(pg_id)
        return self.store.exists(self._key(f"ledger/{pg_id}.json"))

    def applied(self) -> dict[str, int]:
        """pseudo-gradient id -> the version that applied it, from the ledger.

        An unreadable ledger entry raises CorruptObject (never guess about exactly-once).
        """
        ids = sorted(self.applied_ids())
        result: dict[str, int] = {}
        for pg_id, data in zip(
            ids, self._read_many([f"ledger/{i}.json" for i in ids]), strict=True
        ):
            if data is None:
                continue
            version = load_json(data, f"{self.url}/ledger/{pg_id}.json").get("version")
            if not _is_int(version):
                raise CorruptObject(f"{self.url}/ledger/{pg_id}.json: invalid version {version!r}")
            result[pg_id] = version
        return result

    def record_applied(self, ids: Iterable[str], version: int) -> None:
        """Create ledger/{id}.json = {"version": version} for each id (create-only).

        An existing entry with the same version is fine (repair after a crash); one with another
        version raises DoubleApply, after every other entry has been recorded.
        """
        ids = list(ids)
        for pg_id in ids:
            parse_pseudograd_id(pg_id)
        at = _now()
        entry = dump_json({"version": version, "at": at, "at_iso": iso(at)})

        def record(pg_id: str) -> str | None:
            relative = f"ledger/{pg_id}.json"
            if self.store.create(self._key(relative), entry):
                return None
            existing = self._read_json(relative).get("version")
            return None if existing == version else f"{pg_id} (version {existing})"

        outcomes = [record(ids[0])] if ids else []
        if len(ids) > 1:
            fault_point("ledger.partial")
            outcomes += self._parallel(record, ids[1:])
        conflicts = [c for c in outcomes if c is not None]
        if conflicts:
            shown = ", ".join(conflicts[:5]) + (" ..." if len(conflicts) > 5 else "")
            raise DoubleApply(
                f"{self.url}: {len(conflicts)} pseudo-gradient(s) already applied in another "
                f"version, not recorded for version {version}: {shown}"
            )

    def quarantine(self, pg_id: str, reason: str) -> None:
        """Mark a pseudo-gradient as never to be applied (overwrites an earlier reason)."""
        parse_pseudograd_id(pg_id)
        at = _now()
        self._write_json(
            f"quarantine/{pg_id}.json", {"reason": reason, "at": at, "at_iso": iso(at)}
        )

    def quarantined(
        self, island: str | None = None, after_seq: int | None = None
    ) -> dict[str, str]:
        """pseudo-gradient id -> reason (of `island` above `after_seq`, if given)."""
        prefix = (
            "quarantine/" if island is None else f"quarantine/{validate_name('island', island)}/"
        )
        after = None if island is None else self._after_seq("quarantine", island, after_seq)
        ids = [m[1] for k in self._list(prefix, after) if (m := _QUARANTINE_ENTRY.fullmatch(k))]
        result = {}
        for pg_id, data in zip(
            ids, self._read_many([f"quarantine/{i}.json" for i in ids]), strict=True
        ):
            if data is not None:
                result[pg_id] = str(load_json(data, f"quarantine/{pg_id}.json").get("reason", ""))
        return result

    # per-island status objects -------------------------------------------------------------
    def _per_island(self, folder: str) -> dict[str, dict[str, Any]]:
        relatives = [k for k in self._list(f"{folder}/") if _PER_ISLAND.fullmatch(k)]
        result = {}
        for relative, data in zip(relatives, self._read_many(relatives), strict=True):
            if data is not None:
                island = relative[len(folder) + 1 : -len(".json")]
                result[island] = load_json(data, f"{self.url}/{relative}")
        return result

    def write_heartbeat(self, island: str, info: Mapping[str, Any]) -> None:
        """Overwrite heartbeats/{island}.json with `info` plus island and "at" (unix seconds,
        unless `info` sets it)."""
        validate_name("island", island)
        self._write_json(f"heartbeats/{island}.json", {"at": _now(), **info, "island": island})

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """island -> its last heartbeat."""
        return self._per_island("heartbeats")

    def mark_done(self, island: str, info: Mapping[str, Any]) -> None:
        """Write done/{island}.json: the island finished its work."""
        validate_name("island", island)
        self._write_json(f"done/{island}.json", {"at": _now(), **info, "island": island})

    def done(self) -> dict[str, dict[str, Any]]:
        """island -> its done record."""
        return self._per_island("done")

    # checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(
        self, island: str, step: int, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]
    ) -> None:
        """Write checkpoints/{island}/c{step:010d}-{uuid8}/ (state, then meta.json), then point
        LATEST.json at it (written last). Older checkpoint directories are kept."""
        validate_name("island", island)
        if not _is_int(step) or step < 0:
            raise ValueError(f"invalid step {step!r}")
        directory = f"checkpoints/{island}/c{step:010d}-{_uuid8()}"
        data = encode_tensors(tensors)
        digest = sha256(data)
        self.store.write(self._key(f"{directory}/state.safetensors"), data)
        fixed = {"island": island, "step": step, "created_at": _now()}
        self._write_json(f"{directory}/meta.json", {**meta, **fixed, "sha256": digest})
        latest = {"step": step, "dir": directory, "sha256": digest, "nbytes": len(data)}
        self._write_json(f"checkpoints/{island}/LATEST.json", latest)

    def load_checkpoint(self, island: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(tensors, meta) of the checkpoint LATEST.json points to, or None if there is none.

        The state's size and sha256 are checked against LATEST.json (CorruptObject).
        """
        validate_name("island", island)
        latest = self._read_json_or_none(f"checkpoints/{island}/LATEST.json")
        if latest is None:
            return None
        directory, step = latest.get("dir"), latest.get("step")
        pattern = re.escape(f"checkpoints/{island}/c") + r"\d{10,}-[0-9a-f]{8}"
        if (
            not isinstance(directory, str)
            or re.fullmatch(pattern, directory) is None
            or not _is_int(step)
            or directory.split("/")[-1][1:].split("-")[0] != f"{step:010d}"
        ):
            raise CorruptObject(f"{self.url}/checkpoints/{island}/LATEST.json: invalid {latest!r}")
        what = f"{self.url} checkpoint of {island} at step {step}"
        tensors = self._verified_tensors(
            f"{directory}/state.safetensors", latest.get("sha256"), latest.get("nbytes"), what
        )
        meta = self._read_json_or_none(f"{directory}/meta.json")
        if meta is None:
            raise CorruptObject(f"{what}: meta.json is missing")
        return tensors, meta

    # metrics -------------------------------------------------------------------------------
    def append_metric(self, kind: str, record: Mapping[str, Any]) -> None:
        """Write one record as metrics/{kind}/{time_ns:020d}-{uuid8}.json (GCS has no append).

        The time in the name orders records (strictly increasing within one process).
        """
        validate_name("metric kind", kind)
        name = f"metrics/{kind}/{_unique_time_ns():020d}-{_uuid8()}.json"
        self._write_json(name, dict(record))

    def read_metrics(self, kind: str) -> list[dict[str, Any]]:
        """The records of `kind`, oldest first."""
        validate_name("metric kind", kind)
        relatives = [k for k in self._list(f"metrics/{kind}/") if _METRIC.fullmatch(k)]
        return [
            load_json(data, f"{self.url}/{relative}")
            for relative, data in zip(relatives, self._read_many(relatives), strict=True)
            if data is not None
        ]

    # control -------------------------------------------------------------------------------
    def _stop_key(self, island: str | None) -> str:
        return self.STOP if island is None else f"control/stop/{validate_name('island', island)}"

    def request_stop(self, island: str | None = None) -> None:
        """Ask every island (None) or one island to stop: control/STOP or control/stop/{island}."""
        self._write_json(self._stop_key(island), {"at": _now()})

    def clear_stop(self, island: str | None = None) -> None:
        """Remove a stop marker written by request_stop (missing is fine)."""
        self.store.delete(self._key(self._stop_key(island)))

    def stopped_islands(self) -> set[str]:
        """Islands asked to leave (control/stop/{island}), from a listing only."""
        prefix = "control/stop/"
        return {
            k[len(prefix) :] for k in self._list(prefix) if _NAME_RE.fullmatch(k[len(prefix) :])
        }

    def stop_requested(self, island: str | None = None) -> bool:
        """True if an experiment-wide stop, or (given an island) that island's stop, exists."""
        if self.store.exists(self._key(self.STOP)):
            return True
        return island is not None and self.store.exists(self._key(self._stop_key(island)))
