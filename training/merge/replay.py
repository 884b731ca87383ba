"""`diloco replay`: re-derive a fragment's version history from its recorded contributions.

The event tape of a run (docs/ALGORITHM.md, "Replay"). For each version v >= 1 of a fragment (or
from `start` on), replay takes version v - 1's state (params, outer state, merge state,
broadcast shadow: carried from v - 1's replay, loaded when v - 1 is full, else replayed forward
from its full ancestor: `state_at`, also what a cold merger and a restore of a light version
use; docs/STORE.md "Light versions"), reads exactly the contributions v's manifest
lists as applied, in the groups and order its `contributions` records give (with each island's
weight cap and the active-island count: apply.REPLAY_FIELDS), runs the merge's own arithmetic
on them (training/merge/apply.py: the very code the merger ran) and compares what comes out
with what v holds, bit for bit: params (a light version without params: the crc32c and size
of the params payload, against its params_crc32c / params_nbytes), outer state, the
optimizer's counters, the contributions' weights, and under update broadcast the codec update
and the new shadow. A version that
restored BEST (`restored_from`) is checked against the version it restores. Nothing the merger
decided from its clock or the store's state (grace, selection, quorum, quarantine) is decided
again: replay re-applies the recorded decision, and reports what the arithmetic made of it.

Everything read is untrusted and read through the store's strict readers; a record replay
needs that is missing or malformed makes that version "CANNOT" (so does a contribution or a
parent version whose payloads were garbage-collected), never a crash.

Length: past 500 lines, one walk of a fragment's chain: `replay` (the check) and `state_at` (a
cold start) re-derive a version by the same `_rederive` from the same `State` and chain, and
their verdicts (`_Stop`) and comparisons are one set; split, each half would import the other's
privates.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np

from training.codecs import host as codecs
from training.config.experiment import ExperimentConfig
from training.merge import admit, apply, norm_bounds
from training.merge.outer import state_from_tensors, state_tensors
from training.model.runtime import fragment_names, fragment_shapes
from training.protocol import broadcast
from training.store import merge_records as records
from training.store.experiment import ExperimentStore, HeadPointer
from training.store.objectstore import CorruptObject, ObjectNotFound, StoreError
from training.store.record_fields import is_int, is_real
from training.store.tensors import checksum, tensor_parts

log = logging.getLogger(__name__)

OK, DIFFERS, CANNOT = "ok", "DIFFERS", "CANNOT"


class ReplayInputError(ValueError):
    """Replay cannot start (no such fragment, no version chain): one line, exit 2."""


class _Stop(Exception):  # noqa: N818 - a version's replay stops here with this verdict
    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class Outcome:
    """The verdict on one version: OK, DIFFERS (what differs) or CANNOT (why not)."""

    fragment: int
    version: int
    applied: int
    status: str
    detail: str = ""
    restored_from: int | None = None

    def line(self) -> str:
        what = (
            f"restored from v{self.restored_from}"
            if self.restored_from is not None
            else f"{self.applied} applied"
        )
        tail = self.status if not self.detail else f"{self.status}: {self.detail}"
        return f"fragment {self.fragment} version {self.version} ({what}): {tail}"


@dataclass
class State:
    """A version's arrays as loaded or re-derived: params, outer-state tensors, the broadcast
    shadow (None: broadcast off). Consumed by the next merge (updated in place)."""

    version: int
    params: dict
    outer: dict
    shadow: dict | None


class ColdStartMismatch(RuntimeError):
    """A cold start re-derived a light version to other bits than stored (one line: fragment,
    version, tensor): nondeterminism, found rather than hidden. The shard stops."""


def replay(
    cfg: ExperimentConfig,
    store: ExperimentStore,
    fragment: int | None = None,
    to: int | None = None,
    start: int = 1,
) -> Iterator[Outcome]:
    """Outcomes of versions `start`..`to` (default: HEAD) of `fragment` (default: every
    fragment, in order), one per version, oldest first. The state re-derived for one version
    is carried to the next (a light version has no outer state to load)."""
    names = fragment_names(cfg)
    if start < 0 or (to is not None and to < 0):
        raise ReplayInputError(f"versions are >= 0 (from {start}, to {to})")
    if fragment is not None and not 0 <= fragment < len(names):
        raise ReplayInputError(f"fragment {fragment} out of range (P = {len(names)})")
    shapes = fragment_shapes(cfg)
    for p in range(len(names)) if fragment is None else [fragment]:
        frag_shapes = shapes[p]
        chain = dict(enumerate(_chain(store, p)))
        last = len(chain) - 1 if to is None else min(to, len(chain) - 1)
        carried: State | None = None
        for v in range(max(start, 1), last + 1):
            outcome, carried = _replay_version(cfg, store, frag_shapes, chain, v, carried)
            yield outcome


def state_at(
    cfg: ExperimentConfig,
    store: ExperimentStore,
    shapes: Mapping[str, tuple[int, ...]],
    head: HeadPointer,
    manifest: dict,
    tick=lambda version: None,
) -> State:
    """The arrays of the version `head` names, for a merger that holds none (a cold start):
    loaded when it is full, else its nearest full ancestor's loaded and the merges after it
    re-applied with apply.apply_groups from the contributions their manifests record, each
    re-derived version checked against the stored one (params, update, counters). `tick(v)`
    after each re-derived version (a fault point). ColdStartMismatch (one line) on a
    difference or a record it cannot replay."""
    chain = dict(
        (pointer.version, (pointer, m)) for pointer, m in store.light_chain(head, manifest)
    )
    try:
        return _state_at(cfg, store, shapes, chain, head.version, tick)
    except _Stop as stop:
        raise ColdStartMismatch(
            f"fragment {head.fragment}: cold start stopped ({stop.status}): {stop.detail}"
        ) from None


def _fragment_state(cfg, store, head: HeadPointer, manifest: dict) -> State:
    """state_at with fragment `head.fragment`'s shapes from the config."""
    return state_at(cfg, store, fragment_shapes(cfg)[head.fragment], head, manifest)


def params_at(
    cfg: ExperimentConfig, store: ExperimentStore, head: HeadPointer, manifest: dict
) -> dict:
    """The params of the version `head` names: a light one without params replayed forward
    from its full ancestor and checked against its params_crc32c (state_at), else read.
    What evaluation and export read (ExperimentStore.load_params's `params_of`)."""
    return _fragment_state(cfg, store, head, manifest).params


def params_of(cfg: ExperimentConfig, store: ExperimentStore):
    """`params_at` bound to `cfg` and `store`: ExperimentStore.load_params's `params_of`."""
    return lambda head, manifest: params_at(cfg, store, head, manifest)


def arrays_of(cfg: ExperimentConfig, store: ExperimentStore):
    """(params, outer state) of a version by `state_at`, bound to `cfg` and `store`: what a
    restore of BEST writes (ExperimentStore.restore_snapshot's `state_of`)."""

    def arrays(head: HeadPointer, manifest: dict) -> tuple[dict, dict]:
        state = _fragment_state(cfg, store, head, manifest)
        return state.params, state.outer

    return arrays


def _state_at(cfg, store, shapes, chain, v: int, tick=lambda version: None) -> State:
    """Version v's arrays: loaded when full, else replayed forward from its full ancestor."""
    pointer, manifest = chain[v]
    full_at = records.light_ancestor(manifest)
    if full_at is None:
        return State(v, *apply.load_arrays(cfg, store, pointer, manifest, shapes))
    if full_at[0] not in chain or chain[full_at[0]][0].dir != full_at[1]:
        raise _Stop(CANNOT, f"version {v}'s full ancestor {full_at[0]} is not on its chain")
    state = _promoted(cfg, store, shapes, chain, v, full_at[0]) or _ancestor(
        cfg, store, shapes, chain, full_at[0]
    )
    for u in range(state.version + 1, v + 1):
        try:
            state = _rederive(cfg, store, shapes, chain, u, state, lenient=True)
        except _Stop as stop:
            detail = f"version {u} (light, from full {full_at[0]}): {stop.detail}"
            raise _Stop(stop.status, detail) from None
        tick(u)
    return state


def _ancestor(cfg, store: ExperimentStore, shapes, chain, full: int) -> State:
    """The state of the full ancestor `full`: a full version's, loaded; or a promoted light
    version's (a full version written in the background), from its promotion."""
    pointer, manifest = chain[full]
    if records.light_ancestor(manifest) is None:
        return State(full, *apply.load_arrays(cfg, store, pointer, manifest, shapes))
    state = _promoted(cfg, store, shapes, chain, full, full - 1)
    if state is None:
        raise _Stop(CANNOT, f"full ancestor {full} is light and its promotion cannot be read")
    return state


def _promoted(cfg, store: ExperimentStore, shapes, chain, v: int, full: int) -> State | None:
    """The newest promoted light version from v down to (not including) its full ancestor
    `full`, loaded (training/store/promotions.py), or None: the replay starts there instead."""
    limits = apply.fragment_limits(shapes)
    for u in range(v, full, -1):
        arrays = store.load_promoted(*chain[u], limits)
        if arrays is None:
            continue
        params, outer, shadow = arrays
        try:
            for what, tensors in (("params", params), ("shadow", shadow or params)):
                got = {n: (t.dtype, t.shape) for n, t in tensors.items()}
                if got != {n: (np.dtype(np.float32), tuple(s)) for n, s in shapes.items()}:
                    raise ValueError(f"promoted {what} do not fit the fragment")
            ms = records.merge_state_of(chain[u][1])
            state_from_tensors(cfg.outer, shapes, outer, ms.steps, ms.seen)
            norm_bounds.check_outer_state_bound(cfg.outer, outer, ms.norms)
        except ValueError as err:
            log.warning(
                "fragment %d version %d: promotion passed over: %s", chain[u][0].fragment, u, err
            )
            continue
        return State(u, params, outer, shadow)
    return None


def _chain(store: ExperimentStore, p: int) -> list[tuple[HeadPointer, dict]]:
    """(pointer, manifest) of fragment p's committed versions, index = version."""
    head = store.head(p)
    if head is None:
        raise ReplayInputError(f"fragment {p} has no version: nothing to replay")
    manifests = store.list_fragment_versions(p)
    if not manifests or manifests[0]["version"] != 0 or manifests[-1]["version"] != head.version:
        raise ReplayInputError(f"fragment {p}: its version chain does not reach version 0")
    dirs = [m["parent_dir"] for m in manifests[1:]] + [head.dir]
    return [(HeadPointer(p, m["version"], d, 0), m) for m, d in zip(manifests, dirs, strict=True)]


def _replay_version(cfg, store, shapes, chain, v: int, carried: State | None):
    """(v's Outcome, v's re-derived State to carry to v + 1, or None)."""
    pointer, manifest = chain[v]
    restored = manifest.get("restored_from")
    applied = manifest.get("applied") or []
    base = Outcome(pointer.fragment, v, len(applied), OK)
    state = None
    try:
        if restored is not None:
            version = restored.get("version") if isinstance(restored, dict) else None
            if not is_int(version) or not 0 <= version < v:
                raise _Stop(CANNOT, f"restored_from {restored!r} names no earlier version")
            base = Outcome(pointer.fragment, v, 0, OK, restored_from=version)
            if restored.get("dir") != chain[version][0].dir:
                raise _Stop(CANNOT, f"restored_from {restored!r} is not on the version chain")
            _check_restore(cfg, store, shapes, chain, v, version)
        else:
            parent = carried
            if parent is None or parent.version != v - 1:
                try:
                    parent = _state_at(cfg, store, shapes, chain, v - 1)
                except ObjectNotFound:
                    raise _Stop(CANNOT, f"version {v - 1} was collected") from None
            state = _rederive(cfg, store, shapes, chain, v, parent)
            _check_promotion(store, shapes, chain, v, state)
    except _Stop as stop:
        return replace(base, status=stop.status, detail=stop.detail), None
    except ObjectNotFound as err:
        return replace(base, status=CANNOT, detail=f"collected: {err}"), None
    except (StoreError, ValueError, KeyError) as err:  # a record or payload of v - 1 refused
        return replace(base, status=CANNOT, detail=f"unreadable: {err}"), None
    return base, state


def _check_promotion(store, shapes, chain, v: int, state: State) -> None:
    """A promoted light version (training/store/promotions.py): what its promotion holds is
    what the replay re-derived, bit for bit (params, outer state, shadow)."""
    pointer, manifest = chain[v]
    try:
        if store.promotion(pointer, manifest) is None:
            return
    except CorruptObject as err:
        raise _Stop(DIFFERS, f"its promotion: {err}") from None
    arrays = store.load_promoted(pointer, manifest, apply.fragment_limits(shapes))
    if arrays is None:
        raise _Stop(DIFFERS, "its promotion's payloads do not match full.json")
    params, outer, shadow = arrays
    _compare("promoted params", state.params, params)
    _compare("promoted outer_state", state.outer, outer)
    if shadow is not None and state.shadow is not None:
        _compare("promoted shadow", state.shadow, shadow)


def _check_restore(cfg, store, shapes, chain, v: int, version: int) -> None:
    """A restore of BEST: v's params and outer state are those of the version it restores
    (replayed forward when that one is light)."""
    limits = apply.fragment_limits(shapes)
    got = store.load_fragment(
        chain[v][0], outer_state=True, manifest=chain[v][1], max_nbytes=limits
    )
    was = _state_at(cfg, store, shapes, chain, version)
    _compare("params", got.params, was.params)
    _compare("outer_state", got.outer_state, was.outer)


def _records(manifest: Mapping) -> list[dict]:
    """v's `contributions` records of its `applied` ids, checked: each with its group index,
    weight cap and active count (apply.REPLAY_FIELDS), the ids exactly those applied."""
    found = manifest.get("contributions")
    if not isinstance(found, list) or not all(isinstance(r, dict) for r in found):
        raise _Stop(CANNOT, "its manifest has no contributions records")
    for r in found:
        if not all(k in r for k in apply.REPLAY_FIELDS):
            raise _Stop(CANNOT, "its contributions lack group/cap/active (written before replay)")
        ok = (
            isinstance(r.get("id"), str)
            and is_int(r["group"])
            and r["group"] >= 0
            and is_real(r["cap"])
            and math.isfinite(r["cap"])
            and r["cap"] > 0
            and is_int(r["active"])
            and r["active"] >= 0
            and isinstance(r.get("reanchored", False), bool)
        )
        if not ok:
            raise _Stop(CANNOT, f"malformed contributions record {str(r)[:200]}")
    ids = [r["id"] for r in found]
    if sorted(ids) != sorted(manifest.get("applied") or []) or len(set(ids)) != len(ids):
        raise _Stop(CANNOT, "its contributions records do not list exactly its applied ids")
    if [r["group"] for r in found] != sorted(r["group"] for r in found):
        raise _Stop(CANNOT, "its contributions records are not in group order")
    return found


def _pointer(store, chain, fragment: int, version: int) -> HeadPointer:
    """Version `version`'s pointer: from `chain` where it holds it (replay: every version; a
    cold start: those since the full ancestor), else found on the fragment's chain."""
    if version in chain:
        return chain[version][0]
    return store.find_version(fragment, version)


def _rederive(cfg, store, shapes, chain, v: int, parent: State, lenient: bool = False) -> State:
    """Re-apply v's recorded merge to `parent` (v - 1's arrays, consumed) and compare the result
    with what v holds, bit for bit (params; outer state and shadow where v is full; the
    optimizer's counters; the update): v's State, or _Stop. `lenient` (a cold start): a stored
    update or shadow that does not read (checksum, size: rot, not a forgery that reads) is
    logged and passed over once the replay matched v's params; islands read v another way
    (training/protocol/broadcast.py). One that reads and differs stops, as always."""
    pointer, manifest = chain[v]
    parent_version = v - 1
    recs = _records(manifest)
    candidates = {}
    for r in recs:
        ref = store.pseudograd(r["id"])
        if ref is None:
            raise _Stop(CANNOT, f"contribution {r['id']} was collected")
        island, seq, frag = records.parse_pseudograd_id(r["id"])
        got = admit.check_manifest(
            cfg, r["id"], island, seq, frag, ref.manifest, parent_version, None, ref.error
        )
        if isinstance(got, str):
            raise _Stop(DIFFERS, f"contribution {r['id']}: {got}")
        candidates[r["id"]] = (got, ref)
    groups: dict[int, list] = {}
    caps: dict[int, dict[str, float]] = {}
    for r in recs:
        groups.setdefault(r["group"], []).append(candidates[r["id"]][0])
        caps.setdefault(r["group"], {})[candidates[r["id"]][0].island] = float(r["cap"])
    order = sorted(groups)

    params, outer_tensors, shadow = parent.params, parent.outer, parent.shadow
    if broadcast.enabled(cfg) and shadow is None:
        shadow = {n: val.copy() for n, val in params.items()}
    ms = records.merge_state_of(chain[parent_version][1])
    state = state_from_tensors(cfg.outer, shapes, outer_tensors, ms.steps, ms.seen)
    reanchored = {r["id"]: r.get("reanchored") for r in recs}

    def payload(c, max_nbytes, max_header):
        try:
            return store.load_pseudograd(candidates[c.id][1], max_nbytes, max_header)
        except ObjectNotFound:
            raise _Stop(CANNOT, f"contribution {c.id}'s payload was collected") from None

    def reject(pg_id, reason):
        raise _Stop(DIFFERS, f"contribution {pg_id} left out of its vote now: {reason}")

    def base(frag, version):
        # the merge's verdict on this base (one per base version: it read it once)
        flags = {
            reanchored[c.id]
            for g in groups.values()
            for c in g
            if parent_version - c.staleness == version
        }
        if False in flags:
            return None  # the merge could not read it: the votes stayed anchored at it
        try:
            return store.load_fragment(
                _pointer(store, chain, frag, version), max_nbytes=apply.fragment_limits(shapes)
            ).params
        except ObjectNotFound:
            if True in flags:
                raise _Stop(CANNOT, f"base version {version} was collected") from None
            return None

    done = apply.apply_groups(
        cfg,
        shapes,
        parent_version,
        params,
        state,
        ms.norms,
        [groups[g] for g in order],
        [caps[g] for g in order],
        recs[0]["active"],
        apply.Io(payload, reject, base),
        encode=(pending := broadcast.pending_update(shadow, cfg.codec)),
    )
    ids = [c.id for c in done.applied]
    if ids != [r["id"] for r in recs]:
        raise _Stop(DIFFERS, f"applied {ids}, the manifest records {[r['id'] for r in recs]}")
    for r, d in zip(recs, done.details, strict=True):
        if d["weight"] != r.get("weight") or d["norm"] != r.get("norm"):
            raise _Stop(
                DIFFERS,
                f"contribution {r['id']}: weight {d['weight']!r} norm {d['norm']!r}, "
                f"recorded {r.get('weight')!r} {r.get('norm')!r}",
            )
    full = records.light_ancestor(manifest) is None
    summed = records.params_sum(manifest)  # a light version without params: their checksum
    limits = apply.fragment_limits(shapes)
    try:
        stored = (
            None
            if summed
            else store.load_fragment(
                pointer, outer_state=full, manifest=manifest, max_nbytes=limits
            )
        )
    except CorruptObject as err:
        raise _Stop(DIFFERS, f"its stored payloads do not match its manifest: {err}") from None
    outer = state_tensors(done.state)
    if stored is None:
        _compare_sum(params, summed)
    else:
        _compare("params", params, stored.params)
    if full:
        _compare("outer_state", outer, stored.outer_state)
    now = records.merge_state_of(manifest)
    if (now.steps, now.seen) != (done.state.steps, done.state.seen):
        raise _Stop(
            DIFFERS,
            f"merge_state steps/seen {now.steps}/{now.seen}, replayed "
            f"{done.state.steps}/{done.state.seen}",
        )
    extra: dict = {}
    payloads, shadow = broadcast.version_payloads(params, shadow, cfg.codec, extra, None, pending)
    if payloads is not None and not full:
        payloads = {n: t for n, t in payloads.items() if n != broadcast.SHADOW}
    sizes = manifest.get("nbytes") or {}
    stored_names = sorted(n for n in (broadcast.UPDATE, broadcast.SHADOW) if n in sizes)
    if sorted(payloads or {}) != stored_names:
        raise _Stop(DIFFERS, f"payloads {stored_names}, replayed {sorted(payloads or {})}")
    for name, tensors in sorted((payloads or {}).items()):
        limit, header = codecs.payload_limits(shapes, cfg.codec if name == "update" else "fp32")
        try:
            got = store.load_payload(pointer, name, manifest, max_nbytes=limit, max_header=header)
        except CorruptObject as err:
            if not lenient:
                raise _Stop(DIFFERS, f"its stored {name} does not read: {err}") from None
            log.warning(
                "fragment %d version %d: its stored %s does not read (%s); the replay matched "
                "its params, so the cold start goes on",
                pointer.fragment,
                v,
                name,
                err,
            )
            continue
        _compare(name, tensors, got)
    return State(v, params, outer, shadow)


def _compare_sum(params: Mapping[str, np.ndarray], recorded: tuple[str, int]) -> None:
    """Raise DIFFERS unless the params payload `params` make (tensors.tensor_parts, as
    publish_fragment checksums it) has the recorded (crc32c, nbytes)."""
    parts = tensor_parts(params)
    got = (checksum(parts), sum(len(p) for p in parts))
    if got != tuple(recorded):
        raise _Stop(
            DIFFERS,
            f"params: crc32c {got[0]} ({got[1]} bytes), recorded {recorded[0]} "
            f"({recorded[1]} bytes)",
        )


def _compare(what: str, replayed: Mapping[str, np.ndarray], stored: Mapping[str, np.ndarray]):
    """Raise DIFFERS at the first tensor whose bits differ: its name, max |diff|, first index."""
    if sorted(replayed) != sorted(stored):
        raise _Stop(DIFFERS, f"{what}: tensors {sorted(stored)}, replayed {sorted(replayed)}")
    for name in sorted(replayed):
        a, b = np.asarray(replayed[name]), np.asarray(stored[name])
        if a.shape != b.shape or a.dtype != b.dtype:
            raise _Stop(
                DIFFERS,
                f"{what}/{name}: stored {b.dtype}{list(b.shape)}, replayed {a.dtype}{list(a.shape)}",
            )
        if a.tobytes() == b.tobytes():
            continue
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        first = int(np.flatnonzero(flat_a.view(width) != flat_b.view(width))[0])
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(flat_a.astype(np.float64) - flat_b.astype(np.float64))
        index = tuple(int(i) for i in np.unravel_index(first, a.shape))
        raise _Stop(
            DIFFERS,
            f"{what}/{name}: max abs diff {float(np.nanmax(diff)):.3g}, first at index "
            f"{list(index)}",
        )


def exit_code(outcomes: list[Outcome]) -> int:
    """0 when every version replayed to the same bits, else 1."""
    return 0 if all(o.status == OK for o in outcomes) else 1


def run(
    cfg: ExperimentConfig,
    store: ExperimentStore,
    fragment: int | None,
    to: int | None,
    start: int,
    keep_going: bool,
    emit,
) -> int:
    """The command's body: `emit` one line per version; stop at the first version that is not
    OK unless `keep_going`. 0 / 1 (exit_code); ReplayInputError for bad input."""
    outcomes = []
    for outcome in replay(cfg, store, fragment, to, start):
        outcomes.append(outcome)
        emit(outcome.line())
        if outcome.status != OK and not keep_going:
            break
    emit(
        f"replayed {len(outcomes)} version(s): "
        + ("all bit-exact" if exit_code(outcomes) == 0 else "NOT all bit-exact")
    )
    return exit_code(outcomes)
