"""An island's adopt path: which global versions it takes, when, and how they enter its state.

`tau` steps after a publish of fragment p the island looks for p's newest version and takes it
*if it is newer than the one it has* (`theta <- alpha * theta + (1 - alpha) * Theta`, or the
overlap steps kept on top), reading only that fragment's parameters, never the outer state:
with `outer.broadcast = "codec"` as small codec-encoded updates to the island's copy of the
fragment's broadcast shadow, which is what it adopts (training/protocol/broadcast.py). A merge that lands
later than `tau` steps is looked for again at every step, for up to H_m // 2 steps, and only a
version holding the island's publish is taken (`Adopter.rearm`): a real syncer is some hundreds
of milliseconds behind, and one look that misses left the island training a whole interval on
a stale base (the demo's staleness of 2 to 4 versions). The synchronous baseline (`outer.method
= "sync"`) instead blocks after each publish until that round is merged (`awaiting`).

An adopt is two halves: `fetch` (store reads only: the island's fetch thread's, in background
mode) and `apply` (on the devices, at the first step boundary after the reads are in).
Multi-host islands adopt what process 0 fetched (`agreed`): the same (fragment, version) list on
every process, each with its own read of those immutable versions.

One bad object stops no one (docs/STORE.md "What a reader does with a bad object"): a version
that no complete representation of reads (broadcast.read_full tries them all) is logged once,
with the reason, and passed over: the island keeps training on the version it has and takes
the next one the syncer publishes. At a start, a fragment whose newest version does not read
starts from the newest of its older versions that does (`read_heads`); the island exits only
when none does.
"""

from __future__ import annotations

import logging
import re
import time
from functools import partial
from typing import Any

import jax
import numpy as np

from training.island.background import Background
from training.island.state import IslandState, shadow_of
from training.model.runtime import shared
from training.protocol import broadcast
from training.store import merge_records
from training.store.keys import FRAGMENT_DIR
from training.store.layout import parent_of
from training.store.objectstore import CorruptObject

log = logging.getLogger("diloco.island")

BAD_OBJECT = re.compile(FRAGMENT_DIR.pattern + r"/[A-Za-z0-9_.]+")
"""An object of a fragment version named in a read's error (what a warning blames)."""


class Adopter:
    """The adopt schedule of one island and the reads and device work of each adopt.

    `pending`: fragment -> the step at which to look for its newest version; `wait`: fragment
    -> (seq of this island's last publish of it, the step until which only a version holding
    that publish is taken); `awaiting` (sync baseline): fragment -> the pseudo-gradient whose
    merge the island waits for; `fetches`: adopts whose store reads are in flight, in order.
    """

    def __init__(self, cfg, name: str, store, group, loop, frags, H: int, clock=time.time):
        self.cfg = cfg
        self.clock = clock
        # seconds per fragment version read (a moving average of the fetch thread's reads):
        # what the syncer's automatic quorum weighs against the round (training/merge/quorum.py)
        self.download_s: float | None = None
        self.name = name
        self.store = store
        self.group = group
        self.loop = loop
        self.frags = frags
        self.H = H
        self.pending: dict[int, int] = {}
        self.wait: dict[int, tuple[int, int]] = {}
        self.unreadable: dict[str, str] = {}  # version directory -> why it does not read
        self.named: set[str] = set()  # the objects those warnings named
        self.awaiting: dict[int, str] = {}
        self.fetches: list[Any] = []

    def clear(self) -> None:
        """Forget the schedule (a start: nothing is pending, nothing in flight)."""
        self.pending, self.wait, self.awaiting, self.fetches = {}, {}, {}, []

    # -- reads --------------------------------------------------------------------------------

    def read_full(self, head) -> broadcast.Fetched:
        """A version's parameters as islands adopt them (its broadcast shadow S_v, which is
        its params where it has no shadow), read whole and verified."""
        manifest = self.store.fragment_manifest(head)
        return broadcast.read_full(self.store, head, manifest, self.shapes(head.fragment))

    def read_version(self, p: int, version: int) -> tuple[Any, broadcast.Fetched]:
        """Fragment p's `version` (a checkpoint's base version): its head and parameters."""
        head = self.store.find_version(p, version)
        return head, self.read_full(head)

    def read_heads(self) -> tuple[list, list[broadcast.Fetched]]:
        """Every fragment's newest readable version (as process 0 saw it) and its parameters:
        a head that does not read is passed over for its newest older version that does."""
        heads = self.agreed_heads(self.store.heads(range(len(self.frags))))
        got = self.store.parallel(self._newest_readable, heads)
        versions = self.group.agree(lambda: [pointer.version for pointer, _ in got])
        out_heads, out_got = [], []
        for (pointer, fetched), version in zip(got, versions, strict=True):
            if pointer.version != version:  # a follower takes the version process 0 read
                pointer = self.store.find_version(pointer.fragment, version)
                fetched = self.read_full(pointer)
            out_heads.append(pointer)
            out_got.append(fetched)
        return out_heads, out_got

    def _newest_readable(self, head) -> tuple[Any, broadcast.Fetched]:
        """`head`, or the newest of its ancestors whose parameters read, and those parameters
        (RuntimeError, one line, when none does: the island cannot train)."""
        pointer = head
        while True:
            try:
                return pointer, self.read_full(pointer)
            except CorruptObject as err:
                self._unreadable(pointer, err)
                parent = parent_of(pointer, self.store.fragment_manifest(pointer))
                if parent is None:
                    raise RuntimeError(
                        f"island {self.name}: no version of fragment {head.fragment} reads "
                        f"(the last tried, {pointer.version}: {err})"
                    ) from None
                pointer = parent

    def _unreadable(self, head, err: Exception) -> None:
        """Log once that `head`'s version does not read, and why; it is passed over. The
        objects to blame are named once: a later version that fails only on objects already
        named (its update chain runs through them) gets an INFO line that points back."""
        if head.dir in self.unreadable:
            return
        why = str(err)
        objects = {m.group(0) for m in BAD_OBJECT.finditer(why)}
        named = bool(objects) and objects <= self.named
        self.unreadable[head.dir] = why
        self.named |= objects
        if named:
            log.info(
                "island %s: fragment %d version %d does not read either (the object named "
                "above), passed over",
                self.name,
                head.fragment,
                head.version,
            )
            return
        log.warning(
            "island %s: fragment %d version %d does not read, passed over (keeps training on "
            "what it has): %s",
            self.name,
            head.fragment,
            head.version,
            err,
        )

    def shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.loop.param_shapes[n]) for n in self.frags[p]}

    def agreed_heads(self, heads: list) -> list:
        """Every fragment's head as process 0 saw it (a follower that saw another version
        looks up that one); raises when a fragment has none (no `init`)."""
        if any(h is None for h in heads) and self.group.writer:
            raise RuntimeError(f"experiment {self.cfg.name!r} has no global version: run init")
        versions = self.group.agree(lambda: [h.version for h in heads])
        return [
            h if h is not None and h.version == v else self.store.find_version(p, v)
            for p, (h, v) in enumerate(zip(heads, versions, strict=True))
        ]

    # -- one adopt ----------------------------------------------------------------------------

    def adopt(self, state: IslandState, fragments) -> int:
        """Take each fragment's newest version if it is newer than the one this island has;
        returns how many fragments moved (`fetch`, then `apply`, inline)."""
        return self.apply(state, self.agreed(self.fetch(state, {p: None for p in fragments})))

    def fetch(self, state: IslandState, wants: dict[int, int | None]) -> list[tuple[int, Any, Any]]:
        """(fragment, head, broadcast.Fetched or None) per fragment of `wants` whose newest
        version is newer than this island's: store reads only (the fetch thread's part of an
        adopt). With `outer.broadcast = "codec"` the version comes as updates to this island's
        shadow where it can (training/broadcast.fetch), else whole. `wants[p]`, when not None,
        is a sequence number of this island's: a version whose merge cursors do not reach it
        yet is not downloaded (None; `apply` tries again a step later), so an island waiting
        for the merge of its own publish reads the fragment once, when it holds it."""
        wanted = list(wants)
        out = []
        for p, head in zip(wanted, self.store.heads(wanted), strict=True):
            if head is None or head.version <= state.base_version[p]:
                out.append((p, None, None))
                continue
            if head.dir in self.unreadable:  # logged once; the next version is looked for
                out.append((p, head, None))
                continue
            manifest = self.store.fragment_manifest(head)
            if wants[p] is not None and merged_seq(manifest, self.name) < wants[p]:
                out.append((p, head, None))
                continue
            started = self.clock()
            try:
                if broadcast.enabled(self.cfg):
                    got = broadcast.fetch(
                        self.store,
                        head,
                        manifest,
                        state.shadows.get(p),
                        self.cfg.codec,
                        self.shapes(p),
                    )
                else:
                    got = broadcast.read_full(self.store, head, manifest, self.shapes(p))
            except CorruptObject as err:
                self._unreadable(head, err)
                out.append((p, head, None))
                continue
            self._timed(self.clock() - started, head.version - state.base_version[p])
            out.append((p, head, got))
        return out

    def _timed(self, seconds: float, versions: int) -> None:
        """Fold one read of `versions` newer versions of a fragment into `download_s`."""
        each = max(0.0, seconds) / max(1, versions)
        self.download_s = each if self.download_s is None else 0.7 * self.download_s + 0.3 * each

    def agreed(self, fetched: list) -> list:
        """`fetch`'s result as process 0 fetched it: the same (fragment, version or None) list
        on every process, each with its own read of those immutable versions (a follower that
        read another version reads the chosen one; None: nothing to adopt, look again)."""
        if self.group.single:
            return fetched
        chosen = self.group.agree(
            lambda: [[p, None if fresh is None else head.version] for p, head, fresh in fetched]
        )
        mine = {(p, h.version): (p, h, fresh) for p, h, fresh in fetched if fresh is not None}
        out = []
        for p, version in chosen:
            if version is None:
                out.append((p, None, None))
                continue
            got = mine.get((p, version))
            if got is None:
                head = self.store.find_version(p, version)
                got = (p, head, self.read_full(head))
            out.append(got)
        return out

    def apply(self, state: IslandState, fetched) -> int:
        """Adopt fetched versions still newer than this island's.

        With `inner.keep_overlap` the steps trained since the fragment was published are kept on
        top of it (`theta <- Theta + (theta - anchor)`): they are in no pseudo-gradient yet, so
        nothing is counted twice and the overlap steps are not wasted (whenever the version
        arrives). Else the fragment is overwritten, or blended with `inner.alpha`. The anchor
        moves to the adopted version (for a blend, to the blended point less its unpublished
        steps). Computed on the devices.
        """
        moved = 0
        mode = "keep" if self.cfg.inner.keep_overlap else "blend" if self.cfg.inner.alpha else "set"
        for p, head, fresh in fetched:
            if fresh is None or head.version <= state.base_version[p]:
                self.rearm(state, p)  # nothing (of ours) yet: keep training on our parameters
                continue
            self.wait.pop(p, None)
            state.bytes_received += fresh.nbytes
            if broadcast.enabled(self.cfg):
                state.shadows[head.fragment] = shadow_of(head, fresh)
            names = self.frags[p]
            new, anchor = _adopt_fn(mode)(
                list(self.loop.put_params({n: fresh.tensors[n] for n in names}).values()),
                [state.params[n] for n in names],
                [state.anchor[n] for n in names],
                np.float32(self.cfg.inner.alpha),
            )
            state.params.update(zip(names, new, strict=True))
            state.anchor.update(zip(names, anchor, strict=True))
            state.anchor_from[p] = "blended" if mode == "blend" else "version"
            state.base_version[p] = head.version
            moved += 1
        return moved

    # -- the schedule -------------------------------------------------------------------------

    def published(self, p: int, seq: int, pg_id: str, step: int) -> None:
        """Fragment p was published (as `seq`, `pg_id`) after step `step`: sync, wait for its
        merge; else look for a newer version `tau` steps later, and for one holding this
        publish every step for H_m // 2 steps after it."""
        if self.cfg.outer.method == "sync":
            self.awaiting[p] = pg_id
        else:
            self.pending[p] = step + self.cfg.inner.tau
            self.wait[p] = (seq, step + max(1, self.H // 2))

    def rearm(self, state: IslandState, p: int) -> None:
        """Look again for fragment p while this island waits for the merge of its last
        publish of p (`wait`): every step for up to H_m // 2 steps after that publish (only a
        version holding it is taken), then every H_m // 4 steps for any newer version (a
        syncer that lags this far is stalled: others' merges are still worth having), until
        the next publish of p replaces the wait."""
        wait = self.wait.get(p)
        if wait is None or p in self.pending:
            return
        _, until = wait
        later = 1 if state.step_count < until else max(1, self.H // 4)
        self.pending[p] = state.step_count + later

    def wants(self, state: IslandState, fragments) -> dict[int, int | None]:
        """fragment -> the seq a version must hold to be taken (None: any newer version)."""
        out: dict[int, int | None] = {}
        for p in fragments:
            wait = self.wait.get(p)
            out[p] = wait[0] if wait is not None and state.step_count < wait[1] else None
        return out

    def between_steps(self, state: IslandState, io: Background) -> bool:
        """Before a step: hand the reads of the adopts now due to `io`, and apply those whose
        reads are in (the leading ones, as process 0 counts them); returns whether any was."""
        due = [p for p, at in self.pending.items() if at <= state.step_count]
        if due:
            for p in due:
                del self.pending[p]
            self.fetches.append(io.submit(self.fetch, state, self.wants(state, due)))
        ready = self.group.agree(self._fetches_in) if self.fetches else 0
        if not ready:
            return False
        fetched = []
        for _ in range(ready):
            fetched += self.fetches.pop(0).result()
        self.apply(state, self.agreed(fetched))
        return True

    def _fetches_in(self) -> int:
        """How many of the leading adopt fetches are in."""
        return next((i for i, f in enumerate(self.fetches) if not f.done()), len(self.fetches))

    def poll_merged(self, state: IslandState) -> bool:
        """Sync baseline: if every awaited contribution has been applied, adopt the result
        and unblock."""
        if not self.awaiting:
            return True
        if self.group.agree(lambda: all(self.store.is_applied(g) for g in self.awaiting.values())):
            self.adopt(state, sorted(self.awaiting))
            self.awaiting.clear()
            return True
        return False


def _adopt_fn(mode: str):
    """The jitted adopt of one fragment (cached per mode; compiled per list of shapes):
    (fresh, local, anchor, alpha) as lists of arrays -> (new parameters, new anchor), as
    distinct buffers (the train step donates parameters)."""
    return shared(("adopt", mode), lambda: jax.jit(partial(_adopt, mode)))


def _adopt(mode, fresh, local, anchor, alpha):
    import jax.numpy as jnp

    if mode == "keep":
        return [f + (x - a) for f, x, a in zip(fresh, local, anchor, strict=True)], fresh
    if mode == "set":
        return [jnp.copy(f) for f in fresh], fresh
    new = [alpha * x + (1 - alpha) * f for f, x in zip(fresh, local, strict=True)]
    return new, [n - alpha * (x - a) for n, x, a in zip(new, local, anchor, strict=True)]


def merged_seq(manifest: dict[str, Any], island: str) -> int:
    """The highest sequence number of `island` that a fragment version's merges hold (-1: none),
    from its checked manifest's merge cursors (a version without a merge state: -1)."""
    if "merge_state" not in manifest:
        return -1
    return merge_records.merge_state_of(manifest).cursors.get(island, -1)
