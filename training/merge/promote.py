"""A merger's promotions of its light versions (training/store/promotions.py): what it writes
in the background, and which versions its next merges may name as their full ancestor.

With `syncer.full_in_background` a merge that falls due for a full version (every
`syncer.full_every`-th, or after `full_every_s`) publishes a light version like the others, and
its full state is written beside it by a background thread while the next merges go on. The
arrays written are the merger's own (no copy): the fragment's next merge waits for its write
(`wait`) before it changes them. Once the promotion's full.json is committed, the fragment's
later versions name that version as their full ancestor (`ancestor`): a cold start, a reader or
garbage collection then starts there. Until then they name the full ancestor they named before
(a version between the two names the older one: docs/STORE.md, "Light versions").

A promotion that fails (a store error) is logged; the fragment keeps its older ancestor, and the
next due merge tries again. Nothing here decides what is committed: a promotion is written only
for a version already committed, from the arrays that made it (their params checksum checked
against the manifest before anything is written).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from training.store.experiment import ExperimentStore, HeadPointer

log = logging.getLogger(__name__)


class BackgroundPromotions:
    """One merger's background promotions: at most one write in flight per fragment, one
    thread for all (the writes are I/O; the merges go on in the merger's thread)."""

    def __init__(self, store: ExperimentStore):
        self.store = store
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self.promoted: dict[int, tuple[int, str]] = {}  # fragment -> (version, dir), committed

    def submit(self, head: HeadPointer, params: dict, outer: dict, shadow: dict | None) -> None:
        """Promote the light version `head` names in the background, from these arrays (held
        unchanged until `wait(head.fragment)` returns)."""
        self.wait(head.fragment)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="promote")
        self._pending[head.fragment] = self._pool.submit(self._promote, head, params, outer, shadow)

    def _promote(self, head: HeadPointer, params, outer, shadow) -> None:
        manifest = self.store.fragment_manifest(head)
        if self.store.promote_version(head, manifest, params, outer, shadow) or (
            self.store.promotion(head, manifest) is not None  # written by a rerun before
        ):
            self.promoted[head.fragment] = (head.version, head.dir)
            log.info("fragment %d: version %d written full (promoted)", head.fragment, head.version)

    def wait(self, fragment: int) -> None:
        """Until fragment `fragment`'s write in flight (if any) is over; its error is logged."""
        future = self._pending.pop(fragment, None)
        if future is None:
            return
        try:
            future.result()
        except Exception as err:  # the store's, or a refused promotion: the older ancestor stays
            log.warning("fragment %d: background full version not written: %s", fragment, err)

    def wait_all(self) -> None:
        for fragment in list(self._pending):
            self.wait(fragment)

    def ancestor(self, fragment: int, named: tuple[int, str], on_chain) -> tuple[int, str]:
        """The full ancestor the next version of `fragment` names: the newest committed
        promotion of this merger when it is newer than `named` (what the HEAD names, or HEAD
        itself when full) and `on_chain(version, dir)` (it is an ancestor of HEAD), else
        `named`."""
        self.wait(fragment)
        done = self.promoted.get(fragment)
        if done is not None and done[0] > named[0] and on_chain(*done):
            return done
        return named
