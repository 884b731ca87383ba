"""One experiment's layout on an object store and the publish / merge protocol.

The contract (what "committed" means, what a retry may repeat, how exactly-once is kept) is in
docs/STORE.md. In short: payloads go to unique names first, a small marker written last commits
them, readers ignore anything without its marker, HEAD advances only by compare-and-swap, and the
ledger of applied pseudo-gradients is create-only. The named fault points (training/faults.py)
sit between those steps so chaos tests can kill a process there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from training.faults import fault_point
from training.names import validate_name
from training.store.objectstore import (
    CorruptObject,
    Generation,
    ObjectNotFound,
    ObjectStore,
    StoreError,
)
from training.store.tensors import decode_tensors, encode_tensors, sha256

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_FRAGMENT = 999
_NAME = r"[a-z0-9][a-z0-9-]{0,62}"
_PG_ID = re.compile(rf"^({_NAME})/(\d{{8,}})-f(\d{{3}})$")
_GLOBAL_DIR = re.compile(r"^global/v(\d{8,})-[0-9a-f]{8}$")
_PG_MARKER = re.compile(rf"^pseudograds/({_NAME}/\d{{8,}}-f\d{{3}})\.json$")
_LEDGER_ENTRY = re.compile(rf"^ledger/({_NAME}/\d{{8,}}-f\d{{3}})\.json$")
_QUARANTINE_ENTRY = re.compile(rf"^quarantine/({_NAME}/\d{{8,}}-f\d{{3}})\.json$")
_PER_ISLAND = re.compile(rf"^[a-z]+/({_NAME})\.json$")
_METRIC = re.compile(r"^metrics/[a-z0-9-]+/\d{20}-[0-9a-f]{8}\.json$")

_GLOBAL_RESERVED = frozenset(
    {"experiment", "version", "parent_version", "parent_dir", "created_at", "applied"}
    | {"sha256", "nbytes"}
)
_PG_RESERVED = frozenset(
    {"experiment", "island", "seq", "fragment", "payload", "nbytes", "sha256", "created_at"}
)


class ExperimentExists(StoreError):
    """config.json already exists with different content."""


class DoubleApply(StoreError):
    """A pseudo-gradient is already recorded as applied in a different version."""


# ---------------------------------------------------------------------------------------------
# JSON and ids


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def dump_json(obj: Any) -> bytes:
    """The one JSON encoding used for every store object: sorted keys, compact, UTF-8.

    numpy scalars and arrays become plain numbers and lists. NaN/inf are written as NaN/Infinity
    (what Python's json reads back), so metrics with a diverged loss still round-trip.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default
    ).encode()


def load_json(data: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object; CorruptObject naming `what` if it is not one."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptObject(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CorruptObject(f"{what}: not a JSON object")
    return obj


def pseudograd_id(island: str, seq: int, fragment: int) -> str:
    """The id of a pseudo-gradient: "{island}/{seq:08d}-f{fragment:03d}"."""
    validate_name("island", island)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"invalid seq {seq!r}: must be an int >= 0")
    if isinstance(fragment, bool) or not isinstance(fragment, int):
        raise ValueError(f"invalid fragment {fragment!r}: must be an int")
    if not 0 <= fragment <= MAX_FRAGMENT:
        raise ValueError(f"invalid fragment {fragment!r}: must be in [0, {MAX_FRAGMENT}]")
    return f"{island}/{seq:08d}-f{fragment:03d}"


def parse_pseudograd_id(pg_id: str) -> tuple[str, int, int]:
    """(island, seq, fragment) of a canonical pseudo-gradient id; ValueError otherwise."""
    match = _PG_ID.fullmatch(pg_id) if isinstance(pg_id, str) else None
    if match is None or pseudograd_id(match[1], int(match[2]), int(match[3])) != pg_id:
        raise ValueError(f"invalid pseudo-gradient id {pg_id!r}: expected island/SSSSSSSS-fFFF")
    return match[1], int(match[2]), int(match[3])


def _now() -> float:
    return round(time.time(), 3)


def _uuid8() -> str:
    return uuid.uuid4().hex[:8]


_last_time_ns = 0
_time_ns_lock = threading.Lock()


def _unique_time_ns() -> int:
    """time.time_ns(), strictly increasing within this process (orders metric records)."""
    global _last_time_ns
    with _time_ns_lock:
        _last_time_ns = max(time.time_ns(), _last_time_ns + 1)
        return _last_time_ns


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# Refs


@dataclass(frozen=True)
class HeadPointer:
    """What global/HEAD.json says, plus its store generation (the CAS token)."""

    version: int
    dir: str
    generation: Generation


@dataclass(frozen=True, eq=False)
class GlobalVersion:
    """A committed, checksum-verified global version."""

    version: int
    params: dict[str, np.ndarray]
    outer_state: dict[str, np.ndarray]
    manifest: dict[str, Any]


@dataclass(frozen=True)
class PseudoGradRef:
    """A committed pseudo-gradient. `payload_key` is relative to the experiment root."""

    island: str
    seq: int
    fragment: int
    id: str
    manifest: dict[str, Any] = field(compare=False)
    payload_key: str


# ---------------------------------------------------------------------------------------------
# The store


class ExperimentStore:
    """The objects of one experiment under `<store root>/<experiment>/` (layout: docs/STORE.md).

    Every method is safe to call from several threads and processes at once; every write is safe
    to repeat after a crash (see "What a retry may repeat" in docs/STORE.md).
    """

    HEAD = "global/HEAD.json"
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

    def _list(self, relative_prefix: str) -> list[str]:
        """Keys under `relative_prefix`, relative to the experiment root, sorted."""
        root = self._key("")
        return [k[len(root) :] for k in self.store.list(root + relative_prefix)]

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
        self, relative: str, digest: Any, nbytes: Any, what: str
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
        return decode_tensors(data)[0]

    # config --------------------------------------------------------------------------------
    def write_config(self, cfg: Mapping[str, Any]) -> None:
        """Create config.json. Re-creating it with equal content is a no-op; different content
        raises ExperimentExists (an experiment name is never reused for another config)."""
        data = dump_json(cfg)
        if self.store.create(self._key(self.CONFIG), data):
            return
        if self._read_json(self.CONFIG) != json.loads(data):
            raise ExperimentExists(
                f"{self.url} exists with a different config.json; pick a new experiment name"
            )

    def read_config(self) -> dict[str, Any]:
        """config.json; ObjectNotFound if the experiment has none."""
        return self._read_json(self.CONFIG)

    # global versions -----------------------------------------------------------------------
    def head(self) -> HeadPointer | None:
        """The current HEAD pointer (with its generation), or None before the first publish."""
        got = self.store.read_versioned(self._key(self.HEAD))
        if got is None:
            return None
        data, generation = got
        obj = load_json(data, f"{self.url}/{self.HEAD}")
        version, directory = obj.get("version"), obj.get("dir")
        match = _GLOBAL_DIR.fullmatch(directory) if isinstance(directory, str) else None
        if not _is_int(version) or match is None or int(match[1]) != version:
            raise CorruptObject(f"{self.url}/{self.HEAD}: invalid pointer {obj!r}")
        return HeadPointer(version=version, dir=directory, generation=generation)

    def publish_global(
        self,
        version: int,
        params: Mapping[str, np.ndarray],
        outer_state: Mapping[str, np.ndarray],
        manifest_extra: Mapping[str, Any] | None = None,
        applied: Iterable[str] = (),
        expected: HeadPointer | None = None,
    ) -> HeadPointer | None:
        """Write version `version` and advance HEAD to it if HEAD is still `expected`.

        `version` must be expected.version + 1 (any int >= 0 when `expected` is None: the first
        version). Writes both payloads, then manifest.json (commit marker of the directory), then
        compare-and-swaps HEAD, then records `applied` in the ledger. Returns the new HEAD, or None
        when another writer advanced HEAD first: the directory stays as an unreferenced orphan
        and nothing is recorded. `manifest_extra` may not set the fields filled here
        (ValueError); `fragment_versions` defaults to {}.
        """
        if not _is_int(version) or version < 0:
            raise ValueError(f"invalid version {version!r}")
        if expected is not None and version != expected.version + 1:
            raise ValueError(f"version {version} does not follow the expected head {expected}")
        extra = dict(manifest_extra or {})
        clash = sorted(_GLOBAL_RESERVED & extra.keys())
        if clash:
            raise ValueError(f"manifest_extra may not set {clash}")
        ids = list(applied)
        for pg_id in ids:
            parse_pseudograd_id(pg_id)
        if len(set(ids)) != len(ids):
            raise ValueError("applied lists a pseudo-gradient twice")

        directory = f"global/v{version:08d}-{_uuid8()}"
        payloads = {"params": encode_tensors(params), "outer_state": encode_tensors(outer_state)}
        for name, data in payloads.items():
            self.store.write(self._key(f"{directory}/{name}.safetensors"), data)
        fault_point("global.payload-written")
        manifest = {
            "fragment_versions": {},
            **extra,
            "experiment": self.experiment,
            "version": version,
            "parent_version": None if expected is None else expected.version,
            "parent_dir": None if expected is None else expected.dir,
            "created_at": _now(),
            "applied": sorted(ids),
            "sha256": {name: sha256(data) for name, data in payloads.items()},
            "nbytes": {name: len(data) for name, data in payloads.items()},
        }
        if not self._create_json(f"{directory}/manifest.json", manifest):
            raise StoreError(f"{self.url}/{directory}/manifest.json exists: uuid collision")
        fault_point("global.before-cas")

        pointer = dump_json({"version": version, "dir": directory})
        generation = self.store.compare_and_swap_generation(
            self._key(self.HEAD), pointer, None if expected is None else expected.generation
        )
        if generation is None:
            log.info("%s: lost the race to publish version %d (%s)", self.url, version, directory)
            return None
        fault_point("global.after-cas")
        self.record_applied(ids, version)
        return HeadPointer(version=version, dir=directory, generation=generation)

    def _global_manifest(self, head: HeadPointer) -> dict[str, Any]:
        relative = f"{head.dir}/manifest.json"
        manifest = self._read_json_or_none(relative)
        if manifest is None:
            raise CorruptObject(f"{self.url}/{relative} is missing but HEAD points to it")
        if manifest.get("version") != head.version or manifest.get("experiment") != self.experiment:
            raise CorruptObject(f"{self.url}/{relative} does not describe version {head.version}")
        return manifest

    def load_global(self, head: HeadPointer | None = None) -> GlobalVersion:
        """Load `head` (default: the current HEAD), verifying both payloads' size and sha256
        against the manifest (CorruptObject). ObjectNotFound if nothing was published yet."""
        head = head or self.head()
        if head is None:
            raise ObjectNotFound(f"{self.url}: no global version published yet")
        manifest = self._global_manifest(head)
        digests, sizes = manifest.get("sha256"), manifest.get("nbytes")
        if not isinstance(digests, dict) or not isinstance(sizes, dict):
            raise CorruptObject(f"{self.url}/{head.dir}/manifest.json lacks sha256 / nbytes")
        what = f"{self.url} version {head.version}"
        tensors = {
            name: self._verified_tensors(
                f"{head.dir}/{name}.safetensors", digests.get(name), sizes.get(name), what
            )
            for name in ("params", "outer_state")
        }
        return GlobalVersion(head.version, tensors["params"], tensors["outer_state"], manifest)

    def find_version(self, version: int) -> HeadPointer:
        """A pointer to committed version `version` (HEAD or one of its ancestors)."""
        head = self.head()
        if head is None:
            raise ObjectNotFound(f"{self.url}: no global version published yet")
        chain = self.list_global_versions()
        for child in chain[::-1]:
            if child.get("version") == version + 1 and isinstance(child.get("parent_dir"), str):
                return HeadPointer(version=version, dir=child["parent_dir"], generation=0)
        if head.version == version:
            return head
        raise ObjectNotFound(f"{self.url}: no committed version {version}")

    def list_global_versions(self) -> list[dict[str, Any]]:
        """Manifests of the committed versions (HEAD and its ancestors), oldest first.

        Directories that lost the HEAD race are not versions and are left out. The chain stops
        at the first missing manifest (an ancestor deleted to save space).
        """
        head = self.head()
        if head is None:
            return []
        relatives = [k for k in self._list("global/") if k.endswith("/manifest.json")]
        raw: dict[str, bytes] = {}
        for relative, data in zip(relatives, self._read_many(relatives), strict=True):
            if data is not None:
                raw[relative.removesuffix("/manifest.json")] = data
        chain: list[dict[str, Any]] = []
        directory: Any = head.dir
        while isinstance(directory, str) and directory in raw and len(chain) < len(raw):
            manifest = load_json(raw[directory], f"{self.url}/{directory}/manifest.json")
            chain.append(manifest)
            directory = manifest.get("parent_dir")
        return chain[::-1]

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

    def list_pseudograds(
        self, island: str | None = None, exclude: Collection[str] = ()
    ) -> list[PseudoGradRef]:
        """Committed pseudo-gradients (those with a manifest), by (island, seq, fragment).

        Payloads without a manifest are ignored. Ids in `exclude` (e.g. applied or quarantined
        ones) are skipped without reading their manifests. A manifest that is not valid JSON
        yields a ref with an empty manifest, which load_pseudograd rejects (so it can be
        quarantined rather than silently ignored).
        """
        prefix = (
            "pseudograds/" if island is None else f"pseudograds/{validate_name('island', island)}/"
        )
        excluded = set(exclude)
        ids = []
        for relative in self._list(prefix):
            match = _PG_MARKER.fullmatch(relative)
            if match is not None and match[1] not in excluded:
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
        return self._verified_tensors(payload, m.get("sha256"), m.get("nbytes"), what)

    # ledger and quarantine -----------------------------------------------------------------
    def applied_ids(self) -> set[str]:
        """Ids of applied pseudo-gradients, from a listing only (no reads)."""
        return {m[1] for k in self._list("ledger/") if (m := _LEDGER_ENTRY.fullmatch(k))}

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
        entry = dump_json({"version": version})

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

    def repair_ledger(self, head: HeadPointer | None = None) -> None:
        """Record the `applied` list of `head` (default: current HEAD) in the ledger.

        A merger calls this before choosing what to merge: it completes the ledger writes that a
        crash between the HEAD swap and record_applied left undone (see docs/STORE.md).
        """
        head = head or self.head()
        if head is not None:
            applied = self._global_manifest(head).get("applied", [])
            if not isinstance(applied, list):
                raise CorruptObject(f"{self.url}/{head.dir}/manifest.json: invalid applied list")
            self.record_applied(applied, head.version)

    def quarantine(self, pg_id: str, reason: str) -> None:
        """Mark a pseudo-gradient as never to be applied (overwrites an earlier reason)."""
        parse_pseudograd_id(pg_id)
        self._write_json(f"quarantine/{pg_id}.json", {"reason": reason, "at": _now()})

    def quarantined(self) -> dict[str, str]:
        """pseudo-gradient id -> reason."""
        ids = [m[1] for k in self._list("quarantine/") if (m := _QUARANTINE_ENTRY.fullmatch(k))]
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

    def stop_requested(self, island: str | None = None) -> bool:
        """True if an experiment-wide stop, or (given an island) that island's stop, exists."""
        if self.store.exists(self._key(self.STOP)):
            return True
        return island is not None and self.store.exists(self._key(self._stop_key(island)))
