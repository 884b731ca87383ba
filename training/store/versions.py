"""Per-fragment global state (store layout 2): one version chain per fragment, and snapshots.

Each fragment p has its own HEAD (`fragments/f{p:03d}/HEAD.json`, advanced only by compare-and-
swap), its own chain of immutable version directories (params, outer-optimizer state, manifest
written last) and its own slice of the ledger: a merge of fragment p writes only fragment p, and
two merges of different fragments never contend. A *snapshot* is a vector of fragment versions
(`snapshots/{time_ns}-{uuid8}.json`, JSON only): what evaluation, status, export and garbage
collection name when they mean "the whole model at one point of the run". `snapshots/BEST.json`
names the best evaluated snapshot. The protocol is in docs/STORE.md.

A mixin of `ExperimentStore` (training/store/experiment.py), which supplies the I/O helpers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from training.store import merge_records as records
from training.store import safejson
from training.store.keys import BEST, FINAL, BadName, parse_fragment_dir
from training.store.layout import (
    FRAGMENT_RESERVED,
    FragmentVersion,
    HeadPointer,
    Snapshot,
    dump_json,
    fragment_dir,
    fragment_root,
    iso,
    load_json,
    new_uuid8,
    now,
    parse_pseudograd_id,
    unique_time_ns,
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
        not exist). Writes the payloads, then manifest.json (the directory's commit marker), then
        compare-and-swaps HEAD, then records `applied` in the ledger. Returns the new HEAD, or
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
        sums, sizes = {}, {}
        state = () if light else (("outer_state", outer_state),)
        for name, tensors in (("params", params), *state, *more.items()):
            parts = tensor_parts(tensors)  # the arrays' own bytes: nothing is serialized
            sums[name], sizes[name] = checksum(parts), sum(len(p) for p in parts)
            if name != "params" or params_kept:
                self.store.write_parts(self.object_key(f"{directory}/{name}.safetensors"), parts)
            del parts
        summed = {}
        if not params_kept:
            summed = {"params_crc32c": sums.pop("params"), "params_nbytes": sizes.pop("params")}
        self.hit_fault("global.payload-written")
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
            self.hit_fault("light.before-manifest")
        if not self.create_json(f"{directory}/manifest.json", manifest):
            raise StoreError(f"{self.url}/{directory}/manifest.json exists: uuid collision")
        self.hit_fault("global.before-cas")
        pointer = dump_json({"version": version, "dir": directory})
        generation = self.store.compare_and_swap_generation(
            self.object_key(f"{root}/HEAD.json"),
            pointer,
            None if expected is None else expected.generation,
        )
        if generation is None:
            log.info("%s: lost the race for fragment %d version %d", self.url, fragment, version)
            return None
        self.hit_fault("global.after-cas")
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

    def snapshot_history(self) -> list[Snapshot]:
        """The models the merges made, oldest first: one Snapshot per committed fragment version
        the store still holds (versions of all fragments in the order of their `created_at`,
        ties by fragment), each the HEADs as they stood right after that version. It starts
        with the oldest state every fragment's kept chain reaches. [] before the first version."""
        chains = []
        for p in range(self.num_fragments()):
            head = self.head(p)
            manifests = self.list_fragment_versions(p)
            if head is None or not manifests:
                return []
            dirs = [m.get("parent_dir") for m in manifests[1:]] + [head.dir]
            chains.append(list(zip(manifests, dirs, strict=True)))
        events = sorted(
            (_created(chain[i][0]), p, i)
            for p, chain in enumerate(chains)
            for i in range(1, len(chain))
        )
        at = [0] * len(chains)  # the index each fragment's chain has reached

        def state(t: float) -> Snapshot:
            parts = [chain[i] for chain, i in zip(chains, at, strict=True)]
            return _snapshot([m for m, _ in parts], [str(d) for _, d in parts], t)

        out = [state(max(_created(c[0][0]) for c in chains))]
        for t, p, i in events:
            at[p] = i
            out.append(state(t))
        return out

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

    # snapshots -----------------------------------------------------------------------------
    def current_snapshot(self) -> Snapshot | None:
        """The snapshot of every fragment's HEAD now (None until every fragment has one).

        `tokens_merged` is exact with P > 1: each fragment's contributions count the tokens
        trained since that fragment's last publish, so the model holds the mean over fragments.
        """
        heads = self.heads()
        if any(h is None for h in heads):
            return None
        manifests = self.parallel(self.fragment_manifest, heads)
        return _snapshot(manifests, [h.dir for h in heads], max(_created(m) for m in manifests))

    def record_snapshot(self, snapshot: Snapshot, extra: Mapping[str, Any] | None = None) -> str:
        """Write `snapshot` as snapshots/{time_ns:020d}-{uuid8}.json; returns its name."""
        name = f"snapshots/{unique_time_ns():020d}-{new_uuid8()}.json"
        self.write_json(name, {**dict(extra or {}), **snapshot.to_dict()})
        return name

    def snapshots(self) -> list[dict[str, Any]]:
        """Every recorded snapshot, oldest first (unreadable ones skipped and counted)."""
        relatives = [
            k
            for k in self.list_keys("snapshots/")
            if (n := self.parse_listed(k)) and n.kind == "snapshot"
        ]
        records = self.read_records(
            relatives,
            safejson.SNAPSHOT.max_bytes,
            lambda data, rel: load_json(data, f"{self.url}/{rel}", safejson.SNAPSHOT),
        )
        return [record for _, record in records]

    def snapshot_of(self, record: Mapping[str, Any]) -> Snapshot:
        """The Snapshot a recorded snapshot (or an eval / BEST record) names; CorruptObject if
        its versions and dirs do not describe committed fragment directories."""
        versions, dirs = record.get("versions"), record.get("dirs")
        if not (
            isinstance(versions, list) and isinstance(dirs, list) and len(versions) == len(dirs)
        ):
            raise CorruptObject(f"{self.url}: invalid snapshot {safejson.show(dict(record), 200)}")
        for p, (v, d) in enumerate(zip(versions, dirs, strict=True)):
            try:
                ok = is_int(v) and parse_fragment_dir(d, p)[1] == v
            except BadName:
                ok = False
            if not ok:
                raise CorruptObject(
                    f"{self.url}: snapshot entry {p} is invalid: "
                    f"{safejson.show(v)} {safejson.show(d)}"
                )
        tokens = record.get("tokens_merged", 0)
        if not is_int(tokens):
            raise CorruptObject(f"{self.url}: snapshot has invalid tokens_merged {tokens!r:.50}")
        return Snapshot(tuple(versions), tuple(dirs), tokens)

    def load_params(
        self, snapshot: Snapshot | None = None, params_of=None
    ) -> dict[str, np.ndarray]:
        """The whole model's parameters at `snapshot` (default: every fragment's HEAD now),
        verified fragment by fragment. ObjectNotFound before the first version. A light
        version without params: `params_of(pointer, manifest)` gives them
        (training/merge/replay.py `params_at`: replayed from its full ancestor, checked against
        its params_crc32c); without one, LightVersion."""
        snapshot = snapshot or self.current_snapshot()
        if snapshot is None:
            raise ObjectNotFound(f"{self.url}: no global version published yet")
        pointers = [
            HeadPointer(p, v, d, 0)
            for p, (v, d) in enumerate(zip(snapshot.versions, snapshot.dirs, strict=True))
        ]

        def one(pointer: HeadPointer) -> dict[str, np.ndarray]:
            manifest = self.fragment_manifest(pointer)
            if params_of is not None and records.params_sum(manifest) is not None:
                return params_of(pointer, manifest)
            return self.load_fragment(pointer, manifest=manifest).params

        params: dict[str, np.ndarray] = {}
        for got in self.parallel(one, pointers):
            params.update(got)
        return params

    def restore_snapshot(self, snapshot: Snapshot, reason: str, state_of=None) -> Snapshot | None:
        """Make `snapshot`'s model the current one: each fragment whose HEAD is not already at
        the snapshot's version gets a new version (HEAD + 1) holding that version's parameters
        and outer state, and HEAD's manifest fields (merge_state with its cursors: nothing
        applied becomes unapplied, nothing is applied again) but the restored version's
        `tokens_merged` (the tokens in the model), plus `restored_from` ({"version", "dir",
        "reason", "tokens_discarded": HEAD's tokens_merged minus the restored version's}).
        Returns the new current snapshot, or None if a fragment's HEAD moved meanwhile (a merger is still at work: restore nothing more, retry later).
        A light version holds no outer state (and under update broadcast no params):
        `state_of(pointer, manifest)` gives (params, outer state) (training/merge/replay.py
        `arrays_of`: replayed forward from its full ancestor, checked; without one,
        LightVersion); the restore is a full version either way."""
        for p, (v, d) in enumerate(zip(snapshot.versions, snapshot.dirs, strict=True)):
            head = self.head(p)
            if head is None or head.dir == d:
                continue
            pointer = HeadPointer(p, v, d, 0)
            restored = self.fragment_manifest(pointer)
            light = records.light_ancestor(restored) is not None
            if light and state_of is not None:
                params, outer = state_of(pointer, restored)
            else:
                old = self.load_fragment(pointer, outer_state=True, manifest=restored)
                params, outer = old.params, old.outer_state
            current = self.fragment_manifest(head)
            extra = {
                k: val
                for k, val in current.items()
                if k not in FRAGMENT_RESERVED and k != "update_codec"  # no update: S = params
            }
            # the tokens in the model are the restored version's; the discarded ones are said
            tokens = int(restored.get("tokens_merged", 0))
            discarded = int(current.get("tokens_merged", 0)) - tokens
            extra["tokens_merged"] = tokens
            extra["restored_from"] = {
                "version": v,
                "dir": d,
                "reason": reason,
                "tokens_discarded": discarded,
            }
            new = self.publish_fragment(p, head.version + 1, params, outer, extra, expected=head)
            if new is None:
                return None
        return self.current_snapshot()

    def best(self) -> dict[str, Any] | None:
        """snapshots/BEST.json: the best evaluated snapshot with its eval record, or None."""
        return self.read_json_or_none(BEST, safejson.SNAPSHOT)

    def final(self) -> dict[str, Any] | None:
        """snapshots/FINAL.json: the eval record of the model a finished run ends with (its
        BEST restored when the last model was worse), or None while the run has not ended."""
        return self.read_json_or_none(FINAL, safejson.SNAPSHOT)

    def record_final(self, record: Mapping[str, Any]) -> bool:
        """Write snapshots/FINAL.json once (create-only: the run's one finalize); False when it
        exists already."""
        return self.create_json(FINAL, dict(record))

    def offer_best(self, record: Mapping[str, Any]) -> bool:
        """Make `record` (an eval record naming a snapshot and its `loss`) BEST if its loss is
        lower than BEST's, by compare-and-swap (racing evaluators keep the lowest). True if
        it became BEST."""
        loss = record.get("loss")
        if not isinstance(loss, float | int) or not np.isfinite(loss):
            return False
        key = self.object_key(BEST)
        for _ in range(10):
            got = self.store.read_versioned(key, max_bytes=safejson.SNAPSHOT.max_bytes)
            if got is not None:
                current = load_json(got[0], f"{self.url}/{BEST}", safejson.SNAPSHOT).get("loss")
                if isinstance(current, float | int) and current <= loss:
                    return False
            if self.store.compare_and_swap(key, dump_json(dict(record)), got and got[1]):
                return True
        return False


def _created(manifest: Mapping[str, Any]) -> float:
    """A committed version's `created_at` (0 when a manifest lacks it)."""
    return float(manifest.get("created_at", 0.0))


def _snapshot(manifests: Sequence[Mapping[str, Any]], dirs: Sequence[str], at: float) -> Snapshot:
    """The model made of these fragment versions (one manifest and dir per fragment). Its
    `tokens_merged` is the mean over fragments: each fragment's contributions count the tokens
    trained since that fragment's last publish, so the model holds the mean."""
    tokens = [int(m.get("tokens_merged", 0)) for m in manifests]
    return Snapshot(
        versions=tuple(int(m["version"]) for m in manifests),
        dirs=tuple(dirs),
        tokens_merged=sum(tokens) // len(tokens),
        at=at,
    )
