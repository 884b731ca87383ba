"""The contributions of one experiment: committed pseudo-gradients, the ledger of applied ones,
and the quarantine of refused ones (docs/STORE.md "The commit", "Exactly-once application").

A pseudo-gradient is one commit (training/store/commit.py `PSEUDOGRAD`): its payload under a
unique name, then its small manifest, create-only, the marker; the ledger is create-only, one
entry per applied id; quarantine entries name an id and the reason it was refused. A mixin of `ExperimentStore`
(training/store/experiment.py), which supplies the I/O helpers and the fault points.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from training.config.names import validate_name
from training.store import merge_records, safejson
from training.store.commit import PSEUDOGRAD
from training.store.layout import (
    PG_RESERVED,
    DoubleApply,
    PseudoGradRef,
    dump_json,
    iso,
    new_uuid8,
    now,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import CorruptObject
from training.store.tensors import MAX_HEADER_BYTES, checksum, tensor_parts

log = logging.getLogger("training.store.experiment")


class Contributions:
    """Pseudo-gradients, ledger and quarantine of `ExperimentStore` (a mixin: the I/O helpers
    `object_key`, `read_json`, `read_many`, `parallel`, ... and `hit_fault` are the store's)."""

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

        The manifest gets experiment, island, seq, fragment, payload, nbytes, crc32c and
        created_at (`manifest` may not set them: ValueError). If the marker already exists (a
        retry after a crash, or a racing duplicate), the existing commit wins: its ref is
        returned and no second commit is made.
        """
        pg_id = pseudograd_id(island, seq, fragment)
        caller = dict(manifest or {})
        clash = sorted(PG_RESERVED & caller.keys())
        if clash:
            raise ValueError(f"manifest may not set {clash}")
        stem = f"pseudograds/{pg_id}"
        existing = self.read_json_or_none(f"{stem}.json", safejson.MANIFEST)
        if existing is not None:
            return self._pg_ref(island, seq, fragment, existing)

        parts = tensor_parts(tensors)
        payload = f"{stem}-{new_uuid8()}.safetensors"
        commit = self.commit(PSEUDOGRAD)
        commit.write_parts(payload, parts)
        full = {
            **caller,
            "experiment": self.experiment,
            "island": island,
            "seq": seq,
            "fragment": fragment,
            "payload": payload,
            "nbytes": sum(len(p) for p in parts),
            "crc32c": checksum(parts),
            "created_at": now(),
        }
        marker = dump_json(full)
        if commit.mark(f"{stem}.json", marker):
            return self._pg_ref(island, seq, fragment, json.loads(marker))
        # Someone committed this pseudo-gradient in between; theirs stands, ours is unreferenced.
        self.store.delete(self.object_key(payload))
        return self._pg_ref(
            island, seq, fragment, self.read_json(f"{stem}.json", safejson.MANIFEST)
        )

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
        after = self._after_seq("pseudograds", island, after_seq)
        ids = [
            n.id
            for n in self.list_named(prefix, "pseudograd-marker", after)
            if n.id not in excluded and (after_seq is None or n.seq > after_seq)
        ]
        refs = []
        markers = self.read_many(
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

    def pseudograd(self, pg_id: str) -> PseudoGradRef | None:
        """The committed pseudo-gradient `pg_id` (its marker read as list_pseudograds reads
        it: an unreadable one gives a ref with `error`), or None when it has no marker (never
        committed, or garbage-collected)."""
        island, seq, fragment = parse_pseudograd_id(pg_id)
        (data,) = self.read_many([f"pseudograds/{pg_id}.json"], safejson.MANIFEST.max_bytes)
        if data is None:
            return None
        try:
            if isinstance(data, CorruptObject):
                raise data
            return self._pg_ref(island, seq, fragment, safejson.load_json(data, safejson.MANIFEST))
        except CorruptObject as exc:
            return replace(
                self._pg_ref(island, seq, fragment, {}), error=f"unreadable manifest: {exc}"
            )

    def load_pseudograd(
        self,
        ref: PseudoGradRef,
        max_nbytes: int | None = None,
        max_header: int | None = None,
        limit_of: str = "",
        into: Callable[[int], memoryview] | None = None,
    ) -> dict[str, np.ndarray]:
        """The tensors of a committed pseudo-gradient, verified against its manifest (read
        into `into(n)` where given: the merger's reused buffers, training/store/buffers.py).

        CorruptObject unless: the marker was readable; the manifest names this experiment,
        island, seq and fragment (merge_records.parse_pseudograd_commit); the payload key is
        `pseudograds/{island}/{seq:08d}-f{fragment:03d}-<8 hex>.safetensors` (so never outside
        this island's prefix); the declared size is at most `max_nbytes` (refused before any
        read; `limit_of` names the limit in the message); and the payload's size and checksum
        match (it is read with the declared size as its limit, its header with `max_header`).
        The arrays are read-only views over the downloaded bytes (the merger never mutates
        them).
        """
        what = f"{self.url} pseudo-gradient {ref.id}"
        if ref.error is not None:
            raise CorruptObject(f"{what}: {ref.error}")
        pg_id = pseudograd_id(ref.island, ref.seq, ref.fragment)
        if ref.id != pg_id:
            raise CorruptObject(f"{what}: manifest does not describe this pseudo-gradient")
        try:
            commit = merge_records.parse_pseudograd_commit(ref.manifest, pg_id, self.experiment)
        except CorruptObject as exc:
            raise CorruptObject(f"{what}: {exc}") from None
        if commit.payload != ref.payload_key:
            raise CorruptObject(f"{what}: ref payload_key {ref.payload_key!r} != manifest")
        if max_nbytes is not None and commit.nbytes > max_nbytes:
            raise CorruptObject(
                f"{what}: payload of {commit.nbytes} bytes is over the {max_nbytes}-byte limit"
                f"{limit_of}"
            )
        return self.read_verified_tensors(
            commit.payload,
            commit.checksum,
            commit.nbytes,
            what,
            copy=False,
            max_header=max_header or MAX_HEADER_BYTES,
            into=into,
        )

    # ledger and quarantine -----------------------------------------------------------------
    def applied_ids(self) -> set[str]:
        """Ids of applied pseudo-gradients, from a listing only (no reads)."""
        return {n.id for n in self.list_named("ledger/", "ledger")}

    def is_applied(self, pg_id: str) -> bool:
        """Whether `pg_id` has a ledger entry (one existence check, whatever the history)."""
        parse_pseudograd_id(pg_id)
        return self.store.exists(self.object_key(f"ledger/{pg_id}.json"))

    def applied(self, among: Iterable[str] | None = None) -> dict[str, int]:
        """pseudo-gradient id -> the version that applied it, from the ledger (only the ids
        `among`, when given: their entries alone are read, whatever the history).

        Only the merger writes the ledger. An entry whose content is unreadable still names an
        applied id (it is never applied again: at most once wins over at least once); it maps
        to version -1 and is skipped and counted. Junk names are skipped and counted.
        """
        ids = sorted(self.applied_ids() if among is None else set(among) & self.applied_ids())
        result: dict[str, int] = {}
        entries = self.read_many([f"ledger/{i}.json" for i in ids], safejson.POINTER.max_bytes)
        for pg_id, data in zip(ids, entries, strict=True):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                result[pg_id] = merge_records.parse_ledger_entry(data)
            except CorruptObject as exc:
                self.note_skipped(f"ledger/{pg_id}.json", exc)
                result[pg_id] = -1
        return result

    def record_applied(self, ids: Iterable[str], version: int) -> None:
        """Create ledger/{id}.json = {"version": version} for each id (create-only).

        An existing entry with the same version is fine (repair after a crash); one with another
        version raises DoubleApply, after every other entry has been recorded. (The merger
        records through `settle_ledger` (versions.py), which checks such entries against the
        fragment's versions first.)
        """
        conflicts = {i: v for i, v in self.ledger_conflicts(ids, version).items() if v is not None}
        if conflicts:
            raise DoubleApply(self._double_apply_message(conflicts, version))

    def _double_apply_message(self, conflicts: Mapping[str, int], version: int) -> str:
        shown = [f"{i} (version {v})" for i, v in sorted(conflicts.items())]
        listed = ", ".join(shown[:5]) + (" ..." if len(shown) > 5 else "")
        return (
            f"{self.url}: {len(shown)} pseudo-gradient(s) already applied in another "
            f"version, not recorded for version {version}: {listed}"
        )

    def ledger_conflicts(self, ids: Iterable[str], version: int) -> dict[str, int | None]:
        """Create the ledger entries of `ids` for `version` (create-only, as `record_applied`)
        and return the ids whose existing entry says otherwise: id -> the version it names
        (None: the entry is unreadable; it is counted as skipped and left alone here)."""
        ids = list(ids)
        for pg_id in ids:
            parse_pseudograd_id(pg_id)
        entry = self._ledger_entry(version)

        def record(pg_id: str) -> tuple[str, int | None] | None:
            relative = f"ledger/{pg_id}.json"
            if self.store.create(self.object_key(relative), entry):
                return None
            try:
                existing = merge_records.parse_ledger_entry(
                    self.store.read(self.object_key(relative), safejson.POINTER.max_bytes)
                )
            except CorruptObject as exc:  # unreadable: the id stays applied (see applied())
                self.note_skipped(relative, exc)
                return pg_id, None
            return None if existing == version else (pg_id, existing)

        outcomes = [record(ids[0])] if ids else []
        if len(ids) > 1:
            self.hit_fault("ledger.partial")
            outcomes += self.parallel(record, ids[1:])
        return dict(c for c in outcomes if c is not None)

    @staticmethod
    def _ledger_entry(version: int) -> bytes:
        at = now()
        return dump_json({"version": version, "at": at, "at_iso": iso(at)})

    def rewrite_ledger_entry(self, pg_id: str, version: int) -> None:
        """Overwrite one ledger entry with `version` (the merger, once the fragment's versions
        showed the entry false: `settle_ledger`)."""
        parse_pseudograd_id(pg_id)
        self.store.write(self.object_key(f"ledger/{pg_id}.json"), self._ledger_entry(version))

    # the versions' applied lists are the truth ---------------------------------------------
    def settle_ledger(self, fragment: int, ids: Iterable[str], version: int) -> None:
        """Record `ids`, applied by committed `version` of `fragment` (its `applied` list),
        in the ledger, checking any entry that says otherwise against the fragment's versions
        (docs/STORE.md, "The ledger is checked against the versions").

        An entry naming another version m whose `applied` list does not name the id (a forged
        or broken entry: nothing in the bucket outranks the versions' applied lists) is
        reported (a log line, counted as skipped) and rewritten with `version`. If version m
        does name the id too, the id really was applied twice: DoubleApply.
        """
        conflicts = self.ledger_conflicts(ids, version)
        if not conflicts:
            return
        claimed = {v for v in conflicts.values() if v is not None}
        applied_by: dict[int, set[str]] = {}
        if claimed:
            for manifest in self.list_fragment_versions(fragment):
                listed = manifest.get("applied")
                if manifest.get("version") in claimed and isinstance(listed, list):
                    applied_by[manifest["version"]] = set(listed)
        doubles = {}
        for pg_id, other in sorted(conflicts.items()):
            if other is not None and pg_id in applied_by.get(other, ()):
                doubles[pg_id] = other
                continue
            said = "is unreadable" if other is None else f"names version {other}"
            self.note_skipped(
                f"ledger/{pg_id}.json",
                f"contradicts the versions: it {said}, but version {version} of fragment "
                f"{fragment} applied it (and no other); rewritten",
            )
            self.rewrite_ledger_entry(pg_id, version)
        if doubles:
            raise DoubleApply(self._double_apply_message(doubles, version))

    def checked_cursors(self, directory: str, manifest: Mapping[str, Any], cursors):
        """A version's merge cursors (island -> highest seq applied), raised where the
        version's own `applied` list names a higher seq of an island (the list is the truth:
        a cursor below it would let the id be listed, and applied, again). A raised cursor is
        reported and counted as skipped."""
        checked = dict(cursors)
        listed = manifest.get("applied")
        for pg_id in listed if isinstance(listed, list) else ():
            try:
                island, seq, _ = parse_pseudograd_id(pg_id)
            except ValueError:
                continue  # the manifest parser refuses these (BadFragmentManifest)
            if seq > checked.get(island, -1):
                self.note_skipped(
                    f"{directory}/manifest.json",
                    f"cursor of {island} is {checked.get(island, -1)}, below {pg_id} of its "
                    f"applied list: {seq} used",
                )
                checked[island] = seq
        return checked

    def quarantine(self, pg_id: str, reason: str) -> None:
        """Mark a pseudo-gradient as never to be applied (overwrites an earlier reason)."""
        parse_pseudograd_id(pg_id)
        reason = safejson.one_line(reason, merge_records.MAX_REASON)
        at = now()
        self.write_json(f"quarantine/{pg_id}.json", {"reason": reason, "at": at, "at_iso": iso(at)})

    def quarantine_ids(self) -> list[str]:
        """Ids of quarantined pseudo-gradients, sorted, from a listing only (no reads)."""
        return sorted(n.id for n in self.list_named("quarantine/", "quarantine"))

    def quarantine_reason(self, pg_id: str) -> str | None:
        """The reason of one quarantine entry (None if absent; unreadable: said so)."""
        parse_pseudograd_id(pg_id)
        relative = f"quarantine/{pg_id}.json"
        data = self.read_many([relative], safejson.QUARANTINE.max_bytes)[0]
        if data is None:
            return None
        try:
            if isinstance(data, CorruptObject):
                raise data
            return merge_records.parse_quarantine_entry(data).reason
        except CorruptObject as exc:
            self.note_skipped(relative, exc)
            return f"(unreadable quarantine entry: {exc})"

    def quarantined(
        self, island: str | None = None, after_seq: int | None = None
    ) -> dict[str, str]:
        """pseudo-gradient id -> reason (of `island` above `after_seq`, if given). An entry whose
        content is unreadable still quarantines its id (with that as the reason) and is counted
        as skipped."""
        prefix = (
            "quarantine/" if island is None else f"quarantine/{validate_name('island', island)}/"
        )
        after = None if island is None else self._after_seq("quarantine", island, after_seq)
        ids = [n.id for n in self.list_named(prefix, "quarantine", after)]
        result = {}
        limit = safejson.QUARANTINE.max_bytes
        for pg_id, data in zip(
            ids, self.read_many([f"quarantine/{i}.json" for i in ids], limit), strict=True
        ):
            if data is None:
                continue
            try:
                if isinstance(data, CorruptObject):
                    raise data
                result[pg_id] = merge_records.parse_quarantine_entry(data).reason
            except CorruptObject as exc:
                self.note_skipped(f"quarantine/{pg_id}.json", exc)
                result[pg_id] = f"(unreadable quarantine entry: {exc})"
        return result
