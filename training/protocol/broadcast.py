"""Update broadcast: islands adopt a fragment version from small codec-encoded updates.

With `outer.broadcast = "codec"` the syncer, when it publishes version v of fragment p, also
writes two payloads into the version's directory (docs/STORE.md, "Update broadcast"):
- `update`: encode(Theta_v - S_{v-1}) in the experiment's pseudo-gradient codec (`cfg.codec`,
  training/codecs/host.py: the same encoder, decoder and payload layout as a pseudo-gradient, no
  residual), where S is the *broadcast shadow*;
- `shadow`: S_v = S_{v-1} + decode(update_v), computed in float32 (`step`).
S_0 = Theta_0, and any version without a `shadow` payload (version 0, a restored version, every
version under `outer.broadcast = "fp32"` or `codec = "fp32"`) has S_v = Theta_v exactly. Because each update encodes
the difference against the shadow, not against Theta_{v-1}, quantization error never piles up:
S_v - Theta_v is one update's quantization error at most (error feedback for free).

What islands adopt is S_v. An island that holds S_{v-1} of fragment p (`Shadow`) reads only
update_v, checks it like a pseudo-gradient payload (size cap, checksum, tree, dtypes, shapes,
codes, finite), and computes S_v with `step`: the same float32 add of the same decoded values
as the syncer, so its S_v equals the syncer's bit for bit. An island n versions behind applies
n updates while their bytes add up to no more than one full read of S_v (`plan_updates`), else
(or when an update is missing, garbage-collected or refused) it reads S_v in full
(`adoptable`: the `shadow` payload, or `params` where there is none). Evaluation reads Theta
(`params`, exact).

Pure functions except `fetch` and `read_full`, the island's reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from training.codecs import host as codecs
from training.store import merge_records as records
from training.store.layout import HeadPointer, parent_of
from training.store.objectstore import CorruptObject, ObjectNotFound
from training.store.tensors import all_finite

log = logging.getLogger("diloco.broadcast")

UPDATE, SHADOW = "update", "shadow"
CODEC_FIELD = "update_codec"  # manifest field: the codec of a version's update payload


@dataclass(frozen=True)
class Shadow:
    """An island's copy of one fragment's broadcast shadow S at `version` (directory `dir`):
    float32 host arrays, never written in place (a fetch in the I/O thread may read them)."""

    version: int
    dir: str
    tensors: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Fetched:
    """What an adopt read: S_v of the version, the payload bytes it read, and how
    ("updates": that many updates applied to the island's shadow; "full": S_v read whole)."""

    tensors: dict[str, np.ndarray]
    nbytes: int
    how: str
    updates: int = 0


def enabled(cfg) -> bool:
    """Update broadcast is on: `outer.broadcast = "codec"` with a compressing codec (with
    `codec = "fp32"` an update would be as large as the version: S = Theta, nothing extra)."""
    return cfg.outer.broadcast == "codec" and cfg.codec != "fp32"


def step(shadow: Mapping[str, np.ndarray], decoded: Mapping[str, np.ndarray]) -> dict:
    """S + decode(update), elementwise in float32: the one add both the syncer and the
    islands compute (new arrays; `shadow` is left as it is)."""
    return {n: np.add(shadow[n], decoded[n], dtype=np.float32) for n in shadow}


def encode_update(
    theta: Mapping[str, np.ndarray],
    shadow: dict[str, np.ndarray],
    codec: str,
    alloc: Callable[[int], memoryview] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The syncer's part: (update payload, new shadow) of new parameters `theta` against the
    previous version's shadow, which becomes the new one in place (`step(shadow,
    decode(update))` bit for bit, in one pass: codecs.encode_step). ValueError if the
    difference is not finite (then `shadow` is partly updated: discard it)."""
    if sorted(theta) != sorted(shadow):
        raise ValueError("theta and shadow name different tensors")
    return codecs.encode_step(theta, shadow, codec, alloc=alloc), shadow


def pending_update(
    shadow: dict[str, np.ndarray] | None,
    codec: str,
    alloc: Callable[[int], memoryview] | None = None,
) -> codecs.PendingStep | None:
    """The update of the version a merge is about to make, for its outer step to encode as it
    writes the new parameters (codecs.PendingStep; training/merge/outer.outer_step_), then
    `version_payloads(..., pending=)`; None when broadcast is off (`shadow` None)."""
    return None if shadow is None else codecs.PendingStep(shadow, codec, alloc=alloc)


def version_payloads(
    theta: Mapping[str, np.ndarray],
    shadow: dict[str, np.ndarray] | None,
    codec: str,
    extra: dict,
    alloc: Callable[[int], memoryview] | None = None,
    pending: codecs.PendingStep | None = None,
) -> tuple[dict | None, dict | None]:
    """The syncer's extra payloads of a new version with parameters `theta` (and its
    manifest's CODEC_FIELD, set in `extra`), from the previous version's shadow (None:
    broadcast off, nothing extra), which becomes the new one in place (encode_update):
    ({"update", "shadow"} or None, the new shadow or None). `alloc`: where the update's codes
    go (codecs.encode_step). `pending` (`pending_update` of this shadow, handed to the outer
    step that wrote `theta`): the tensors it encoded are taken as they are, the same bits."""
    if shadow is None:
        return None, None
    if pending is not None:
        if pending.base is not shadow or pending.codec != codec:
            raise ValueError("the pending update is not of this shadow and codec")
        update, new = pending.payload(theta), shadow
    else:
        update, new = encode_update(theta, shadow, codec, alloc)
    extra[CODEC_FIELD] = codec
    return {UPDATE: update, SHADOW: new}, new


def check_update(
    payload: Mapping[str, np.ndarray],
    codec: str,
    shapes: Mapping[str, tuple[int, ...]],
    fragment: int,
) -> dict[str, np.ndarray]:
    """An update payload read from the bucket (untrusted), checked as the merger checks a
    pseudo-gradient (codecs.checked_codes: tree, payload keys, dtypes, sizes, shapes; the
    codes as decoded) and decoded; ValueError naming the problem, also for non-finite values."""
    codecs.checked_codes(payload, codec, shapes, fragment)
    decoded = codecs.decode(dict(payload), codec)
    for n, v in decoded.items():
        if not all_finite(v):
            raise ValueError(f"update tensor {n!r} has non-finite values")
    return decoded


def adoptable(manifest: Mapping[str, Any]) -> str:
    """The payload holding a version's S_v in full: `shadow` where the manifest lists one,
    else `params` (S_v = Theta_v)."""
    sizes = manifest.get("nbytes")
    return SHADOW if isinstance(sizes, dict) and SHADOW in sizes else "params"


def update_size(manifest: Mapping[str, Any], codec: str) -> int | None:
    """The update payload's size (bytes) a version's manifest lists, or None when it has none
    in `codec` (the island then cannot take this step by update)."""
    sizes = manifest.get("nbytes")
    size = sizes.get(UPDATE) if isinstance(sizes, dict) else None
    if manifest.get(CODEC_FIELD) != codec or not isinstance(size, int) or size < 0:
        return None
    return size


def plan_updates(
    manifests: list[Mapping[str, Any]], codec: str, full_nbytes: int
) -> tuple[bool, int]:
    """Walking back from HEAD (`manifests`, newest first, so far): (keep walking?, bytes).

    Stop (False) as soon as a version has no update in `codec` or the updates' bytes add up
    to more than one full read (`full_nbytes`): k updates are taken only while they cost
    less than reading S_v whole."""
    total = 0
    for m in manifests:
        size = update_size(m, codec)
        if size is None:
            return False, total
        total += size
        if total > full_nbytes:
            return False, total
    return True, total


def read_full(
    store, head: HeadPointer, manifest: dict, shapes: Mapping[str, tuple[int, ...]]
) -> Fetched:
    """S_v of `head`'s version read whole (the `adoptable` payload, verified: at most the
    fragment's float32 size, checksum, then exactly the fragment's tensors in float32). A
    light version (syncer.full_every > 1) holds no shadow: its S_v is a promoted version's
    shadow at or below it, or its full ancestor's, plus the updates after it, each checked and
    added with `step` in order (the merger's arithmetic: the same bits).

    Fall back, never die (docs/STORE.md "What a reader does with a bad object"): a light
    version's complete representations are tried nearest first: its own promotion, a promoted
    version between it and its full ancestor, then the full ancestor; one that fails a check
    (checksum, shape, finiteness, a refused update on its way) is logged and the next one
    tried. CorruptObject only when none of them reads."""
    if records.light_ancestor(manifest) is None or CODEC_FIELD not in manifest:
        return _read_whole(store, head, manifest, shapes)
    chain = store.light_chain(head, manifest)  # [(the full ancestor or promoted), ..., head]
    failed: list[str] = []
    for i in reversed(range(len(chain))):
        pointer, m = chain[i]
        light = records.light_ancestor(m) is not None
        if i > 0 and not _promoted(store, pointer, m):
            continue
        try:
            return _chain_from(store, head, chain[i:], shapes, light)
        except (CorruptObject, ObjectNotFound) as err:
            failed.append(f"from version {pointer.version}: {err}")
            if i > 0:
                log.warning(
                    "fragment %d version %d read from version %d's promotion: %s; trying an "
                    "older representation",
                    head.fragment,
                    head.version,
                    pointer.version,
                    err,
                )
    raise CorruptObject(
        f"fragment {head.fragment} version {head.version}: no complete representation reads ("
        + "; ".join(failed)
        + ")"
    )


def _promoted(store, pointer: HeadPointer, manifest: dict) -> bool:
    """Whether the light version `pointer` has a promotion that parses and names it (its
    payloads are checked when read); an untrustworthy marker counts as none."""
    try:
        return store.promotion(pointer, manifest) is not None
    except (CorruptObject, ObjectNotFound):
        return False


def _chain_from(
    store,
    head: HeadPointer,
    chain: list,
    shapes: Mapping[str, tuple[int, ...]],
    promoted: bool,
) -> Fetched:
    """S_v of `head` from `chain[0]` read whole (its promoted shadow when `promoted`) and the
    updates of the versions after it, checked and stepped in order."""
    first, first_manifest = chain[0]
    got = _read_whole(store, first, first_manifest, shapes, promoted=promoted)
    tensors, nbytes = got.tensors, got.nbytes
    for pointer, m in chain[1:]:
        codec = m.get(CODEC_FIELD)
        if not isinstance(codec, str) or update_size(m, codec) is None:
            raise CorruptObject(
                f"fragment {head.fragment} version {pointer.version}: a light version without "
                "an update"
            )
        max_nbytes, max_header = codecs.payload_limits(shapes, codec)
        payload = store.load_payload(pointer, UPDATE, m, max_nbytes, max_header)
        try:
            decoded = check_update(payload, codec, shapes, head.fragment)
        except (ValueError, KeyError) as err:
            raise CorruptObject(
                f"the update of fragment {head.fragment} version {pointer.version} is refused: "
                f"{str(err).strip(chr(39))}"
            ) from None
        tensors = step(tensors, decoded)
        nbytes += codecs.payload_nbytes(payload)
    return Fetched(tensors, nbytes, "full", len(chain) - 1)


def _read_whole(
    store,
    head: HeadPointer,
    manifest: dict,
    shapes: Mapping[str, tuple[int, ...]],
    promoted: bool = False,
) -> Fetched:
    """The `adoptable` payload of a version, verified (read_full's one read); of a promoted
    light version (`promoted`: a full ancestor written in the background,
    training/store/promotions.py), its promoted shadow alone."""
    name = adoptable(manifest)
    limit = codecs.payload_limits(shapes, "fp32")[0]
    if promoted:  # under update broadcast a promotion holds the merger's shadow
        name = SHADOW
        tensors = store.load_promoted_shadow(head, manifest, limit)
        if tensors is None:
            raise CorruptObject(
                f"fragment {head.fragment} version {head.version}: a light version read whole "
                "without a readable promoted shadow"
            )
    else:
        tensors = store.load_payload(head, name, manifest, max_nbytes=limit)
    got = {n: (tuple(v.shape), v.dtype) for n, v in tensors.items()}
    if got != {n: (tuple(s), np.dtype(np.float32)) for n, s in shapes.items()}:
        raise CorruptObject(
            f"fragment {head.fragment} version {head.version}: {name} does not hold the "
            "fragment's float32 tensors"
        )
    bad = sorted(n for n, v in tensors.items() if not all_finite(v))
    if bad:
        raise CorruptObject(
            f"fragment {head.fragment} version {head.version}: {name} tensor {bad[0]!r} has "
            "non-finite values"
        )
    return Fetched(tensors, codecs.payload_nbytes(tensors), "full")


def _chain(store, head: HeadPointer, manifest: dict, shadow: Shadow, codec: str, full: int):
    """[(pointer, manifest)] of versions shadow.version + 1 .. head.version, oldest first, if
    taking them by update is worth it (`plan_updates`) and the chain leads to the shadow's own
    directory; else None."""
    chain = [(head, manifest)]
    while True:
        go, _ = plan_updates([m for _, m in chain], codec, full)
        if not go:
            return None
        pointer, m = chain[-1]
        if pointer.version == shadow.version + 1:
            return chain[::-1] if m.get("parent_dir") == shadow.dir else None
        parent = parent_of(pointer, m)
        if parent is None:
            return None
        chain.append((parent, store.fragment_manifest(parent)))


def fetch(
    store,
    head: HeadPointer,
    manifest: dict,
    shadow: Shadow | None,
    codec: str,
    shapes: Mapping[str, tuple[int, ...]],
) -> Fetched:
    """S_v of `head`'s version for an island holding `shadow` (None: none): by updates where
    that is possible and cheaper, else (also when an update is missing or refused: a warning,
    nothing is lost) read whole. Store errors other than a missing or corrupt object propagate
    (the adopt is tried again as before)."""
    if shadow is None or shadow.version >= head.version:
        return read_full(store, head, manifest, shapes)
    max_nbytes, max_header = codecs.payload_limits(shapes, codec)
    try:
        # a light version without params records their size: S_v whole costs as much
        full = manifest["nbytes"].get(adoptable(manifest), manifest.get("params_nbytes"))
        full = full if isinstance(full, int) else -1
        chain = _chain(store, head, manifest, shadow, codec, full)
        if chain is not None:
            tensors, nbytes = dict(shadow.tensors), 0
            for pointer, m in chain:
                payload = store.load_payload(pointer, UPDATE, m, max_nbytes, max_header)
                what = f"the update of fragment {head.fragment} version {pointer.version}"
                try:
                    decoded = check_update(payload, codec, shapes, head.fragment)
                except (ValueError, KeyError) as err:
                    raise CorruptObject(f"{what} is refused: {str(err).strip(chr(39))}") from None
                tensors = step(tensors, decoded)
                nbytes += codecs.payload_nbytes(payload)
            return Fetched(tensors, nbytes, "updates", len(chain))
    except (CorruptObject, ObjectNotFound) as err:
        log.warning("fragment %d: %s; reading version %d whole", head.fragment, err, head.version)
    return read_full(store, head, manifest, shapes)
