"""A merger's fragment states between merges: the arrays of the versions it published last,
kept resident within a byte limit (training/merge/memory.py sizes it), read back or replayed
when it holds none, and promoted before its memory goes.

A merge takes its fragment's arrays (`FragmentStates.take`): those this merger published as the
very version HEAD names if it still holds them (the bytes it checksummed: nothing read back,
nothing replayed), else the version read and verified from the store, or, for a light HEAD, its
nearest full version with the merges since re-applied (replay.state_at: a cold start). The merge
mutates them in place and hands the new version's arrays back (`keep`); the oldest are let go
first when they no longer fit. `promote_heads` writes the full state of each light HEAD still
held, so whoever merges it next starts there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from training.config.experiment import ExperimentConfig
from training.merge import apply, replay
from training.merge.promote import BackgroundPromotions
from training.protocol import broadcast
from training.store import merge_records as records
from training.store.experiment import ExperimentStore, HeadPointer

log = logging.getLogger("diloco.merge")


class Warm(NamedTuple):
    """A fragment version's state a merger keeps resident for its next merge of it."""

    dir: str  # the version's directory (HEAD must still name it)
    params: dict
    outer: dict  # the outer-state tensors
    shadow: dict | None  # the broadcast shadow (None: broadcast off, or S = params)
    nbytes: int
    params_sq: dict | None  # the params' per-chunk sums of squares (the outer step took them)


class FragmentStates:
    """One merger's fragment states: `warm` (fragment -> Warm) within `limit` bytes in all."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        store: ExperimentStore,
        shapes: Sequence[Mapping[str, tuple[int, ...]]],
        limit: int,
        promotions: BackgroundPromotions,
    ):
        self.cfg = cfg
        self.store = store
        self.shapes = shapes
        self.limit = limit
        self.promotions = promotions
        self.warm: dict[int, Warm] = {}

    def take(self, head: HeadPointer, manifest: dict):
        """(params, outer-state tensors, broadcast shadow, the params' per-chunk sums of
        squares or None) of the version `head` names, writable: the arrays this merger
        published as that very version if it still holds them (HEAD names the directory it
        wrote: the bytes are those it checksummed), else read and verified from the store. The
        shadow is None when broadcast is off or the version has none (then S = its params).
        Taken out of the warm set either way: the merge mutates them."""
        self.promotions.wait(head.fragment)  # its arrays may still be being written
        warm = self.warm.pop(head.fragment, None)
        if warm is not None and warm.dir == head.dir:
            shadow = warm.shadow if broadcast.enabled(self.cfg) else None
            return warm.params, warm.outer, shadow, warm.params_sq
        shapes = self.shapes[head.fragment]
        if records.light_ancestor(manifest) is None:
            return (*apply.load_arrays(self.cfg, self.store, head, manifest, shapes), None)
        # a light HEAD and nothing warm (a cold start: after a crash, on another worker): its
        # nearest full version and the merges since re-applied, each checked (replay.state_at)
        started = time.monotonic()
        state = replay.state_at(
            self.cfg,
            self.store,
            shapes,
            head,
            manifest,
            lambda version: self.store.hit_fault("merge.cold-replay"),
        )
        log.info(
            "fragment %d: cold start at version %d, replayed from its full version in %.2f s",
            head.fragment,
            head.version,
            time.monotonic() - started,
        )
        return state.params, state.outer, state.shadow, None

    def keep(
        self,
        fragment: int,
        directory: str,
        params: dict,
        outer_tensors: dict,
        shadow: dict | None = None,
        params_sq: dict | None = None,
    ) -> None:
        """Hold a just-published version's arrays (and its params' norm terms) for the next
        merge of its fragment, within `limit` in all (the oldest let go first)."""
        size = sum(v.nbytes for d in (params, outer_tensors, shadow or {}) for v in d.values())
        self.warm[fragment] = Warm(directory, params, outer_tensors, shadow, size, params_sq)
        while sum(w.nbytes for w in self.warm.values()) > self.limit:
            self.warm.pop(next(iter(self.warm)))

    def promote_heads(
        self, fragments: Sequence[int], manifest_of: Callable[[HeadPointer], dict]
    ) -> list[int]:
        """Promote each of `fragments`' light HEAD held warm (this merger published that very
        version and nothing has merged it since): its params, outer state and shadow written
        beside it (training/store/promotions.py). Returns the fragments promoted now; a HEAD
        another merger moved is left."""
        self.promotions.wait_all()
        promoted = []
        for p in fragments:
            warm = self.warm.get(p)
            head = self.store.head(p)
            if warm is None or head is None or head.dir != warm.dir:
                continue
            manifest = manifest_of(head)
            params, outer_tensors, shadow = warm.params, warm.outer, warm.shadow
            if broadcast.enabled(self.cfg) and shadow is None:
                shadow = params  # S = Theta (a version made without a shadow)
            if self.store.promote_version(head, manifest, params, outer_tensors, shadow):
                log.info("fragment %d: promoted light version %d", p, head.version)
                self.promotions.promoted[p] = (head.version, head.dir)  # later ones name it
                promoted.append(p)
        return promoted
