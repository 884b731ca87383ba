"""The island checkpoint: when it is due, what it holds, and the strict reader of what comes back.

A checkpoint holds what the store does not: the island's parameters (`param/<name>`), its AdamW
state (`opt/<leaf>`), the codec residuals (`resid/<name>`), and each fragment's anchor (the point
its next pseudo-gradient is measured from) only where the store cannot give it back. Per
fragment, `meta["anchor"]` says which (island_records.ANCHOR_KINDS):

- `version`: the anchor is exactly fragment p's base version (`meta["base_version"][p]`), as
  after a fresh start or adopting a merge (keep_overlap, or overwrite): not in the checkpoint; a
  resumed island reads that version from the store (the store's garbage collection keeps every
  version a checkpoint names);
- `params`: the fragment was published at the step of the checkpoint, so its anchor is the
  checkpointed parameters themselves: not stored twice;
- `saved`: anything else (published and not adopted since, or blended with `inner.alpha`):
  `anchor/<name>` tensors in the checkpoint.

So the global base is never in a checkpoint, and with a syncer that merges within `tau` steps
only the fragments published in the last `tau` steps carry an anchor.

Cost on the critical path (Island, background mode): one jitted device copy of the parameters
and AdamW state (the next steps donate the originals), dispatched between two steps; the write
itself streams from that copy in a background thread. So a checkpoint in flight costs one more
copy of the parameters and moments in device memory, and no host memory beyond one tensor.

When (`checkpoint_due`, `ExperimentConfig.checkpoint`): after `every_rounds` publish rounds or
`every_s` seconds, and always on SIGTERM and on finishing (Island.run). The loss bound that
policy implies is in training/config/experiment.py's `CheckpointConfig`.

Each step counted once (docs/STORE.md "Each step counted once"): the island publishes its P
fragments one after another and checkpoints after them, so a kill in between leaves
contributions committed past the checkpoint it resumes from. Its own manifests are the truth:
at its start it lists those from the checkpoint's seq on (`committed_ahead` folds them in,
with what the checkpoint already carried in `meta["committed_to"]`), numbers its next
publishes after them, and for each such fragment trains through those steps again without
publishing them: at the committed island_step its anchor moves to its parameters as a publish
would (`Publisher.skip`), and it counts on from there.

Everything read back is untrusted (`parse_state`): exactly the model's parameters and the
optimizer's leaves with their shapes and dtypes, anchors exactly where `meta` says, residuals
only for known tensors; anything else is `BadCheckpoint`, with a one-line reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from training.config.experiment import CheckpointConfig
from training.store.island_records import ANCHOR_KINDS, BadCheckpoint

PREFIXES = ("param/", "opt/", "anchor/", "resid/")


def checkpoint_due(policy: CheckpointConfig, rounds_since: int, seconds_since: float) -> bool:
    """Whether a checkpoint is due between two steps, `rounds_since` publish rounds and
    `seconds_since` seconds after the last one began."""
    by_rounds = policy.every_rounds > 0 and rounds_since >= policy.every_rounds
    by_time = policy.every_s is not None and seconds_since >= policy.every_s
    return by_rounds or by_time


Ahead = tuple[int, int]
"""A fragment's contribution committed past the island's step: (its island_step, its seq)."""


def committed_ahead(
    step: int,
    carried: Sequence[Sequence[int] | None],
    found: Iterable[tuple[int, int, int]],
) -> list[Ahead | None]:
    """Per fragment, the contribution committed furthest past step `step` (None: none): of
    `carried` (a checkpoint's `committed_to`, one entry per fragment) and `found` ((fragment,
    seq, island_step) of the island's own committed manifests from the checkpoint's seq on).
    Those at or before `step` are no news: the state already counts them."""
    out: list[Ahead | None] = [
        (int(a[0]), int(a[1])) if a is not None and a[0] > step else None for a in carried
    ]
    for p, seq, island_step in found:
        if 0 <= p < len(out) and island_step > step:
            current = out[p]
            if current is None or island_step > current[0]:
                out[p] = (island_step, seq)
    return out


def anchor_kind(kind: str, published_at: int, step: int) -> str:
    """The checkpoint's kind for a fragment whose anchor came from `kind` ("version": a store
    version, "published": its publish at step `published_at`, "blended"), at step `step`."""
    if kind == "version":
        return "version"
    return "params" if kind == "published" and published_at == step else "saved"


@dataclass
class RestoredState:
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]
    anchors: dict[str, np.ndarray]  # the `saved` anchors only
    residual: dict[str, np.ndarray]
    kinds: list[str]


def _check(name: str, array: np.ndarray, shape: tuple[int, ...], dtype: Any) -> None:
    if tuple(array.shape) != tuple(shape) or np.dtype(array.dtype) != np.dtype(dtype):
        raise BadCheckpoint(
            f"checkpoint tensor {name!r} is {array.dtype}{list(array.shape)}, "
            f"expected {np.dtype(dtype)}{list(shape)}"
        )


def parse_state(
    tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    opt_shapes: dict[str, tuple[tuple[int, ...], Any]],
    fragments: list[list[str]],
) -> RestoredState:
    """The checkpoint's tensors, checked against the model: `shapes` (parameter name -> shape,
    float32), `opt_shapes` (leaf name -> (shape, dtype)), `fragments` (names per fragment).
    `meta` is already parsed (island_records.parse_checkpoint_meta); a meta without `anchor` (an
    older checkpoint) has every anchor saved. BadCheckpoint on any mismatch."""
    bases = meta.get("base_version")
    if not isinstance(bases, list) or len(bases) != len(fragments):
        raise BadCheckpoint(f"checkpoint base_version is not one version per fragment: {bases!r}")
    kinds = meta.get("anchor", ["saved"] * len(fragments))
    if len(kinds) != len(fragments) or any(k not in ANCHOR_KINDS for k in kinds):
        raise BadCheckpoint(f"checkpoint anchor kinds {kinds!r} do not match the fragments")
    parts: dict[str, dict[str, np.ndarray]] = {prefix: {} for prefix in PREFIXES}
    for key, array in tensors.items():
        prefix = next((p for p in PREFIXES if key.startswith(p)), None)
        if prefix is None:
            raise BadCheckpoint(f"checkpoint tensor {key[:80]!r} is not part of an island state")
        parts[prefix][key[len(prefix) :]] = array
    params, opt = parts["param/"], parts["opt/"]
    if set(params) != set(shapes):
        raise BadCheckpoint(
            f"checkpoint parameters differ from the model's: {_diff(params, shapes)}"
        )
    for name, shape in shapes.items():
        _check(f"param/{name}", params[name], shape, np.float32)
    if set(opt) != set(opt_shapes):
        raise BadCheckpoint(f"checkpoint optimizer state differs: {_diff(opt, opt_shapes)}")
    for name, (shape, dtype) in opt_shapes.items():
        _check(f"opt/{name}", opt[name], shape, dtype)
    wanted = {n for p, names in enumerate(fragments) if kinds[p] == "saved" for n in names}
    anchors = parts["anchor/"]
    if set(anchors) != wanted:
        raise BadCheckpoint(f"checkpoint anchors differ from its meta: {_diff(anchors, wanted)}")
    for name in anchors:
        _check(f"anchor/{name}", anchors[name], shapes[name], np.float32)
    residual = parts["resid/"]
    unknown = sorted(set(residual) - set(shapes))
    if unknown:
        raise BadCheckpoint(f"checkpoint residuals of unknown tensors: {unknown[:3]}")
    for name in residual:
        _check(f"resid/{name}", residual[name], shapes[name], np.float32)
    return RestoredState(params, opt, anchors, residual, list(kinds))


def _diff(got, wanted) -> str:
    extra, missing = sorted(set(got) - set(wanted)), sorted(set(wanted) - set(got))
    return f"extra {extra[:3]}, missing {missing[:3]}"
