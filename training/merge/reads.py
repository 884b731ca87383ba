"""A merger's reads of what it merges: the contributions' payloads, fetched ahead in the order
the merge sums them (training/merge/fetch.py) into read buffers reused merge after merge
(training/store/buffers.py), and the params of a base version a stale vote is re-anchored from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from training.codecs import host as codecs
from training.merge import apply
from training.merge.admit import Candidate
from training.merge.fetch import Prefetch
from training.store.buffers import BufferPool
from training.store.experiment import ExperimentStore, PseudoGradRef
from training.store.objectstore import StoreError, StoreUnreachable, TransientStoreError

log = logging.getLogger("diloco.merge")


def ref_of(c: Candidate) -> PseudoGradRef:
    """The pseudo-gradient a candidate names, as the store reads it."""
    payload = c.manifest.get("payload")
    return PseudoGradRef(
        c.island,
        c.seq,
        c.fragment,
        c.id,
        dict(c.manifest),
        payload if isinstance(payload, str) else "",
    )


class MergeReads:
    """One merger's reads: `start` a merge's payload downloads, `payload` them in order,
    `base_params` of a version, `reset` between merges (the last merge's payloads are dead)."""

    def __init__(
        self,
        store: ExperimentStore,
        shapes: Sequence[Mapping[str, tuple[int, ...]]],
        concurrency: int,
    ):
        self.store = store
        self.shapes = shapes
        self.concurrency = concurrency
        # the payloads' read buffers (and the merger's update codes), reused merge after merge
        self.buffers = BufferPool()
        self._fetch = Prefetch([], self._load, 1)  # a merge's payload downloads
        self._fragment_limits = [apply.fragment_limits(s) for s in shapes]

    def reset(self) -> None:
        """The last merge's downloads stopped, its buffers free again."""
        self._fetch.close(wait=True)
        self.buffers.release_all()

    def _load(self, item) -> dict[str, np.ndarray]:
        c, max_nbytes, max_header = item
        return self.store.load_pseudograd(
            ref_of(c),
            max_nbytes,
            max_header,
            f" of fragment {c.fragment} in {c.codec}",
            into=self.buffers.take,
        )

    def start(self, groups: Iterable[Sequence[Candidate]]) -> None:
        """Start fetching the payloads of `groups` in the order apply._vote sums them
        (training/merge/fetch.py): groups, islands sorted, contributions in group order."""
        self._fetch.close()  # an earlier merge's, if it ended early (an error)
        order = []
        for group in groups:
            for c in sorted(group, key=lambda c: c.island):  # stable: group order per island
                limits = codecs.payload_limits(self.shapes[c.fragment], c.codec)
                order.append((c.id, (c, *limits)))
        self._fetch = Prefetch(order, self._load, self.concurrency)

    def payload(self, c: Candidate, *limits) -> dict[str, np.ndarray]:
        """The payload of `c` (started by `start`), read within its `limits`."""
        return self._fetch.get(c.id, (c, *limits))

    def base_params(self, fragment: int, version: int) -> dict | None:
        """The params of fragment version `version`, for a stale vote re-anchored at the
        fragment as it stands (apply._anchored_now). A version the store no longer holds
        (garbage-collected) or refuses: None (the vote stays anchored at its base), logged."""
        try:
            at = self.store.find_version(fragment, version)
            return self.store.load_fragment(at, max_nbytes=self._fragment_limits[fragment]).params
        except (TransientStoreError, StoreUnreachable):
            raise  # the store's fault, not the base's: retry later
        except StoreError as err:  # collected (ObjectNotFound) or refused
            log.warning(
                "fragment %d: version %d unreadable, votes anchored at it stay so: %s",
                fragment,
                version,
                err,
            )
            return None
