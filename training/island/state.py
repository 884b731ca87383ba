"""An island's training state: one typed structure, made fresh or resumed, and checkpointed.

`IslandState` is everything an island's training *is* between two steps: its parameters, AdamW
state, each fragment's anchor and codec residual (device arrays, exactly as the train step and
the device encoder take and return them), the global version each fragment stands on (with its
broadcast shadow), the counters, and the data loader with its cursor. It comes into being in
one of two ways and is written in one:

- `IslandState.fresh(...)`: from the newest global versions (read by the island's adopt path);
- `IslandState.resume(...)`: from the island's checkpoint (checked by
  `checkpointing.parse_state`), reading from the store only the anchors it names by version;
- `state.checkpoint(...)`: the tensors and meta the checkpoint writer stores
  (training/island/checkpoint.py says what a checkpoint holds and why). `resume` of a checkpoint
  gives back a state whose checkpoint is the same (tests/test_island_state.py).

The state holds the island's own arrays and never copies them: the step, the publish and the
adopt rebind or update its fields in place (`state.params = ...`, `state.anchor.update(...)`);
only `checkpoint(copy=True)` (a background writer: the next steps donate the parameters and
moments) copies, on the devices. Each fragment's anchor (the point its next pseudo-gradient is
measured from) came from one of three places, `anchor_from[p]`: "version" (exactly its base
version), "published" (the parameters at its publish, step `published_at[p]`), "blended".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from training.data.batches import BatchLoader
from training.island import checkpoint as checkpointing
from training.protocol import broadcast

ReadVersion = Callable[[int, int], tuple[Any, broadcast.Fetched]]
"""(fragment, version) -> (its head pointer, its parameters as islands adopt them)."""


@dataclass(eq=False)  # device arrays: compare with `checkpoint()` instead
class IslandState:
    params: dict[str, Any]  # device arrays, donated by each step
    opt_state: Any  # the AdamW state, as the train step takes it
    anchor: dict[str, Any]  # per parameter: the point its next pseudo-gradient is measured from
    residual: dict[str, Any]  # the codec's error-feedback residuals (empty until a publish)
    base_version: list[int]  # per fragment: the global version this island stands on
    anchor_from: list[str]  # per fragment: version / published / blended
    published_at: list[int]  # per fragment: the step of its last publish (-1: none since resume)
    shadows: dict[int, broadcast.Shadow]  # per fragment: its adopted S_v (broadcast "codec")
    loader: BatchLoader  # the island's batches, and its cursor
    # per fragment: (island_step, seq) of a contribution the island's previous process
    # committed past this state's step, whose steps it does not publish again (checkpoint.py)
    committed_to: list[checkpointing.Ahead | None] | None = None
    seq: int = 0  # the next pseudo-gradient sequence number
    step_count: int = 0
    tokens: int = 0
    publishes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @classmethod
    def fresh(
        cls,
        loop,
        heads: Sequence[Any],
        got: Sequence[broadcast.Fetched],
        loader: BatchLoader,
        keep_shadows: bool,
    ) -> IslandState:
        """Step 0 on the global versions `heads` (one per fragment, in order), whose
        parameters are `got`: new AdamW state, anchors at those versions, no residuals.
        `keep_shadows`: hold each version's S_v (`outer.broadcast = "codec"`)."""
        params: dict[str, np.ndarray] = {}
        shadows: dict[int, broadcast.Shadow] = {}
        for head, fetched in zip(heads, got, strict=True):
            params.update(fetched.tensors)
            if keep_shadows:
                shadows[head.fragment] = shadow_of(head, fetched)
        device = loop.put_params(params)
        return cls(
            params=device,
            opt_state=loop.init_opt_state(device),
            anchor=loop.copy(device),
            residual={},
            base_version=[h.version for h in heads],
            anchor_from=["version"] * len(heads),
            published_at=[-1] * len(heads),
            shadows=shadows,
            loader=loader,
            bytes_received=sum(f.nbytes for f in got),
        )

    @classmethod
    def resume(
        cls,
        loop,
        frags: Sequence[Sequence[str]],
        tensors: dict[str, np.ndarray],
        meta: dict[str, Any],
        read_version: ReadVersion,
        loader_for: Callable[[Any], BatchLoader],
        keep_shadows: bool,
    ) -> IslandState:
        """The state a checkpoint holds (`tensors`, `meta`: untrusted, checked by
        `checkpointing.parse_state`; raises BadCheckpoint). A fragment whose anchor is its base
        version is read with `read_version` (its bytes are not counted as received); the
        loader is `loader_for(meta["cursor"])`."""
        parsed = checkpointing.parse_state(
            tensors, meta, loop.param_shapes, loop.opt_leaf_shapes, frags
        )
        params = loop.put_params(parsed.params)
        opt_state = loop.opt_state_from_host(parsed.opt)
        base_version = list(meta["base_version"])
        anchors = dict(parsed.anchors)
        anchor_from = ["version"] * len(frags)
        shadows: dict[int, broadcast.Shadow] = {}
        for p, kind in enumerate(parsed.kinds):
            if kind == "version":
                head, got = read_version(p, base_version[p])
                anchors.update(got.tensors)
                if keep_shadows:
                    shadows[p] = shadow_of(head, got)
            elif kind == "params":
                anchors.update({n: parsed.params[n] for n in frags[p]})
                anchor_from[p] = "published"
            else:
                anchor_from[p] = "blended"  # saved: not a version, not the parameters
        step = int(meta["step"])
        return cls(
            params=params,
            opt_state=opt_state,
            anchor=loop.put_params(anchors),
            residual=loop.put_params(parsed.residual),
            base_version=base_version,
            anchor_from=anchor_from,
            published_at=[step if k == "params" else -1 for k in parsed.kinds],
            shadows=shadows,
            loader=loader_for(meta["cursor"]),
            seq=int(meta["seq"]),
            step_count=step,
            tokens=int(meta["tokens"]),
            publishes=int(meta.get("publishes", 0)),
            bytes_sent=int(meta.get("bytes_sent", 0)),
            bytes_received=int(meta.get("bytes_received", 0)),
            committed_to=checkpointing.committed_ahead(
                step, meta.get("committed_to") or [None] * len(frags), ()
            ),
        )

    def __post_init__(self) -> None:
        if self.committed_to is None:
            self.committed_to = [None] * len(self.base_version)

    def checkpoint(
        self, loop, frags: Sequence[Sequence[str]], copy: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors, meta) of a checkpoint of this state, taken now (between two steps): the
        parameters and AdamW state (on-device copies with `copy`), the anchors the store cannot
        give back, the residuals, and the counters and data cursor in `meta` (the caller adds
        what is not training state, e.g. the goodput ledger). Never the global base."""
        step = self.step_count
        kinds = [
            checkpointing.anchor_kind(self.anchor_from[p], self.published_at[p], step)
            for p in range(len(frags))
        ]
        params, opt = self.params, loop.opt_state_named(self.opt_state)
        if copy:
            params, opt = loop.copy((params, opt))
        tensors: dict[str, Any] = {f"param/{k}": v for k, v in params.items()}
        tensors.update({f"opt/{k}": v for k, v in opt.items()})
        for p, kind in enumerate(kinds):
            if kind == "saved":
                tensors.update({f"anchor/{n}": self.anchor[n] for n in frags[p]})
        tensors.update({f"resid/{k}": v for k, v in self.residual.items()})
        meta = dict(
            base_version=list(self.base_version),
            anchor=kinds,
            seq=self.seq,
            step=step,
            tokens=self.tokens,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            publishes=self.publishes,
            cursor=self.loader.state(),
            committed_to=[None if a is None else list(a) for a in self.committed_to],
        )
        return tensors, meta


def shadow_of(head, got: broadcast.Fetched) -> broadcast.Shadow:
    """The adopted version's S_v as the island holds it for the next update: a host copy of
    its own (the arrays read may back the device's, which steps donate)."""
    tensors = {n: np.array(v, np.float32, copy=True) for n, v in got.tensors.items()}
    return broadcast.Shadow(head.version, head.dir, tensors)
