"""Per-fragment global state (store layout 2): one version chain per fragment.

Each fragment p has its own HEAD (`fragments/f{p:03d}/HEAD.json`, advanced only by compare-and-
swap), its own chain of immutable version directories (params, outer-optimizer state, manifest
written last) and its own slice of the ledger: a merge of fragment p writes only fragment p, and
two merges of different fragments never contend. Snapshots (the whole model: one version per
fragment) are in training/store/snapshots.py, promotions of light versions in
training/store/promotions.py. A version is one commit (training/store/commit.py); the protocol
is in docs/STORE.md.

A mixin of `ExperimentStore` (training/store/experiment.py), which supplies the I/O helpers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from training.store import merge_records as records
from training.store import safejson
from training.store.commit import FULL_VERSION, LIGHT_VERSION
from training.store.layout import (
    FRAGMENT_RESERVED,
    FragmentVersion,
    HeadPointer,
    dump_json,
    fragment_dir,
    fragment_root,
    iso,
    new_uuid8,
    now,
    parse_pseudograd_id,
)
from training.store.objectstore import CorruptObject, ObjectNotFound, StoreError
from training.store.record_fields import is_int
from training.store.tensors import checksum, tensor_parts

log = logging.getLogger(__name__)

PAYLOADS = ("params", "outer_state")
# optional payloads of a version under `outer.broadcast = "codec"` (training/protocol/broadcast.py):
# "update", the codec-encoded step from the previous version's broadcast shadow, and "shadow",
# this version's shadow S_v in float32 (what islands adopt; a version without one has S_v =
# its params)
EXTRA_PAYLOADS = ("update", "shadow")


class LightVersion(StoreError):
    """What a light version leaves out was asked for: its outer state, or its params where it
    has none (its readers replay them forward from its full ancestor: training/merge/replay.py
    `state_at`, `params_at`)."""


class FragmentVersions:
    """Fragment heads, versions and snapshots (mixed into ExperimentStore)."""

    COLLECTED = "collected.json"

    # heads ---------------------------------------------------------------------------------
    def num_fragments(self) -> int:
        """P, from config.json (fixed for the life of the experiment)."""
        count = self.read_config().get("fragments", {}).get("count", 1)
        if not is_int(count) or not 1 <= count <= 999:
            raise CorruptObject(f"{self.url}/config.json: invalid fragments.count {count!r}")
        return count

    def head(self, fragment: int) -> HeadPointer | None:
        """Fragment p's HEAD pointer (with its generation), or None before its first version."""
        relative = f"{fragment_root(fragment)}/HEAD.json"
        got = self.store.read_versioned(
            self.object_key(relative), max_bytes=safejson.POINTER.max_bytes
        )
        if got is None:
            return None
        data, generation = got
        try:
            pointer = records.parse_head(data, fragment)
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{relative}: {exc}") from None
        return HeadPointer(fragment, pointer.version, pointer.dir, generation)

    def heads(self, fragments: Sequence[int] | None = None) -> list[HeadPointer | None]:
        """The HEADs of `fragments` (default: all P), read in parallel, in that order."""
        wanted = list(range(self.num_fragments())) if fragments is None else list(fragments)
        return self.parallel(self.head, wanted)

    # versions ------------------------------------------------------------------------------
    def publish_fragment(
        self,
        fragment: int,
        version: int,
        params: Mapping[str, np.ndarray],
        outer_state: Mapping[str, np.ndarray] | None,
        manifest_extra: Mapping[str, Any] | None = None,
        applied: Iterable[str] = (),
        expected: HeadPointer | None = None,
        payloads: Mapping[str, Mapping[str, np.ndarray]] | None = None,
        full_at: tuple[int, str] | None = None,
        params_kept: bool = True,
    ) -> HeadPointer | None:
        """Write version `version` of `fragment` and advance its HEAD if it is still `expected`.

        `version` must be expected.version + 1 (any int >= 0 when `expected` is None: HEAD must
        not exist). One commit (training/store/commit.py `FULL_VERSION`, `LIGHT_VERSION`): the
        payloads, then manifest.json (the directory's marker), then HEAD by compare-and-swap;
        then `applied` is recorded in the ledger. Returns the new HEAD, or
        None when another writer advanced HEAD first: the directory stays an unreferenced orphan
        and nothing is recorded. `manifest_extra` may not set the fields filled here.
        `payloads`: optional further payloads, named from EXTRA_PAYLOADS (written, checksummed
        and sized like the two others, before the manifest).
        A *light* version (`syncer.full_every` > 1, docs/STORE.md "Light versions"):
        `outer_state` None, no "shadow" payload, and `full_at` = (version, dir) of its nearest
        full ancestor (recorded as `full: false`, `full_version`, `full_dir`). `params_kept`
        False (a light version with an "update" payload only): the params are not written; the
        manifest records `params_crc32c` and `params_nbytes` of the payload they would be (a
        replay of the version reproduces them: training/merge/replay.py).
        """
        root = fragment_root(fragment)
        if not is_int(version) or version < 0:
            raise ValueError(f"invalid version {version!r}")
        if expected is not None and (
            expected.fragment != fragment or version != expected.version + 1
        ):
            raise ValueError(f"version {version} of fragment {fragment} does not follow {expected}")
        extra = dict(manifest_extra or {})
        clash = sorted(FRAGMENT_RESERVED & extra.keys())
        if clash:
            raise ValueError(f"manifest_extra may not set {clash}")
        ids = list(applied)
        for pg_id in ids:
            if parse_pseudograd_id(pg_id)[2] != fragment:
                raise ValueError(f"{pg_id} is not a pseudo-gradient of fragment {fragment}")
        if len(set(ids)) != len(ids):
            raise ValueError("applied lists a pseudo-gradient twice")
        more = dict(payloads or {})
        if set(more) - set(EXTRA_PAYLOADS):
            raise ValueError(f"unknown payloads {sorted(set(more) - set(EXTRA_PAYLOADS))}")
        light = outer_state is None
        if light != (full_at is not None) or (light and ("shadow" in more or expected is None)):
            raise ValueError(
                "a light version has no outer state and no shadow, a parent and a full ancestor"
            )
        if light and not full_at[0] <= expected.version:
            raise ValueError(f"full ancestor {full_at[0]} is not below version {version}")
        if not params_kept and not (light and "update" in more):
            raise ValueError("only a light version with an update leaves its params out")

        directory = fragment_dir(fragment, version, new_uuid8())
        commit = self.commit(LIGHT_VERSION if light else FULL_VERSION)
        sums, sizes = {}, {}
        state = () if light else (("outer_state", outer_state),)
        for name, tensors in (("params", params), *state, *more.items()):
            parts = tensor_parts(tensors)  # the arrays' own bytes: nothing is serialized
            sums[name], sizes[name] = checksum(parts), sum(len(p) for p in parts)
            if name != "params" or params_kept:
                commit.write_parts(f"{directory}/{name}.safetensors", parts)
            del parts
        summed = {}
        if not params_kept:
            summed = {"params_crc32c": sums.pop("params"), "params_nbytes": sizes.pop("params")}
        created = now()
        manifest = {
            **extra,
            "experiment": self.experiment,
            "fragment": fragment,
            "version": version,
            "parent_version": None if expected is None else expected.version,
            "parent_dir": None if expected is None else expected.dir,
            "created_at": created,
            "created_at_iso": iso(created),
            "applied": sorted(ids),
            "crc32c": sums,
            "nbytes": sizes,
        }
        if light:
            manifest.update(full=False, full_version=full_at[0], full_dir=full_at[1], **summed)
        if not commit.mark(f"{directory}/manifest.json", dump_json(manifest)):
            raise StoreError(f"{self.url}/{directory}/manifest.json exists: uuid collision")
        generation = commit.swap(
            f"{root}/HEAD.json",
            dump_json({"version": version, "dir": directory}),
            None if expected is None else expected.generation,
        )
        if generation is None:
            log.info("%s: lost the race for fragment %d version %d", self.url, fragment, version)
            return None
        self.settle_ledger(fragment, ids, version)
        return HeadPointer(fragment, version, directory, generation)

    def fragment_manifest(self, head: HeadPointer) -> dict[str, Any]:
        """The manifest of the version `head` points at; CorruptObject if it does not match."""
        relative = f"{head.dir}/manifest.json"
        try:
            data = self.store.read(self.object_key(relative), safejson.FRAGMENT_MANIFEST.max_bytes)
        except ObjectNotFound:
            raise CorruptObject(
                f"{self.url}/{relative} is missing but a pointer names it"
            ) from None
        return self._parse_manifest(relative, data, head.fragment, head.version)

    def _parse_manifest(self, relative: str, data: Any, fragment: int, version: int) -> dict:
        """records.parse_fragment_manifest, the error naming the object."""
        if isinstance(data, CorruptObject):
            raise type(data)(f"{self.url}/{relative}: {data}")
        try:
            return records.parse_fragment_manifest(data, self.experiment, fragment, version).raw
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{relative}: {exc}") from None

    def load_fragment(
        self,
        head: HeadPointer,
        outer_state: bool = False,
        manifest: dict | None = None,
        max_nbytes: Mapping[str, int] | None = None,
    ) -> FragmentVersion:
        """The verified params (and, if asked, outer state) of the version `head` points at.

        Each payload is read once (never more than its manifest's nbytes, which must be at most
        `max_nbytes[name]` when given: the fragment's size, from its shapes), its size and
        checksum checked against the manifest, and its tensors decoded as writable arrays
        (views into the buffer read: no copy).
        ObjectNotFound if the version was garbage-collected.
        """
        manifest = manifest if manifest is not None else self.fragment_manifest(head)
        try:
            checked = records.parse_fragment_manifest(
                manifest, self.experiment, head.fragment, head.version
            )
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{head.dir}/manifest.json: {exc}") from None
        digests, sizes = checked.checksums, checked.nbytes
        what = f"{self.url} fragment {head.fragment} version {head.version}"
        if outer_state and checked.full_at is not None:
            raise LightVersion(
                f"{what} is a light version: no outer state (replayed from version "
                f"{checked.full_at[0]})"
            )
        if checked.params_sum is not None:
            raise LightVersion(
                f"{what} is a light version without params (replayed from version "
                f"{checked.full_at[0]})"
            )
        names = PAYLOADS if outer_state else ("params",)
        for name in names:
            limit = None if max_nbytes is None else max_nbytes.get(name)
            if limit is not None and is_int(sizes.get(name)) and sizes[name] > limit:
                raise CorruptObject(
                    f"{what}: {name} of {sizes[name]} bytes is over the {limit}-byte size of "
                    "the fragment"
                )
        try:
            tensors = {
                name: self.read_verified_tensors(
                    f"{head.dir}/{name}.safetensors", digests.get(name), sizes.get(name), what
                )
                for name in names
            }
        except CorruptObject:
            if self.store.exists(self.object_key(f"{head.dir}/{self.COLLECTED}")):
                raise ObjectNotFound(f"{what} was garbage-collected (payloads deleted)") from None
            raise
        return FragmentVersion(
            head.fragment, head.version, tensors["params"], tensors.get("outer_state", {}), manifest
        )

    def load_payload(
        self,
        head: HeadPointer,
        name: str,
        manifest: dict | None = None,
        max_nbytes: int | None = None,
        max_header: int | None = None,
    ) -> dict[str, np.ndarray]:
        """One verified payload (`name`: params, outer_state or one of EXTRA_PAYLOADS) of the
        version `head` points at: the manifest must list it (checksum and nbytes; nbytes at
        most `max_nbytes` when given, refused unread), size and checksum checked, its header at
        most `max_header` bytes. Writable arrays. ObjectNotFound if the version was
        garbage-collected; CorruptObject if the payload is missing, broken or not listed."""
        manifest = manifest if manifest is not None else self.fragment_manifest(head)
        what = f"{self.url} fragment {head.fragment} version {head.version}"
        try:
            checked = records.parse_fragment_manifest(
                manifest, self.experiment, head.fragment, head.version, payloads=(name,)
            )
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{head.dir}/manifest.json: {exc}") from None
        size = checked.nbytes[name]
        if max_nbytes is not None and size > max_nbytes:
            raise CorruptObject(
                f"{what}: {name} of {size} bytes is over its {max_nbytes}-byte limit"
            )
        extra = {} if max_header is None else {"max_header": max_header}
        try:
            return self.read_verified_tensors(
                f"{head.dir}/{name}.safetensors", checked.checksums[name], size, what, **extra
            )
        except CorruptObject:
            if self.store.exists(self.object_key(f"{head.dir}/{self.COLLECTED}")):
                raise ObjectNotFound(f"{what} was garbage-collected (payloads deleted)") from None
            raise

    def light_chain(self, head: HeadPointer, manifest: dict) -> list[tuple[HeadPointer, dict]]:
        """[(pointer, manifest)] of the versions from the nearest full one at or below `head`
        to `head`, oldest first (only `head` itself when it is full): what a cold start replays
        forward (docs/STORE.md, "Light versions"). The nearest full one may be a promoted light
        version (training/store/promotions.py); BadPromotion if its promotion is untrustworthy. Walks parent_dir from `head` (whose
        `manifest` was read through fragment_manifest); CorruptObject when the walk does not
        reach the full ancestor the light versions name."""
        full_at = records.light_ancestor(manifest)
        chain = [(head, manifest)]
        if full_at is None:
            return chain
        while chain[-1][0].version > full_at[0]:
            m = chain[-1][1]
            parent = HeadPointer(head.fragment, m["parent_version"], m["parent_dir"], 0)
            pm = self.fragment_manifest(parent)
            named = records.light_ancestor(pm)
            # a version in between names the same ancestor, or an older one (it was merged
            # before the ancestor's background promotion was committed)
            if parent.version > full_at[0] and (named is None or named[0] > full_at[0]):
                raise CorruptObject(
                    f"{self.url}/{parent.dir}: a version between {head.version} and its full "
                    f"ancestor {full_at[0]} is full or names a newer one"
                )
            chain.append((parent, pm))
        last, last_manifest = chain[-1]
        # the ancestor: a full version, or a light one with a promotion (promotions.py)
        if last.dir != full_at[1] or (
            records.light_ancestor(last_manifest) is not None
            and self.promotion(last, last_manifest) is None
        ):
            raise CorruptObject(
                f"{self.url}/{head.dir}: its full ancestor {full_at[1]} is not a full or "
                "promoted version on its chain"
            )
        return chain[::-1]

    def list_fragment_versions(self, fragment: int) -> list[dict[str, Any]]:
        """Manifests of fragment p's committed versions (HEAD and its ancestors), oldest first.

        Directories that lost the HEAD race are not versions and are left out; the chain stops
        at the first missing manifest.
        """
        head = self.head(fragment)
        if head is None:
            return []
        names = [
            n
            for n in self.list_named(f"{fragment_root(fragment)}/", "fragment-file")
            if n.file == "manifest.json" and n.fragment == fragment
        ]
        relatives = [f"{n.dir}/manifest.json" for n in names]
        limit = safejson.FRAGMENT_MANIFEST.max_bytes
        raw: dict[str, tuple[int, Any]] = {}
        for name, data in zip(names, self.read_many(relatives, limit), strict=True):
            if data is not None:
                raw[name.dir] = (name.version, data)
        chain: list[dict[str, Any]] = []
        directory: Any = head.dir
        while isinstance(directory, str) and directory in raw and len(chain) < len(raw):
            version, data = raw[directory]
            manifest = self._parse_manifest(f"{directory}/manifest.json", data, fragment, version)
            chain.append(manifest)
            directory = manifest.get("parent_dir")
        return chain[::-1]

    def find_version(self, fragment: int, version: int) -> HeadPointer:
        """A pointer to committed version `version` of `fragment` (HEAD or an ancestor)."""
        head = self.head(fragment)
        if head is not None and head.version == version:
            return head
        for manifest in self.list_fragment_versions(fragment):
            if manifest.get("version") == version + 1 and isinstance(
                manifest.get("parent_dir"), str
            ):
                return HeadPointer(fragment, version, manifest["parent_dir"], 0)
        raise ObjectNotFound(f"{self.url}: fragment {fragment} has no committed version {version}")

    def repair_ledger(self, head: HeadPointer, manifest: dict | None = None) -> None:
        """Record the `applied` list of `head` in the ledger (see docs/STORE.md): completes the
        ledger writes that a crash between the HEAD swap and the ledger writes left undone, and
        rewrites entries the versions contradict (`settle_ledger`)."""
        manifest = manifest if manifest is not None else self.fragment_manifest(head)
        applied = manifest.get("applied", [])
        if not isinstance(applied, list):
            raise CorruptObject(f"{self.url}/{head.dir}/manifest.json: invalid applied list")
        self.settle_ledger(head.fragment, applied, head.version)

    # pending work --------------------------------------------------------------------------
    def pending_after(
        self,
        cursors: Mapping[int, Mapping[str, int]],
        islands: Sequence[str],
        strays: list | None = None,
        count: int | None = None,
    ) -> dict[int, list]:
        """Committed pseudo-gradients of `islands` to the fragments in `cursors` (fragment ->
        island -> highest seq applied) that are above their cursor and not quarantined.

        Per island one listing of markers and one of quarantine entries, each starting after
        the smallest cursor (a start offset on GCS): never the history. `strays` (with
        `count`, the experiment's P): appended with the listed, unquarantined ones whose
        fragment is not below P (no fragment will ever apply them: the caller quarantines).
        """
        out: dict[int, list] = {p: [] for p in cursors}
        for island in islands:
            low = min((c.get(island, -1) for c in cursors.values()), default=-1)
            after = None if low < 0 else low
            refs = self.list_pseudograds(island, after_seq=after)
            if not refs:
                continue
            skip = self.quarantined(island, after_seq=after)
            for ref in refs:
                fresh = ref.fragment in out and ref.seq > cursors[ref.fragment].get(island, -1)
                if fresh and ref.id not in skip:
                    out[ref.fragment].append(ref)
                elif strays is not None and ref.fragment >= count and ref.id not in skip:
                    strays.append(ref)
        return out

    def pending(self, fragments: Sequence[int] | None = None) -> dict[int, list]:
        """`pending_after` from the current HEADs' cursors, for the islands of config.json
        (no model, no jax: what triggers and `diloco status` call)."""
        islands = [i.get("name") for i in self.read_config().get("islands", [])]
        heads = self.heads(fragments)
        if any(h is None for h in heads):
            return {}
        manifests = {h.fragment: (h.dir, self.fragment_manifest(h)) for h in heads}
        cursors = {
            p: self.checked_cursors(d, m, records.merge_state_of(m).cursors)
            for p, (d, m) in manifests.items()
        }
        return self.pending_after(cursors, [i for i in islands if isinstance(i, str)])
