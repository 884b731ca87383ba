"""An island: pull the global parameters, train, publish pseudo-gradients, repeat.

The island never waits for other islands (except under the synchronous baseline, `outer.method =
"sync"`, which blocks after each publish until that round is merged). Fragment p is published every
H_m inner steps on its staggered offset; `tau` steps later the island adopts fragment p's newest
version *if it is newer than the one it has* (`theta <- alpha * theta + (1 - alpha) * Theta`, or
the overlap steps kept on top), reading only that fragment's parameters, never the outer state:
with `outer.broadcast = "codec"` as small codec-encoded updates to the island's copy of the
fragment's broadcast shadow, which is what it adopts (training/broadcast.py).
A merge that lands later than `tau` steps is looked for again at every step, for up to H_m // 2
steps, and only a version holding the island's publish is taken (`_rearm_adopt`): a real syncer
is some hundreds of milliseconds behind, and one look that misses left the island training a
whole interval on a stale base (the demo's staleness of 2 to 4 versions).

Nothing is counted twice and nothing is lost while the syncer lags: each fragment has an
*anchor*, the point its next pseudo-gradient is measured from (`delta = anchor - theta`). A
publish moves the anchor to the published parameters; adopting a newer version moves it to that
version. An island whose syncer has not merged yet keeps training on its own parameters and its
next pseudo-gradient holds only the steps since its last publish (the merger sums an island's
pending contributions: they are consecutive increments).

The budget holds whether or not the syncer keeps up: after each publish round the island adds up
the tokens every island has trained (heartbeats) and finishes when they reach `token_budget`,
publishing its last partial interval (`final`: the merger applies it without a momentum step).

Contract with the store (see docs/STORE.md):
- a publish is the payload under a unique name, then the manifest (the commit marker). A crash
  between the two leaves an orphan payload nobody reads;
- the checkpoint (training/checkpointing.py) is written as `cfg.checkpoint` says (by default
  after each publish round), on SIGTERM and on finishing, and holds everything needed to
  continue that the store does not: parameters, AdamW state, the codec residuals, the anchors the
  store cannot give back (never the global base: it names each fragment's version), counters,
  the next sequence number and the data cursor. Its LATEST.json is committed only after every
  publish its meta counts. A restarted island resumes from it and then adopts the newest global
  version: it loses at most the steps since that checkpoint (the bound: `CheckpointConfig`), and
  a sequence number already committed is never published twice (the store returns the first).

Off the critical path (`background=True`, what `diloco island` runs): the pseudo-gradient, its
quantization and the error-feedback residual are one jitted computation on the island's devices
(training/device_codec.py, bit-identical to the numpy codec on CPU); only the encoded payload is
fetched, by a background thread that uploads it (a second publish of the same fragment waits for
the first). Heartbeats, budget and stop checks, and the store reads of an adopt (applied at the
first step boundary after they are in) run in that thread too; checkpoints in another,
from a device copy of the state taken between steps. Losses stay on the device (no per-step host
sync: the host runs at most `RUN_AHEAD` steps ahead of the device) and are fetched when a publish
or heartbeat needs them. `background=False` (the default: simulators, tests) does the same work
inline, in the same order, with the same results.

Multi-host islands (several processes, one per host; training/multihost.py): every process
runs this loop on one mesh over all their devices; process 0 alone writes to the store, and
what depends on the store or a clock is process 0's decision, handed to the others
(`ProcessGroup.agree`). A single process (`group=None`) takes none of those paths.

Length: past 500 lines because the island's three concerns (the training loop with its
adoption and anchors, publishing through the device encoder and the I/O thread, checkpoints)
share one state; splitting it waits for the typed island state (issue 11 item 6).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from training import broadcast, checkpointing, codecs, rounds
from training.background import Background
from training.config import ExperimentConfig
from training.data import BatchLoader, shard_tokens
from training.device_codec import DeviceEncoder
from training.faults import FaultPlan
from training.fragments import fragments_due
from training.goodput import GoodputAccountant
from training.multihost import ProcessGroup, ReadOnlyStore
from training.runtime import corpus_for, fragment_names, loop_for, shared
from training.store.experiment import ExperimentStore
from training.store.layout import pseudograd_id

if TYPE_CHECKING:  # chaos is the entry point's to build and hand over
    from training.chaos import IslandChaos

__all__ = ["Island", "StepResult", "corpus_for", "fragment_names", "loop_for", "shared"]

log = logging.getLogger("diloco.island")

RUN_AHEAD = 2
"""Steps the host may dispatch ahead of the device before it waits (for a step's loss)."""


@dataclass
class StepResult:
    loss_array: Any  # the step's loss as a device scalar (not fetched)
    published: list[str] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """The loss as a float (waits for the device)."""
        return float(self.loss_array)


class Island:
    """One island's training state and loop; the same code runs as a process and in benches.

    `background`: do the store I/O and the checkpoint writes in background threads (see the
    module docstring); the entry point that runs an island as a process turns it on. `faults`:
    the process's fault points (training/faults.py), handed over by the entry point. `chaos`:
    the slow-down and stall of chaos mode (training/chaos.py `IslandChaos.for_island`), built by
    the entry point that wants them (`diloco island`, for process 0); None: no chaos code runs.
    `group`: this process's place in a multi-host island (training/multihost.py; None: one
    process).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        name: str,
        store: ExperimentStore,
        clock: Callable[[], float] = time.time,
        background: bool = False,
        faults: FaultPlan | None = None,
        group: ProcessGroup | None = None,
        chaos: IslandChaos | None = None,
    ):
        self.cfg = cfg
        self.name = name
        self.group = group or ProcessGroup()
        self.writer = self.group.writer  # process 0 writes the island's objects
        if not self.writer:
            store = ReadOnlyStore(store)
        self.store = store
        self.clock = clock
        self.faults = faults
        self.spec = cfg.island(name)
        self.H = cfg.inner_steps(name) if cfg.outer.method != "sync" else cfg.inner.H
        self.P = cfg.fragments.count
        self.frags = fragment_names(cfg)
        self.loop = loop_for(cfg, name)
        self.batch_size = cfg.batch_size(name)
        devices = self.loop.mesh.devices.size
        if self.batch_size % devices:
            raise RuntimeError(
                f"island {name!r}: batch {self.batch_size} does not divide over its {devices} "
                "devices (set islands[].batch_size or islands[].devices)"
            )
        if not self.group.single and cfg.inner.shard_params:
            raise RuntimeError(
                f"island {name!r}: a multi-host island keeps its parameters replicated "
                "(set inner.shard_params = false; training/multihost.py)"
            )
        corpus = corpus_for(cfg)
        self.shard = shard_tokens(corpus.train, cfg.shard_of(name), cfg.num_shards)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.publishes = 0
        self._stop = False
        self._stop_marker = False  # a stop marker seen by the background stop check
        self._budget_reached = False
        self._rate = 0.0  # tokens/s of the last heartbeat (kept by the publish-round heartbeat)
        self.since: list[dict] = [{} for _ in range(self.P)]  # per fragment, since its publish
        self.goodput = GoodputAccountant.for_clock(clock)
        self.chaos = chaos
        self.round_clock: rounds.RoundClock | None = None  # clock rounds, once learnt
        self._next_at: list[float] = []  # clock rounds: each fragment's pending boundary
        self.encoder = shared(("encoder", cfg.codec), lambda: DeviceEncoder(cfg.codec))
        self.io = Background(f"island-{name}-io", background)
        self.ckpt_io = Background(f"island-{name}-ckpt", background)
        self._uploads: dict[int, Any] = {}  # fragment -> future of its last upload
        self._ckpt_future: Any = None
        self._losses: list[tuple[int, Any]] = []  # (step, device loss) since the oldest publish

    # -- state ------------------------------------------------------------------------------

    def start(self) -> None:
        """Resume from this island's checkpoint if there is one, else from the newest global."""
        cfg = self.cfg
        t = self.goodput.now()
        ckpt = self.store.load_checkpoint(self.name)
        step = None if ckpt is None else int(ckpt[1]["step"])
        if self.group.agree(lambda: step) != step:
            raise RuntimeError(f"island {self.name}: the checkpoint moved while its hosts started")
        self.resumed = ckpt is not None
        self.anchor_from = ["version"] * self.P  # per fragment: version / published / blended
        self.published_at = [-1] * self.P
        self.pending_adopt: dict[int, int] = {}
        # fragment -> (seq of this island's last publish of it, the step until which only a
        # version holding that publish is adopted): see `_rearm_adopt`
        self.adopt_wait: dict[int, tuple[int, int]] = {}
        # fragment -> its broadcast shadow S (training/broadcast.py; only with outer.broadcast
        # "codec"): the version this island adopted last, on the host
        self.shadows: dict[int, broadcast.Shadow] = {}
        if ckpt is None:
            heads = self._agreed_heads(self.store.heads(range(self.P)))
            params: dict[str, np.ndarray] = {}
            for head, got in zip(heads, self.store._parallel(self._read_full, heads), strict=True):
                params.update(got.tensors)
                self.bytes_received += got.nbytes
                self._keep_shadow(head, got)
            self.params = self.loop.put_params(params)
            self.opt_state = self.loop.init_opt_state(self.params)
            self.anchor = self.loop.copy(self.params)
            self.base_version = [h.version for h in heads]
            self.residual: dict[str, jax.Array] = {}
            self.seq = 0
            self.step_count = 0
            self.tokens = 0
            cursor = None
        else:
            cursor = self._restore(*ckpt)
            self._adopt(range(self.P))
            self.goodput.charge("checkpoint_restore", t)
        self._reset_counters(range(self.P))
        beat = (self.store.heartbeats().get(self.name) or {}) if self.writer else {}
        self.lost_steps = self.goodput.resume(
            ckpt[1].get("goodput") if ckpt else None,
            self.step_count if ckpt else None,
            beat.get("goodput_state"),
            beat.get("step"),
        )
        self.loader = BatchLoader(
            self.shard,
            self.batch_size,  # the island's whole batch, on every host (training/multihost.py)
            cfg.data.seq_len,
            seed=cfg.seed * 1000 + cfg.shard_of(self.name),
            cursor=cursor,
        )
        self._fetches: list[Any] = []  # adopts whose store reads are in flight (I/O thread)
        self.awaiting: dict[int, str] = {}
        self._last_step_at = self.clock()
        self._timed = False  # the first step after a start (the compile) is not timed
        if self.writer:  # round decisions are process 0's
            self._learn_round_clock()
        self._ckpt_rounds, self._ckpt_at = 0, self._now_if_timed()
        self.checkpointed_step = self.step_count  # the step of the last checkpoint taken

    def _restore(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict:
        """Take the state of a checkpoint (checked by checkpointing.parse_state); returns the
        data cursor."""
        state = checkpointing.parse_state(
            tensors, meta, self.loop.param_shapes, self.loop.opt_leaf_shapes, self.frags
        )
        self.params = self.loop.put_params(state.params)
        self.opt_state = self.loop.opt_state_from_host(state.opt)
        self.base_version = list(meta["base_version"])
        anchors = dict(state.anchors)
        for p, kind in enumerate(state.kinds):
            if kind == "version":
                head = self.store.find_version(p, self.base_version[p])
                got = self._read_full(head)
                anchors.update(got.tensors)
                self._keep_shadow(head, got)
            elif kind == "params":
                anchors.update({n: state.params[n] for n in self.frags[p]})
                self.anchor_from[p] = "published"
            else:
                self.anchor_from[p] = "blended"  # saved: not a version, not the parameters
        self.anchor = self.loop.put_params(anchors)
        self.residual = self.loop.put_params(state.residual)
        self.seq = int(meta["seq"])
        self.step_count = int(meta["step"])
        self.tokens = int(meta["tokens"])
        self.bytes_sent = int(meta.get("bytes_sent", 0))
        self.bytes_received = int(meta.get("bytes_received", 0))
        self.publishes = int(meta.get("publishes", 0))
        self.published_at = [self.step_count if k == "params" else -1 for k in state.kinds]
        return meta["cursor"]

    def _reset_counters(self, fragments) -> None:
        for p in fragments:
            self.since[p] = dict(steps=0, tokens=0, seconds=0.0, timed=0, first=self.step_count)

    def _now_if_timed(self) -> float:
        return self.clock() if self.cfg.checkpoint.every_s is not None else 0.0

    def checkpoint(self, wait: bool = False) -> None:
        """Snapshot the state between two steps and write it (in the background thread when
        there is one; a checkpoint still in flight is waited for first, so at most one is).
        `wait`: return only once it is committed."""
        if self._ckpt_future is not None:
            self._ckpt_future.result()
        step = self.step_count
        kinds = [
            checkpointing.anchor_kind(self.anchor_from[p], self.published_at[p], step)
            for p in range(self.P)
        ]
        params, opt = self.params, self.loop.opt_state_named(self.opt_state)
        if self.ckpt_io.threaded:  # the next steps donate these buffers: write from a copy
            params, opt = self.loop.copy((params, opt))
        tensors: dict[str, Any] = {f"param/{k}": v for k, v in params.items()}
        tensors.update({f"opt/{k}": v for k, v in opt.items()})
        for p, kind in enumerate(kinds):
            if kind == "saved":
                tensors.update({f"anchor/{n}": self.anchor[n] for n in self.frags[p]})
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
            goodput=self.goodput.state(),
        )
        published = self.io.last()  # the publishes this meta counts: committed before LATEST

        def write() -> None:
            before = None if published is None else published.result
            self.store.save_checkpoint(self.name, step, tensors, meta, before_commit=before)

        self._ckpt_rounds, self._ckpt_at = 0, self._now_if_timed()
        self.checkpointed_step = step
        if not self.writer:
            return  # process 0 holds the same (replicated) state and writes it
        self._ckpt_future = self.ckpt_io.submit(write)
        if wait:
            self._ckpt_future.result()
            self.ckpt_io.check()

    # -- global versions --------------------------------------------------------------------

    def _adopt(self, fragments) -> int:
        """Take each fragment's newest version if it is newer than the one this island has;
        returns how many fragments moved (`_fetch`, then `_apply`)."""
        return self._apply(self._agreed(self._fetch({p: None for p in fragments})))

    def _agreed_heads(self, heads: list) -> list:
        """Every fragment's head as process 0 saw it (a follower that saw another version
        looks up that one); raises when a fragment has none (no `init`)."""
        if any(h is None for h in heads) and self.writer:
            raise RuntimeError(f"experiment {self.cfg.name!r} has no global version: run init")
        versions = self.group.agree(lambda: [h.version for h in heads])
        return [
            h if h is not None and h.version == v else self.store.find_version(p, v)
            for p, (h, v) in enumerate(zip(heads, versions, strict=True))
        ]

    def _agreed(self, fetched: list) -> list:
        """`_fetch`'s result as process 0 fetched it: the same (fragment, version or None) list
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
                got = (p, head, self._read_full(head))
            out.append(got)
        return out

    def _read_full(self, head) -> broadcast.Fetched:
        """A version's parameters as islands adopt them (its broadcast shadow S_v, which is
        its params where it has no shadow), read whole and verified."""
        manifest = self.store.fragment_manifest(head)
        return broadcast.read_full(self.store, head, manifest, self._shapes(head.fragment))

    def _shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.loop.param_shapes[n]) for n in self.frags[p]}

    def _keep_shadow(self, head, got: broadcast.Fetched) -> None:
        """Hold the adopted version's S_v for the next update (broadcast "codec" only): a
        host copy of its own (the arrays read may back the device's, which steps donate)."""
        if broadcast.enabled(self.cfg):
            tensors = {n: np.array(v, np.float32, copy=True) for n, v in got.tensors.items()}
            self.shadows[head.fragment] = broadcast.Shadow(head.version, head.dir, tensors)

    def _fetch(self, wants: dict[int, int | None]) -> list[tuple[int, Any, Any]]:
        """(fragment, head, broadcast.Fetched or None) per fragment of `wants` whose newest
        version is newer than this island's: store reads only (the I/O thread's part of an
        adopt). With `outer.broadcast = "codec"` the version comes as updates to this island's
        shadow where it can (training/broadcast.fetch), else whole. `wants[p]`, when not None,
        is a sequence number of this island's: a version whose merge cursors do not reach it
        yet is not downloaded (None; `_apply` tries again a step later), so an island waiting
        for the merge of its own publish reads the fragment once, when it holds it."""
        wanted = list(wants)
        out = []
        for p, head in zip(wanted, self.store.heads(wanted), strict=True):
            if head is None or head.version <= self.base_version[p]:
                out.append((p, None, None))
                continue
            manifest = self.store.fragment_manifest(head)
            if wants[p] is not None and merged_seq(manifest, self.name) < wants[p]:
                out.append((p, head, None))
                continue
            if broadcast.enabled(self.cfg):
                got = broadcast.fetch(
                    self.store, head, manifest, self.shadows.get(p), self.cfg.codec, self._shapes(p)
                )
            else:
                got = broadcast.read_full(self.store, head, manifest, self._shapes(p))
            out.append((p, head, got))
        return out

    def _apply(self, fetched) -> int:
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
            if fresh is None or head.version <= self.base_version[p]:
                self._rearm_adopt(p)  # nothing (of ours) yet: keep training on our parameters
                continue
            self.adopt_wait.pop(p, None)
            self.bytes_received += fresh.nbytes
            self._keep_shadow(head, fresh)
            names = self.frags[p]
            new, anchor = _adopt_fn(mode)(
                list(self.loop.put_params({n: fresh.tensors[n] for n in names}).values()),
                [self.params[n] for n in names],
                [self.anchor[n] for n in names],
                np.float32(self.cfg.inner.alpha),
            )
            self.params.update(zip(names, new, strict=True))
            self.anchor.update(zip(names, anchor, strict=True))
            self.anchor_from[p] = "blended" if mode == "blend" else "version"
            self.base_version[p] = head.version
            moved += 1
        return moved

    def _rearm_adopt(self, p: int) -> None:
        """Look again for fragment p while this island waits for the merge of its last
        publish of p (`adopt_wait`): every step for up to H_m // 2 steps after that publish
        (only a version holding it is taken), then every H_m // 4 steps for any newer version
        (a syncer that lags this far is stalled: others' merges are still worth having), until
        the next publish of p replaces the wait."""
        wait = self.adopt_wait.get(p)
        if wait is None or p in self.pending_adopt:
            return
        _, until = wait
        later = 1 if self.step_count < until else max(1, self.H // 4)
        self.pending_adopt[p] = self.step_count + later

    def _adopt_wants(self, fragments) -> dict[int, int | None]:
        """fragment -> the seq a version must hold to be taken (None: any newer version)."""
        out: dict[int, int | None] = {}
        for p in fragments:
            wait = self.adopt_wait.get(p)
            out[p] = wait[0] if wait is not None and self.step_count < wait[1] else None
        return out

    # -- the loop ---------------------------------------------------------------------------

    def blocked(self) -> bool:
        """Synchronous baseline only: waiting for this round's merge."""
        return bool(self.awaiting)

    def poll_merged(self) -> bool:
        """If every awaited contribution has been applied, adopt the result and unblock."""
        if not self.awaiting:
            return True
        if self.group.agree(lambda: all(self.store.is_applied(g) for g in self.awaiting.values())):
            self._adopt(sorted(self.awaiting))
            self.awaiting.clear()
            return True
        return False

    def step(self) -> StepResult:
        """Adopt merges that are due, run one AdamW step, publish fragments that are due,
        checkpoint if due."""
        gp = self.goodput
        t = gp.now()
        self.io.check()
        self.ckpt_io.check()
        due_adopt = [p for p, at in self.pending_adopt.items() if at <= self.step_count]
        if due_adopt:  # the reads go to the I/O thread; applied once they are in
            for p in due_adopt:
                del self.pending_adopt[p]
            self._fetches.append(self.io.submit(self._fetch, self._adopt_wants(due_adopt)))
        ready = self.group.agree(self._fetches_in) if self._fetches else 0
        if ready:  # the leading fetches that are in (process 0's count on every process)
            fetched = []
            for _ in range(ready):
                fetched += self._fetches.pop(0).result()
            self._apply(self._agreed(fetched))
            t = gp.charge("waiting_for_global", t)
        inputs, targets = self.loader.next_batch()
        t = gp.charge("data_loading", t)
        self.params, self.opt_state, loss = self.loop.step(
            self.params, self.opt_state, inputs, targets
        )
        self._losses.append((self.step_count + 1, loss))
        if len(self._losses) > RUN_AHEAD:  # bounded run-ahead, no sync on this step
            self._losses[-RUN_AHEAD - 1][1].block_until_ready()
        if self.chaos is not None:
            loss.block_until_ready()
            self.chaos.after_step(gp.now() - t)
        t = gp.step(t)
        now = self.clock()
        elapsed, self._last_step_at = now - self._last_step_at, now
        self.step_count += 1
        self.tokens += inputs.size
        if self.faults is not None:
            self.faults.hit("island.step")
        for s in self.since:
            s["steps"] += 1
            s["tokens"] += inputs.size
            if self._timed:
                s["seconds"] += elapsed
                s["timed"] += 1
        self._timed = True
        result = StepResult(loss)
        for p in self.group.agree(lambda: [int(f) for f in self._due(now)]):
            result.published.append(self.publish(p))
        if result.published:
            if self.round_clock is None and self.writer:
                self._learn_round_clock()
            t = gp.charge("waiting_for_global", t)
            self._ckpt_rounds += 1
        if self.group.agree(self._checkpoint_due):
            self.checkpoint()
            t = gp.charge("checkpoint_save", t)
        if result.published and self.writer:
            self._check_budget(loss)
            gp.charge("waiting_for_global", t)
        first = min(s["first"] for s in self.since)
        self._losses = [(i, v) for i, v in self._losses if i > first]
        return result

    def _fetches_in(self) -> int:
        """How many of the leading adopt fetches are in."""
        return next((i for i, f in enumerate(self._fetches) if not f.done()), len(self._fetches))

    def _checkpoint_due(self) -> bool:
        seconds = self.clock() - self._ckpt_at if self.cfg.checkpoint.every_s else 0.0
        return bool(checkpointing.checkpoint_due(self.cfg.checkpoint, self._ckpt_rounds, seconds))

    def _due(self, now: float) -> list[int]:
        """The fragments to publish after the step that just ended (training/rounds.py)."""
        if self.round_clock is None:
            return fragments_due(self.step_count, self.H, self.P)
        steps = [s["steps"] for s in self.since]
        due, self._next_at = rounds.clock_due(
            self.round_clock, now, self._next_at, steps, self.cfg.inner.H, self.H
        )
        return due

    def _learn_round_clock(self) -> None:
        """Clock rounds: read the shared round clock if the syncer has set it."""
        if not rounds.clock_rounds(self.cfg):
            return
        got = self.store.round_clock()
        if got is None:
            return
        self.round_clock = rounds.RoundClock(*got)
        self._next_at = rounds.first_boundaries(
            self.round_clock, self.cfg.inner.H, self.P, self.clock()
        )
        log.info(
            "island %s: rounds on the shared clock (period %.2f s)",
            self.name,
            self.round_clock.period_s,
        )

    def _check_budget(self, loss) -> None:
        """After a publish round: heartbeat, then finish if all islands together have trained
        `token_budget` tokens (so the budget holds even when the syncer lags). In the I/O
        thread when there is one: the flag is seen a step or two later."""
        record = self._heartbeat_record(loss, None)

        def check() -> None:
            self._write_heartbeat(record)
            beats = self.store.heartbeats()
            trained = record["tokens"] + sum(
                int(b.get("tokens", 0))
                for island, b in beats.items()
                if island != self.name and isinstance(b.get("tokens", 0), int)
            )
            if trained >= self.cfg.token_budget:
                self._budget_reached = True

        self.io.submit(check)

    def publish(self, p: int, final: bool = False) -> str:
        """Publish fragment p's pseudo-gradient (from its anchor); returns its id. `final`:
        the island's last, partial interval. The encoding is dispatched to the devices; the
        upload is the I/O thread's (after the previous upload of this fragment)."""
        previous = self._uploads.get(p)
        if previous is not None:
            previous.exception()  # a second publish of a fragment waits for the first
        names = self.frags[p]
        residual = None
        if self.cfg.error_feedback and all(n in self.residual for n in names):
            residual = {n: self.residual[n] for n in names}
        payload, new_residual, new_anchor, finite = self.encoder.encode(
            {n: self.anchor[n] for n in names}, {n: self.params[n] for n in names}, residual
        )
        self.anchor.update(new_anchor)
        self.anchor_from[p], self.published_at[p] = "published", self.step_count
        if self.cfg.error_feedback:
            self.residual.update(new_residual)
        s = self.since[p]
        losses = [v for i, v in self._losses if i > s["first"]]
        manifest = dict(
            base_version=self.base_version[p],
            steps=s["steps"],
            tokens=s["tokens"],
            codec=self.cfg.codec,
            step_time_s=s["seconds"] / s["timed"] if s["timed"] else 0.0,
            published_at=self.clock(),
            island_step=self.step_count,
            island_tokens=self.tokens,
            final=final,
        )
        seq = self.seq
        shapes = {n: self.loop.param_shapes[n] for n in names}

        def upload() -> None:
            host = self.encoder.host_payload(payload, finite, shapes)
            total = 0.0
            for value in jax.device_get(losses):
                total += float(value)
            manifest["loss"] = total / max(s["steps"], 1)
            self.store.publish_pseudograd(self.name, seq, p, host, manifest)
            self.bytes_sent += codecs.payload_nbytes(host)

        if self.writer:
            self._uploads[p] = self.io.submit(upload)
        self.seq += 1
        self.publishes += 1
        self._reset_counters([p])
        pg_id = pseudograd_id(self.name, seq, p)
        if self.cfg.outer.method == "sync":
            self.awaiting[p] = pg_id
        else:
            self.pending_adopt[p] = self.step_count + self.cfg.inner.tau
            self.adopt_wait[p] = (seq, self.step_count + max(1, self.H // 2))
        return pg_id

    def _heartbeat_record(self, loss, tokens_per_s: float | None) -> dict[str, Any]:
        if tokens_per_s is None:
            tokens_per_s = self._rate
        self._rate = tokens_per_s
        goodput = self.goodput.state()
        return dict(
            step=self.step_count,
            tokens=self.tokens,
            tokens_per_s=tokens_per_s,
            loss=loss,
            seq=self.seq,
            base_version=list(self.base_version),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            pid=os.getpid(),
            time=self.clock(),
            goodput=goodput["goodput"],
            goodput_state=goodput,
        )

    def _write_heartbeat(self, record: dict[str, Any]) -> None:
        loss = record["loss"]
        self.store.write_heartbeat(
            self.name, {**record, "loss": None if loss is None else float(loss)}
        )

    def heartbeat(self, loss, tokens_per_s: float | None) -> None:
        """Overwrite this island's heartbeat (`tokens_per_s` None: keep the last rate); `loss`
        may be a device scalar (fetched by the I/O thread). Process 0's only."""
        if self.writer:
            self.io.submit(self._write_heartbeat, self._heartbeat_record(loss, tokens_per_s))

    def _poll_stop(self) -> None:
        if self.store.stop_requested(self.name):
            self._stop_marker = True

    def should_stop(self) -> bool:
        return self._stop or self.finished()

    def finished(self) -> bool:
        """Stop requested (for this island or all) or its own token limit reached: the island
        is done. A SIGTERM alone (preemption, a relaunch killing this copy, a teardown) only ends
        this process: it checkpoints and exits without a done marker, so a relaunch resumes."""
        if self._budget_reached or self.store.stop_requested(self.name):
            return True
        return self.spec.max_tokens is not None and self.tokens >= self.spec.max_tokens

    def _done_by_flags(self) -> bool:
        """`finished()` from what the I/O thread last saw (no store call on this thread)."""
        limit = self.spec.max_tokens
        return (
            self._budget_reached
            or self._stop_marker
            or (limit is not None and self.tokens >= limit)
        )

    def run(self, max_steps: int | None = None) -> dict:
        """The island process: train until a stop marker, the token budget or SIGTERM."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._run(max_steps)
        finally:
            self.io.close()
            self.ckpt_io.close()

    def _on_sigterm(self, *_) -> None:
        self._stop = True
        self.group.announce_stop()  # a follower's SIGTERM stops the whole island

    def _stopping(self) -> bool:
        """Process 0 of a multi-host island, each step: SIGTERM on any host, or done."""
        return self._stop or self.group.peer_stopping() or self._done_by_flags()

    def _run(self, max_steps: int | None) -> dict:
        self.start()
        log.info(
            "island %s: %s at step %d",
            self.name,
            "resumed" if self.resumed else "started",
            self.step_count,
        )
        last_beat, beat_tokens, loss = 0.0, self.tokens, None
        steps, single = 0, self.group.single
        while True:
            if self.chaos is not None and self.chaos.stall_due():
                self.chaos.stall(lambda: self._stop)  # alive, silent, until SIGTERM / SIGKILL
                break
            now = time.monotonic()
            if now - last_beat >= self.cfg.heartbeat_s:
                rate = (self.tokens - beat_tokens) / (now - last_beat) if last_beat else 0.0
                self.heartbeat(loss, rate)
                if self.writer:
                    self.io.submit(self._poll_stop)
                last_beat, beat_tokens = now, self.tokens
                if single and (self._stop or self._done_by_flags()):
                    break
            if not single and self.group.agree(self._stopping):
                break
            if self.blocked():
                t = self.goodput.now()
                if not self.poll_merged():
                    time.sleep(0.2)
                self.goodput.charge("waiting_for_global", t)
                continue
            loss = self.step().loss_array
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
            if single and self._done_by_flags():
                break
        self.io.drain()
        done = self.group.agree(
            lambda: not self._stop and not self.group.peer_stopping() and self.finished()
        )
        if done and not self.blocked():
            self.publish_remainder()
        t = self.goodput.now()
        self.io.drain()
        self.checkpoint(wait=True)
        self.goodput.charge("checkpoint_save", t)
        self.goodput.closed = True  # a clean exit: the time until a restart is not downtime
        self.heartbeat(loss, 0.0)
        self.io.drain()
        info = dict(
            step=self.step_count,
            tokens=self.tokens,
            publishes=self.publishes,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )
        if done and self.writer:
            self.store.mark_done(self.name, info)
        return info

    def publish_remainder(self) -> list[str]:
        """On finishing, publish every fragment trained since its last publish, so the island's
        last partial interval reaches the global model instead of being dropped."""
        return [self.publish(p, final=True) for p in range(self.P) if self.since[p]["steps"] > 0]


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
    from its checked manifest's merge cursors."""
    cursors = manifest.get("merge_state", {}).get("cursors", {})
    seq = cursors.get(island, -1)
    return seq if isinstance(seq, int) else -1
