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
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from training.faults import fault_point
from training.names import validate_name
from training.store import records, safejson
from training.store.keys import (
    GLOBAL_DIR,
    SkipTally,
    checkpoint_dir,
    global_dir,
    parse_key_or_none,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import (
    CorruptObject,
    Generation,
    ObjectNotFound,
    ObjectStore,
    StoreError,
)
from training.store.safejson import JSONLimits, dump_json
from training.store.tensors import MAX_HEADER_BYTES, decode_tensors, encode_tensors, sha256

log = logging.getLogger(__name__)

T = TypeVar("T")

_ANY = JSONLimits(16 * 2**20)  # objects without a kind of their own (kept for load_json)

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
# JSON and ids: the one reader is safejson.load_json, the one name parser keys.parse_key


def load_json(data: bytes, what: str, limits: JSONLimits = _ANY) -> dict[str, Any]:
    """Parse a JSON object under `limits` (safejson.load_json); CorruptObject naming `what`."""
    try:
        return safejson.load_json(data, limits)
    except CorruptObject as exc:
        raise CorruptObject(f"{what}: {exc}") from None


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
    error: str | None = field(default=None, compare=False)  # the marker could not be read


@dataclass
class GCPlan:
    """What a garbage collection deletes (docs/STORE.md, "Garbage collection").

    `versions`: committed versions whose payloads go (their manifest.json stays, so HEAD's chain
    and its `applied` lists stay readable); `orphan_dirs`: global directories off HEAD's chain
    that can never be committed; `pseudograds`: merged pseudo-gradients (marker and payload)
    applied outside the retention window; `orphan_payloads`: pseudo-gradient payloads their
    marker does not name; `checkpoints`: checkpoint directories older than the island's LATEST.
    `protected`: the versions kept (HEAD, the window, version 0, every island's base).
    """

    head: int | None = None
    keep_last: int = 0
    protected: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    version_dirs: dict[int, str] = field(default_factory=dict)
    orphan_dirs: list[str] = field(default_factory=list)
    pseudograds: list[str] = field(default_factory=list)
    orphan_payloads: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.versions
            or self.orphan_dirs
            or self.pseudograds
            or self.orphan_payloads
            or self.checkpoints
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "head": self.head,
            "keep_last": self.keep_last,
            "protected": self.protected,
            "versions": self.versions,
            "orphan_dirs": self.orphan_dirs,
            "pseudograds": self.pseudograds,
            "orphan_payloads": self.orphan_payloads,
            "checkpoints": self.checkpoints,
        }


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
    COLLECTED = "collected.json"

    def __init__(self, store: ObjectStore, experiment: str, max_workers: int = 16):
        self.store = store
        self.experiment = validate_name("experiment", experiment)
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self.skipped = SkipTally()  # objects readers skipped (junk names, broken heartbeats)

    @property
    def url(self) -> str:
        return f"{self.store.url}/{self.experiment}"

    def __repr__(self) -> str:
        return f"ExperimentStore({self.url!r})"

    # low-level helpers ---------------------------------------------------------------------
    def _key(self, relative: str) -> str:
        return f"{self.experiment}/{relative}"

    def _read_json(self, relative: str, limits: JSONLimits = _ANY) -> dict[str, Any]:
        data = self.store.read(self._key(relative), max_bytes=limits.max_bytes)
        return load_json(data, f"{self.url}/{relative}", limits)

    def _read_json_or_none(self, relative: str, limits: JSONLimits = _ANY) -> dict[str, Any] | None:
        try:
            return self._read_json(relative, limits)
        except ObjectNotFound:
            return None

    def _skip(self, relative: str, reason: Any) -> None:
        """Count an object no contribution is to blame for, and go on (docs/THREAT_MODEL.md)."""
        self.skipped.note(relative, str(reason))
        log.warning("skipped %s/%s: %s", self.url, relative, reason)

    def _named(self, relative_prefix: str, kind: str) -> list[Any]:
        """Parsed names of kind `kind` under a prefix; names outside the layout are skipped
        and counted (names of other kinds, e.g. payloads next to markers, are left alone)."""
        names = []
        for relative in self._list(relative_prefix):
            name = parse_key_or_none(relative)
            if name is None:
                self._skip(relative, f"not a name of the layout (expected a {kind})")
            elif name.kind == kind:
                names.append(name)
        return names

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

    def _read_many(
        self, relatives: Sequence[str], max_bytes: int | None = None
    ) -> list[bytes | CorruptObject | None]:
        """Contents of many objects: None for one deleted since it was listed, the
        CorruptObject (ObjectTooLarge) for one over `max_bytes`."""

        def read(relative: str) -> bytes | CorruptObject | None:
            try:
                return self.store.read(self._key(relative), max_bytes=max_bytes)
            except ObjectNotFound:
                return None
            except CorruptObject as exc:
                return exc

        return self._parallel(read, relatives)

    def _verified_tensors(
        self,
        relative: str,
        digest: Any,
        nbytes: Any,
        what: str,
        max_header: int = MAX_HEADER_BYTES,
    ) -> dict[str, np.ndarray]:
        """Read a payload (never more than the manifest's `nbytes`), check its size and sha256
        against the manifest, decode it (a header of at most `max_header` bytes)."""
        if not records.is_int(nbytes) or nbytes < 0:
            raise CorruptObject(f"{what}: invalid nbytes {safejson.show(nbytes)}")
        try:
            data = self.store.read(self._key(relative), max_bytes=nbytes)
        except ObjectNotFound:
            raise CorruptObject(f"{what}: payload {relative} is missing") from None
        except CorruptObject as exc:
            raise CorruptObject(f"{what}: {exc}") from None
        if len(data) != nbytes:
            raise CorruptObject(f"{what}: payload {relative} has {len(data)} bytes, not {nbytes}")
        if sha256(data) != digest:
            raise CorruptObject(f"{what}: payload {relative} fails its sha256 check")
        return decode_tensors(data, max_header)[0]

    # config --------------------------------------------------------------------------------
    def write_config(self, cfg: Mapping[str, Any]) -> None:
        """Create config.json. Re-creating it with equal content is a no-op; different content
        raises ExperimentExists (an experiment name is never reused for another config)."""
        data = dump_json(cfg)
        if self.store.create(self._key(self.CONFIG), data):
            return
        if self.read_config() != json.loads(data):
            raise ExperimentExists(
                f"{self.url} exists with a different config.json; pick a new experiment name"
            )

    def read_config(self) -> dict[str, Any]:
        """config.json (a JSON object naming this experiment, if it names one);
        ObjectNotFound if the experiment has none, BadConfigRecord if it is invalid."""
        data = self.store.read(self._key(self.CONFIG), max_bytes=safejson.CONFIG.max_bytes)
        return records.parse_config_record(data, self.experiment)

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
            got = self.store.read_versioned(key, max_bytes=safejson.CONFIG.max_bytes)
            if got is None:
                raise ObjectNotFound(f"{self.url}/{self.CONFIG} does not exist")
            data, generation = got
            current = records.parse_config_record(data, self.experiment)
            new = change(json.loads(data))
            if new == current:
                return current
            if self.store.compare_and_swap(key, dump_json(new), generation):
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

    # global versions -----------------------------------------------------------------------
    def head(self) -> HeadPointer | None:
        """The current HEAD pointer (with its generation), or None before the first publish."""
        got = self.store.read_versioned(self._key(self.HEAD), max_bytes=safejson.POINTER.max_bytes)
        if got is None:
            return None
        data, generation = got
        try:
            pointer = records.parse_head(data)
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{self.HEAD}: {exc}") from None
        return HeadPointer(version=pointer.version, dir=pointer.dir, generation=generation)

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

        directory = global_dir(version, _uuid8())
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
        try:
            data = self.store.read(self._key(relative), safejson.GLOBAL_MANIFEST.max_bytes)
        except ObjectNotFound:
            raise CorruptObject(f"{self.url}/{relative} is missing but HEAD points to it") from None
        try:
            return records.parse_global_manifest(data, self.experiment, head.version).raw
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{relative}: {exc}") from None

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
        try:
            tensors = {
                name: self._verified_tensors(
                    f"{head.dir}/{name}.safetensors", digests.get(name), sizes.get(name), what
                )
                for name in ("params", "outer_state")
            }
        except CorruptObject:
            if self.store.exists(self._key(f"{head.dir}/{self.COLLECTED}")):
                raise ObjectNotFound(f"{what} was garbage-collected (payloads deleted)") from None
            raise
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
        names = [n for n in self._named("global/", "global-file") if n.file == "manifest.json"]
        relatives = [f"{n.dir}/manifest.json" for n in names]
        raw: dict[str, tuple[int, bytes | CorruptObject]] = {}
        limit = safejson.GLOBAL_MANIFEST.max_bytes
        for name, data in zip(names, self._read_many(relatives, limit), strict=True):
            if data is not None:
                raw[name.dir] = (name.version, data)
        chain: list[dict[str, Any]] = []
        directory: Any = head.dir
        while isinstance(directory, str) and directory in raw and len(chain) < len(raw):
            version, data = raw[directory]
            if isinstance(data, CorruptObject):
                raise data
            try:
                manifest = records.parse_global_manifest(data, self.experiment, version).raw
            except CorruptObject as exc:
                raise type(exc)(f"{self.url}/{directory}/manifest.json: {exc}") from None
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
        existing = self._read_json_or_none(f"{stem}.json", safejson.MANIFEST)
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
        return self._pg_ref(
            island, seq, fragment, self._read_json(f"{stem}.json", safejson.MANIFEST)
        )

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
        ids = [n.id for n in self._named(prefix, "pseudograd-marker") if n.id not in excluded]
        refs = []
        markers = self._read_many(
            [f"pseudograds/{i}.json" for i in ids], safejson.MANIFEST.max_bytes
        )
        for pg_id, data in zip(ids, markers, strict=True):
            if data is None:
                continue
            error = None
            try:
                if isinstance(data, CorruptObject):
                    raise data
                manifest = safejson.load_json(data, safejson.MANIFEST)
            except CorruptObject as exc:
                log.warning("%s/pseudograds/%s.json: %s", self.url, pg_id, exc)
                manifest, error = {}, f"unreadable manifest: {exc}"
            ref = self._pg_ref(*parse_pseudograd_id(pg_id), manifest)
            refs.append(ref if error is None else replace(ref, error=error))
        return refs

    def load_pseudograd(
        self,
        ref: PseudoGradRef,
        max_nbytes: int | None = None,
        max_header: int | None = None,
        limit_of: str = "",
    ) -> dict[str, np.ndarray]:
        """The tensors of a committed pseudo-gradient, verified against its manifest.

        CorruptObject unless: the marker was readable; the manifest names this experiment,
        island, seq and fragment (records.parse_pseudograd_commit); the payload key is
        `pseudograds/{island}/{seq:08d}-f{fragment:03d}-<8 hex>.safetensors` (so never outside
        this island's prefix); the declared size is at most `max_nbytes` (refused before any
        read; `limit_of` names the limit in the message); and the payload's size and sha256
        match (it is read with the declared size as its limit, its header with `max_header`).
        """
        what = f"{self.url} pseudo-gradient {ref.id}"
        if ref.error is not None:
            raise CorruptObject(f"{what}: {ref.error}")
        pg_id = pseudograd_id(ref.island, ref.seq, ref.fragment)
        if ref.id != pg_id:
            raise CorruptObject(f"{what}: manifest does not describe this pseudo-gradient")
        try:
            commit = records.parse_pseudograd_commit(ref.manifest, pg_id, self.experiment)
        except CorruptObject as exc:
            raise CorruptObject(f"{what}: {exc}") from None
        if commit.payload != ref.payload_key:
            raise CorruptObject(f"{what}: ref payload_key {ref.payload_key!r} != manifest")
        if max_nbytes is not None and commit.nbytes > max_nbytes:
            raise CorruptObject(
                f"{what}: payload of {commit.nbytes} bytes is over the {max_nbytes}-byte limit"
                f"{limit_of}"
            )
        return self._verified_tensors(
            commit.payload, commit.sha256, commit.nbytes, what, max_header or MAX_HEADER_BYTES
        )

    # ledger and quarantine -----------------------------------------------------------------
    def applied_ids(self) -> set[str]:
        """Ids of applied pseudo-gradients, from a listing only (no reads)."""
        return {n.id for n in self._named("ledger/", "ledger")}

    def applied(self) -> dict[str, int]:
        """pseudo-gradient id -> the version that applied it, from the ledger.

        Only the merger writes the ledger. An entry whose content is unreadable still names an
        applied id (it is never applied again: at most once wins over at least once); it maps
        to version -1 and is skipped and counted. Junk names are skipped and counted.
        """
        ids = sorted(self.applied_ids())
        result: dict[str, int] = {}
        entries = self._read_many([f"ledger/{i}.json" for i in ids], safejson.POINTER.max_bytes)
        for pg_id, data in zip(ids, entries, strict=True):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                result[pg_id] = records.parse_ledger_entry(data)
            except CorruptObject as exc:
                self._skip(f"ledger/{pg_id}.json", exc)
                result[pg_id] = -1
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
            try:
                existing = records.parse_ledger_entry(self.store.read(self._key(relative), 4096))
            except CorruptObject as exc:  # unreadable: the id stays applied (see applied())
                self._skip(relative, exc)
                return None
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
        reason = safejson.one_line(reason, records.MAX_REASON)
        self._write_json(f"quarantine/{pg_id}.json", {"reason": reason, "at": _now()})

    def quarantined(self) -> dict[str, str]:
        """pseudo-gradient id -> reason. An entry whose content is unreadable still quarantines
        its id (with that as the reason) and is counted as skipped."""
        ids = [n.id for n in self._named("quarantine/", "quarantine")]
        result = {}
        limit = safejson.QUARANTINE.max_bytes
        for pg_id, data in zip(
            ids, self._read_many([f"quarantine/{i}.json" for i in ids], limit), strict=True
        ):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                result[pg_id] = records.parse_quarantine_entry(data).reason
            except CorruptObject as exc:
                self._skip(f"quarantine/{pg_id}.json", exc)
                result[pg_id] = f"(unreadable quarantine entry: {exc})"
        return result

    # per-island status objects -------------------------------------------------------------
    def _per_island(
        self, folder: str, kind: str, parse: Callable[[bytes, str], dict[str, Any]], limit: int
    ) -> dict[str, dict[str, Any]]:
        """island -> its parsed record under `folder`; broken ones are skipped and counted."""
        islands = [n.island for n in self._named(f"{folder}/", kind)]
        relatives = [f"{folder}/{island}.json" for island in islands]
        result = {}
        for island, relative, data in zip(
            islands, relatives, self._read_many(relatives, limit), strict=True
        ):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                result[island] = parse(data, island)
            except CorruptObject as exc:
                self._skip(relative, exc)
        return result

    def write_heartbeat(self, island: str, info: Mapping[str, Any]) -> None:
        """Overwrite heartbeats/{island}.json with `info` plus island and "at" (unix seconds,
        unless `info` sets it)."""
        validate_name("island", island)
        self._write_json(f"heartbeats/{island}.json", {"at": _now(), **info, "island": island})

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """island -> its last heartbeat."""
        return self._per_island(
            "heartbeats", "heartbeat", records.parse_heartbeat, safejson.HEARTBEAT.max_bytes
        )

    def mark_done(self, island: str, info: Mapping[str, Any]) -> None:
        """Write done/{island}.json: the island finished its work."""
        validate_name("island", island)
        self._write_json(f"done/{island}.json", {"at": _now(), **info, "island": island})

    def done(self) -> dict[str, dict[str, Any]]:
        """island -> its done record."""
        return self._per_island("done", "done", records.parse_done, safejson.POINTER.max_bytes)

    # checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(
        self, island: str, step: int, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]
    ) -> None:
        """Write checkpoints/{island}/c{step:010d}-{uuid8}/ (state, then meta.json), then point
        LATEST.json at it (written last). Older checkpoint directories are kept."""
        validate_name("island", island)
        if not _is_int(step) or step < 0:
            raise ValueError(f"invalid step {step!r}")
        directory = checkpoint_dir(island, step, _uuid8())
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
        latest = self._checkpoint_pointer(island)
        if latest is None:
            return None
        directory, step = latest.dir, latest.step
        what = f"{self.url} checkpoint of {island} at step {step}"
        tensors = self._verified_tensors(
            f"{directory}/state.safetensors", latest.sha256, latest.nbytes, what
        )
        try:
            data = self.store.read(
                self._key(f"{directory}/meta.json"), safejson.CHECKPOINT_META.max_bytes
            )
        except ObjectNotFound:
            raise CorruptObject(f"{what}: meta.json is missing") from None
        return tensors, records.parse_checkpoint_meta(data, island, step)

    def _checkpoint_pointer(self, island: str) -> records.CheckpointPointer | None:
        """checkpoints/{island}/LATEST.json, parsed (None if absent; BadCheckpoint)."""
        relative = f"checkpoints/{island}/LATEST.json"
        try:
            data = self.store.read(self._key(relative), safejson.POINTER.max_bytes)
        except ObjectNotFound:
            return None
        return records.parse_checkpoint_pointer(data, island)

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
        relatives = [k for k in self._list(f"metrics/{kind}/") if parse_key_or_none(k)]
        for junk in set(self._list(f"metrics/{kind}/")) - set(relatives):
            self._skip(junk, "not a metric record name")
        records_ = []
        for relative, data in zip(
            relatives, self._read_many(relatives, safejson.METRIC.max_bytes), strict=True
        ):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                records_.append(records.parse_metric(data, kind))
            except CorruptObject as exc:
                self._skip(relative, exc)
        return records_

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
        return {n.island for n in self._named("control/stop/", "island-stop")}

    def stop_requested(self, island: str | None = None) -> bool:
        """True if an experiment-wide stop, or (given an island) that island's stop, exists."""
        if self.store.exists(self._key(self.STOP)):
            return True
        return island is not None and self.store.exists(self._key(self._stop_key(island)))

    # garbage collection --------------------------------------------------------------------
    def _head_chain(self) -> tuple[HeadPointer | None, dict[int, str], bool]:
        """(head, version -> directory along HEAD's chain, whether the chain reaches its root)."""
        head = self.head()
        if head is None:
            return None, {}, True
        dirs = {head.version: head.dir}
        complete = False
        for manifest in self.list_global_versions():
            parent, parent_dir = manifest.get("parent_version"), manifest.get("parent_dir")
            if parent_dir is None:
                complete = True
            elif records.is_int(parent) and isinstance(parent_dir, str):
                dirs[parent] = parent_dir
        return head, dirs, complete

    def referenced_versions(self, keep_last: int = 1, keep_first: bool = True) -> set[int]:
        """Versions that must keep their payloads: HEAD, the newest `keep_last` of its chain,
        version 0 (`keep_first`: the baseline evaluations compare against), and every version an
        island's heartbeat or latest checkpoint names as its base."""
        head, dirs, _ = self._head_chain()
        if head is None:
            return set()
        keep = {head.version} | {v for v in dirs if v > head.version - max(1, keep_last)}
        if keep_first and 0 in dirs:
            keep.add(0)
        bases: list[Any] = [b.get("base_version") for b in self.heartbeats().values()]
        for name in self._named("checkpoints/", "checkpoint-latest"):
            try:
                pointer = self._checkpoint_pointer(name.island)
                if pointer is None:
                    continue
                data = self.store.read(
                    self._key(f"{pointer.dir}/meta.json"), safejson.CHECKPOINT_META.max_bytes
                )
                meta = records.parse_checkpoint_meta(data, name.island, pointer.step)
            except ObjectNotFound:
                continue
            except CorruptObject as exc:
                self._skip(f"checkpoints/{name.island}/LATEST.json", exc)
                continue
            found = meta.get("base_version")
            bases += found if isinstance(found, list) else [found]
        keep |= {b for b in bases if records.is_int(b)}
        return keep

    def plan_gc(self, keep_last: int = 5, keep_first: bool = True) -> GCPlan:
        """What `collect_garbage` would delete now; reads only (see GCPlan)."""
        if not records.is_int(keep_last) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        head, dirs, complete = self._head_chain()
        plan = GCPlan(head=None if head is None else head.version, keep_last=keep_last)
        if head is None:
            return plan
        protected = self.referenced_versions(keep_last, keep_first)
        plan.protected = sorted(protected)

        files: dict[str, set[str]] = {}
        for key in self._list("global/v"):
            directory, _, name = key.rpartition("/")
            files.setdefault(directory, set()).add(name)
        payloads = {"params.safetensors", "outer_state.safetensors"}
        for version, directory in sorted(dirs.items()):
            if version not in protected and files.get(directory, set()) & payloads:
                plan.versions.append(version)
                plan.version_dirs[version] = directory
        on_chain = set(dirs.values())
        if complete:  # a broken chain (a manifest deleted by hand) hides what is committed
            for directory in sorted(files):
                match = GLOBAL_DIR.fullmatch(directory)
                if match and directory not in on_chain and int(match[1]) <= head.version:
                    plan.orphan_dirs.append(directory)

        applied = self.applied()
        quarantined = set(self.quarantined())
        markers: set[str] = set()
        payload_keys: dict[str, list[str]] = {}
        for key in self._list("pseudograds/"):
            name = parse_key_or_none(key)
            if name is not None and name.kind == "pseudograd-marker":
                markers.add(name.id)
            elif name is not None and name.kind == "pseudograd-payload":
                payload_keys.setdefault(name.id, []).append(key)
        window_start = head.version - keep_last + 1
        for pg_id in sorted(markers | set(payload_keys)):
            version = applied.get(pg_id)
            if version is not None and version < window_start and pg_id not in quarantined:
                plan.pseudograds.append(pg_id)
        collected = set(plan.pseudograds)
        several = [i for i in sorted(markers - collected) if len(payload_keys.get(i, [])) > 1]
        limit = safejson.MANIFEST.max_bytes
        for pg_id, data in zip(
            several, self._read_many([f"pseudograds/{i}.json" for i in several], limit), strict=True
        ):
            try:
                named = safejson.load_json(data, safejson.MANIFEST).get("payload")
            except CorruptObject:
                continue  # unreadable (or None: deleted): keep every payload of the id
            if isinstance(named, str):
                plan.orphan_payloads += [k for k in payload_keys[pg_id] if k != named]

        ckpt_dirs: dict[str, dict[str, int]] = {}
        for key in self._list("checkpoints/"):
            name = parse_key_or_none(key)
            if name is not None and name.kind == "checkpoint-file":
                ckpt_dirs.setdefault(name.island, {})[name.dir] = name.step
        for island, directories in sorted(ckpt_dirs.items()):
            try:
                latest = self._checkpoint_pointer(island)
            except CorruptObject:
                latest = None
            if latest is None:
                continue  # no committed checkpoint: everything may still be in flight
            for directory, step in sorted(directories.items()):
                if step < latest.step:
                    plan.checkpoints.append(directory)
        return plan

    def _delete_prefix(self, relative_prefix: str) -> int:
        keys = self._list(relative_prefix)
        self._parallel(lambda k: self.store.delete(self._key(k)), keys)
        return len(keys)

    def delete_global_version(self, version: int, protected: Collection[int] = ()) -> bool:
        """Delete the payloads of committed version `version` (params, outer state).

        Its manifest.json stays (HEAD's chain and the `applied` history stay readable) next to a
        `collected.json` marker, written first; `load_global` of it then raises ObjectNotFound.
        Refuses (ValueError) HEAD, any version in `protected`, and any version
        `referenced_versions()` keeps. False if the version has no payloads left.
        """
        head, dirs, _ = self._head_chain()
        if head is None or version not in dirs:
            raise ObjectNotFound(f"{self.url}: no committed version {version}")
        if version >= head.version or version in protected:
            raise ValueError(f"{self.url}: version {version} is HEAD or protected; not deleted")
        if version in self.referenced_versions(keep_last=1, keep_first=False):
            raise ValueError(f"{self.url}: version {version} is still referenced; not deleted")
        return self._collect_version(dirs[version])

    def _collect_version(self, directory: str) -> bool:
        names = [f"{directory}/params.safetensors", f"{directory}/outer_state.safetensors"]
        present = [n for n in names if self.store.exists(self._key(n))]
        if not present:
            return False
        self._write_json(f"{directory}/{self.COLLECTED}", {"at": _now()})
        for name in present:
            self.store.delete(self._key(name))
        return True

    def delete_pseudograd(self, pg: str | PseudoGradRef) -> int:
        """Delete a merged pseudo-gradient: its marker first, then every payload of its id.

        Refuses (ValueError) one without a ledger entry (not merged). Its ledger entry stays:
        it keeps the id applied, so a replay of it is never merged again. Returns the number of
        objects deleted.
        """
        pg_id = pg.id if isinstance(pg, PseudoGradRef) else pg
        parse_pseudograd_id(pg_id)
        if not self.store.exists(self._key(f"ledger/{pg_id}.json")):
            raise ValueError(f"{self.url}: pseudo-gradient {pg_id} is not merged; not deleted")
        marker = self._key(f"pseudograds/{pg_id}.json")
        deleted = int(self.store.exists(marker))
        self.store.delete(marker)
        return deleted + self._delete_prefix(f"pseudograds/{pg_id}-")

    def collect_garbage(self, plan: GCPlan) -> dict[str, int]:
        """Delete what `plan` (from `plan_gc`) lists; safe to repeat. Counts of what went."""
        counts = dict.fromkeys(
            ("versions", "orphan_dirs", "pseudograds", "orphan_payloads", "checkpoints"), 0
        )
        head = self.head()
        protected = set(plan.protected) | ({head.version} if head else set())
        for version in plan.versions:
            directory = plan.version_dirs.get(version)
            if version in protected or directory is None:
                continue
            counts["versions"] += int(self._collect_version(directory))
        for directory in plan.orphan_dirs:
            counts["orphan_dirs"] += int(self._delete_prefix(f"{directory}/") > 0)
        for pg_id in plan.pseudograds:
            counts["pseudograds"] += int(self.delete_pseudograd(pg_id) > 0)
        for key in plan.orphan_payloads:
            self.store.delete(self._key(key))
            counts["orphan_payloads"] += 1
        for directory in plan.checkpoints:
            counts["checkpoints"] += int(self._delete_prefix(f"{directory}/") > 0)
        return counts
