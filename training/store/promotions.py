"""Promoted light versions: a light version's full state, written beside it after the fact.

A light version (docs/STORE.md, "Light versions") holds its update and manifest only; a reader
that needs its params or outer state replays the merges since its full ancestor. The shard that
merged it holds that state in memory, and before the memory goes (SIGTERM, the shard going idle
and deferring, the end of `diloco merge`) it *promotes* its HEAD: it writes, in the version's
own directory,

- ``full.params.safetensors`` (only where the version leaves its params out),
- ``full.outer_state.safetensors``,
- ``full.shadow.safetensors`` (under update broadcast, where the merger held a shadow),

then the commit marker ``full.json`` last, create-only (one commit: training/store/commit.py
`PROMOTION`; record: merge_records.parse_promotion).

**What "promoted" means.** ``full.json`` exists, parses, names this very version and
directory, lists a crc32c and size for each payload it holds, and its params checksum is the
one the version's manifest records (``params_crc32c``; a version that keeps its params lists
them in its manifest and the promotion does not repeat them). A reader that needs the version's
arrays (training/merge/replay.state_at: a cold merger, evaluation, export, a restore) loads a
promotion instead of replaying up to it; a promotion it cannot read, or that fails a check, is
logged and passed over: the replay from the full ancestor is always there. So a promotion changes
no rule of what is committed or kept (garbage collection keeps exactly what it kept before, and
deletes a collected version's marker before its payloads).

**What a retry may repeat.** A promoter that finds ``full.json`` does nothing. Two promoters of
one version write the same bytes (a committed version's state is a function of the version:
the merge is bit-exact, `diloco replay` checks it), and one marker wins.

A mixin of `ExperimentStore` (training/store/experiment.py), which supplies the I/O helpers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from training.store import merge_records as records
from training.store import safejson
from training.store.commit import PROMOTION as PROMOTION_COMMIT
from training.store.keys import PROMOTION, promoted_payload
from training.store.layout import HeadPointer, dump_json, now
from training.store.objectstore import (
    CorruptObject,
    ObjectNotFound,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
)
from training.store.tensors import all_finite, checksum, tensor_parts

log = logging.getLogger(__name__)


class Promotions:
    def promote_version(
        self,
        head: HeadPointer,
        manifest: dict,
        params: Mapping[str, np.ndarray],
        outer_state: Mapping[str, np.ndarray],
        shadow: Mapping[str, np.ndarray] | None,
    ) -> bool:
        """Write the full state of the light version `head` names (`manifest`: its parsed
        manifest; the arrays: its params, outer-state tensors and broadcast shadow, as the
        merger that made it holds them): payloads first, ``full.json`` last, create-only.
        False when the version is full, or already promoted."""
        if records.light_ancestor(manifest) is None:
            return False
        marker = self.object_key(f"{head.dir}/{PROMOTION}")
        if self.store.exists(marker):
            return False
        summed = records.params_sum(manifest)
        arrays = {"outer_state": outer_state}
        if summed is not None:
            arrays["params"] = params
        if shadow is not None:
            arrays["shadow"] = shadow
        commit = self.commit(PROMOTION_COMMIT)
        sums, sizes = {}, {}
        for name, tensors in sorted(arrays.items()):
            parts = tensor_parts(tensors)
            sums[name], sizes[name] = checksum(parts), sum(len(p) for p in parts)
            if name == "params" and (sums[name], sizes[name]) != summed:
                # the merger's own arrays differ from what it committed: never promote them
                raise ValueError(
                    f"fragment {head.fragment} version {head.version}: params to promote "
                    f"({sums[name]}, {sizes[name]}) are not the version's {summed}"
                )
            commit.write_parts(f"{head.dir}/{promoted_payload(name)}", parts)
            del parts
        created = now()
        record = {
            "experiment": self.experiment,
            "fragment": head.fragment,
            "version": head.version,
            "dir": head.dir,
            "created_at": created,
            "crc32c": sums,
            "nbytes": sizes,
        }
        return commit.mark(f"{head.dir}/{PROMOTION}", dump_json(record))

    def promotion(self, head: HeadPointer, manifest: dict) -> records.Promotion | None:
        """The promotion of the light version `head` names, checked against its `manifest`
        (parsed); None when there is none. BadPromotion when there is one that cannot be
        trusted."""
        try:
            data = self.store.read(
                self.object_key(f"{head.dir}/{PROMOTION}"), safejson.POINTER.max_bytes
            )
        except ObjectNotFound:
            return None
        if isinstance(data, CorruptObject):
            raise records.BadPromotion(f"{self.url}/{head.dir}/{PROMOTION}: {data}")
        try:
            return records.parse_promotion(
                data, self.experiment, head.fragment, head.version, head.dir, manifest
            )
        except records.BadPromotion as exc:
            raise records.BadPromotion(f"{self.url}/{head.dir}/{PROMOTION}: {exc}") from None

    def load_promoted(
        self,
        head: HeadPointer,
        manifest: dict,
        max_nbytes: Mapping[str, int] | None = None,
    ) -> tuple[dict, dict, dict | None] | None:
        """(params, outer-state tensors, shadow or None) of the light version `head` names,
        from its promotion, each payload's size (at most `max_nbytes[name]`: the fragment's
        float32 size; the shadow: the params') and checksum checked; writable arrays. None
        when it has no promotion, or one that cannot be read or trusted (logged: the caller
        replays instead)."""
        loaded = self._read_promoted(head, manifest, max_nbytes, records.PROMOTED_PAYLOADS)
        if loaded is None:
            return None
        return loaded["params"], loaded["outer_state"], loaded.get("shadow")

    def load_promoted_shadow(
        self, head: HeadPointer, manifest: dict, max_nbytes: int | None = None
    ) -> dict | None:
        """The broadcast shadow alone of the light version `head` names, from its promotion
        (what an island reading it whole adopts: no params, no outer state read), checked as
        in load_promoted; None when there is none or it cannot be trusted (logged)."""
        limits = None if max_nbytes is None else {"shadow": max_nbytes}
        loaded = self._read_promoted(head, manifest, limits, ("shadow",))
        return None if loaded is None else loaded.get("shadow")

    def _read_promoted(
        self,
        head: HeadPointer,
        manifest: dict,
        max_nbytes: Mapping[str, int] | None,
        names: tuple[str, ...],
    ) -> dict[str, dict] | None:
        """The promotion's payloads among `names`, by name (params from the version itself
        where it keeps them); None when there is no promotion or it fails a check (logged)."""
        what = f"{self.url} fragment {head.fragment} version {head.version}"
        try:
            promoted = self.promotion(head, manifest)
            if promoted is None:
                return None
            limits = dict(max_nbytes or {})
            limits.setdefault("shadow", limits.get("params"))  # the shadow: params' shapes
            wanted = {n: v for n, v in promoted.sums.items() if n in names}
            # a light version recorded its params' checksum: the promotion's must be it
            recorded = records.params_sum(manifest)
            if "params" in wanted and recorded is not None and wanted["params"] != recorded:
                raise CorruptObject(
                    f"{what}: promoted params {wanted['params']} are not the version's {recorded}"
                )
            for name, (_, size) in wanted.items():
                limit = limits.get(name)
                if limit is not None and size > limit:
                    raise CorruptObject(f"{what}: promoted {name} of {size} bytes is over {limit}")
            loaded = {
                name: self.read_verified_tensors(
                    f"{head.dir}/{promoted_payload(name)}", ("crc32c", crc), size, what
                )
                for name, (crc, size) in wanted.items()
            }
            if "params" in names and "params" not in loaded:
                loaded["params"] = self.load_fragment(
                    head, manifest=manifest, max_nbytes=max_nbytes
                ).params
            for name, tensors in loaded.items():  # checksums say nothing of what was summed
                bad = sorted(n for n, v in tensors.items() if not all_finite(v))
                if bad:
                    raise CorruptObject(f"{what}: promoted {name} {bad[0]!r} has non-finite values")
        except (TransientStoreError, StoreUnreachable):
            raise  # the store's fault, not the promotion's
        except StoreError as err:  # CorruptObject, ObjectNotFound (collected meanwhile)
            log.warning("%s: promotion passed over (replayed instead): %s", what, err)
            return None
        return loaded
