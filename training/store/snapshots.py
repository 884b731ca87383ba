"""Snapshots: the whole model at one point of a run, as a vector of fragment versions.

A *snapshot* (`snapshots/{time_ns}-{uuid8}.json`, JSON only) names one committed version per
fragment: what evaluation, status, export and garbage collection name when they mean "the whole
model at one point of the run". `snapshots/BEST.json` names the best evaluated snapshot (by
compare-and-swap, the lowest loss wins) and `snapshots/FINAL.json` the model a finished run ends
with (create-only): each a commit of one object (training/store/commit.py `RECORD`: BEST a
pointer, FINAL a marker). Also here: the history of the models the merges made, the whole
model's params at a snapshot, and a restore of a snapshot as new fragment versions. The
protocol is in docs/STORE.md.

A mixin of `ExperimentStore` (training/store/experiment.py), over the fragment versions of
training/store/versions.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from training.store import merge_records as records
from training.store import safejson
from training.store.commit import RECORD
from training.store.keys import BEST, FINAL, BadName, parse_fragment_dir
from training.store.layout import (
    FRAGMENT_RESERVED,
    HeadPointer,
    Snapshot,
    dump_json,
    load_json,
    new_uuid8,
    unique_time_ns,
)
from training.store.objectstore import CorruptObject, ObjectNotFound
from training.store.record_fields import is_int


class Snapshots:
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

    def on_chain(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot`, once every fragment's (version, dir) is checked to be a committed
        version on that fragment's own chain (HEAD or an ancestor, by the parent_dir links
        from HEAD: `find_version`); CorruptObject naming the first that is not. The one rule
        for every pointer that names versions to read or restore: BEST, FINAL, a restore
        (docs/STORE.md "What a reader does with a bad object"): a well-formed directory name
        with valid checksums is not enough, a forged directory off the chain is refused."""
        for p, (v, d) in enumerate(zip(snapshot.versions, snapshot.dirs, strict=True)):
            try:
                found = self.find_version(p, v).dir
            except ObjectNotFound:
                found = None
            if found != d:
                raise CorruptObject(
                    f"{self.url}: the snapshot names fragment {p} version {v} in {d}, which is "
                    "not a committed version on the fragment's chain"
                )
        return snapshot

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
        LightVersion); the restore is a full version either way. Only committed versions on
        each fragment's chain are restored (`on_chain`; CorruptObject otherwise)."""
        self.on_chain(snapshot)
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
        return self.commit(RECORD).mark(FINAL, dump_json(dict(record)))

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
            swapped = self.commit(RECORD).swap(BEST, dump_json(dict(record)), got and got[1])
            if swapped is not None:
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
