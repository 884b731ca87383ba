"""An island: pull the global parameters, train, publish pseudo-gradients, repeat.

The island never waits for other islands (except under the synchronous baseline, `outer.method =
"sync"`, which blocks after each publish until that round is merged). Fragment p is published every
H_m inner steps on its staggered offset (or on the syncer's round clock: training/protocol/rounds.py);
`tau` steps later the island adopts fragment p's newest version if it is newer than its own.
The parts, each in its own module:

- the state (training/island/state.py): one `IslandState`, made at `start()` fresh from the
  newest global versions or resumed from the island's checkpoint, and checkpointed from;
- the publish path (training/island/publish.py): pseudo-gradients from each fragment's anchor,
  encoded on the devices and uploaded by the I/O thread; heartbeats and the budget check;
- the adopt path (training/island/adopt.py): which global versions the island takes, when, and
  how they enter its state;
- this module: the loop, its stop conditions, and when to checkpoint.

Contract with the store (see docs/STORE.md):
- a publish is the payload under a unique name, then the manifest (the commit marker). A crash
  between the two leaves an orphan payload nobody reads;
- the checkpoint (training/island/checkpoint.py) is written as `cfg.checkpoint` says (by default
  after each publish round), on SIGTERM and on finishing, and holds everything needed to
  continue that the store does not (`IslandState.checkpoint`; never the global base: it names
  each fragment's version). Its LATEST.json is committed only after every publish its meta
  counts. A restarted island resumes from it and then adopts the newest global version: it
  loses at most the steps since that checkpoint (the bound: `CheckpointConfig`);
- each step counted once: a restarted island lists its own contributions committed past its
  checkpoint (its manifests are the truth), numbers its publishes after them and never
  publishes those steps of those fragments again (training/island/checkpoint.py
  `committed_ahead`); the merger refuses overlapping step ranges as a second line of defence
  (training/protocol/claims.py, rule 7). Checkpoint writes that never committed (a directory
  without LATEST, a temp file cut off) are collected at the start.

Off the critical path (`background=True`, what `diloco island` runs): uploads, heartbeats,
budget and stop checks run in an I/O thread (in submission order: a pseudo-gradient's marker is
never committed before an earlier one's); an adopt's store reads in a second one, so a download
on a slow link never delays an upload nor the other way round; checkpoints in a third, from a
device copy of the state taken between steps; no per-step host sync.
`background=False` (simulators, tests) does the same work inline, in the same order.

Fault injection is the entry point's to hand over, never looked up on a step: `faults` (the
process's fault points, training/faults/points.py) and `chaos` (chaos mode's slow-down and stall,
training/faults/chaos.py); an island built without them runs none of their code.

Multi-host islands (several processes, one per host; training/island/multihost.py): every process
runs this loop on one mesh over all their devices; process 0 alone writes to the store, and
what depends on the store or a clock is process 0's decision, handed to the others
(`ProcessGroup.agree`). A single process (`group=None`) takes none of those paths.

Length: just past 500 lines: the loop and its stop and checkpoint decisions in one place; the
state, adopt and publish paths are in their own modules.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from training.config.experiment import ExperimentConfig
from training.data.batches import BatchLoader, shard_tokens
from training.data.stream import LazyTokens, StreamingLoader
from training.faults.points import FaultPlan
from training.island import checkpoint as checkpointing
from training.island.adopt import Adopter
from training.island.background import Background
from training.island.goodput import GoodputAccountant
from training.island.multihost import ProcessGroup, ReadOnlyStore
from training.island.publish import Publisher
from training.island.state import IslandState
from training.model.runtime import corpus_for, fragment_names, loop_for, shared
from training.protocol import broadcast, rounds
from training.protocol.fragments import fragments_due
from training.store.experiment import ExperimentStore
from training.store.faces import IslandFace
from training.store.layout import pseudograd_id

if TYPE_CHECKING:  # chaos is the entry point's to build and hand over
    from training.faults.chaos import IslandChaos

__all__ = [
    "Island",
    "IslandState",
    "StepResult",
    "corpus_for",
    "fragment_names",
    "loop_for",
    "shared",
]

log = logging.getLogger("diloco.island")


@dataclass
class StepResult:
    loss_array: Any  # the step's loss as a device scalar (not fetched)
    published: list[str] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """The loss as a float (waits for the device)."""
        return float(self.loss_array)


def _state_view(name: str) -> property:
    """A read-only property forwarding to `self.state.<name>`."""
    return property(lambda self: getattr(self.state, name), doc=f"`state.{name}` (read-only)")


class Island:
    """One island's training loop; the same code runs as a process and in benches.

    `background`: do the store I/O and the checkpoint writes in background threads (see the
    module docstring); the entry point that runs an island as a process turns it on. `faults`:
    the process's fault points (training/faults/points.py), handed over by the entry point. `chaos`:
    the slow-down and stall of chaos mode (training/faults/chaos.py `IslandChaos.for_island`), built by
    the entry point that wants them (`diloco island`, for process 0); None: no chaos code runs.
    `group`: this process's place in a multi-host island (training/island/multihost.py; None: one
    process).

    The training state is `self.state` (an `IslandState`), set by `start()`; everything else
    the loop reads exists from construction on.
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
        # an island (its adopter and publisher too) sees only its face (training/store/faces.py)
        self.store = store = IslandFace(store)
        self.clock = clock
        self.faults = faults
        self.chaos = chaos
        self.spec = cfg.island(name)
        self.H = cfg.inner_steps(name)  # H_m (DyLU; sync ignores it: the config's rule)
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
                "(set inner.shard_params = false; training/island/multihost.py)"
            )
        corpus = corpus_for(cfg)
        self.shard = shard_tokens(corpus.train, cfg.shard_of(name), cfg.num_shards)
        self.goodput = GoodputAccountant.for_clock(clock)
        self.io = Background(f"island-{name}-io", background)
        # adoption reads on their own thread: a download on a slow link never queues an upload
        # (whose next publish of the same fragment would wait for it), nor the other way round
        self.fetch_io = Background(f"island-{name}-fetch", background)
        self.ckpt_io = Background(f"island-{name}-ckpt", background)
        self.backgrounds = (self.io, self.fetch_io, self.ckpt_io)
        self.adopter = Adopter(cfg, name, store, self.group, self.loop, self.frags, self.H, clock)
        self.publisher = Publisher(
            cfg, name, store, self.loop, self.frags, self.writer, self.io, clock
        )
        self.state: IslandState | None = None  # set by start()
        self.resumed = False  # start() resumed from a checkpoint
        self.lost_steps = 0  # steps the previous process trained past its checkpoint
        self.round_clock: rounds.RoundClock | None = None  # clock rounds, once learnt
        self._next_at: list[float] = []  # clock rounds: each fragment's pending boundary
        self._stop = False
        self._stop_marker = False  # a stop marker seen by the background stop check
        self._last_step_at = 0.0
        self._step_tokens = 0  # tokens of the last step (its batch): an interval is H of them
        self._timed = False  # the first step after a start (the compile) is not timed
        self._ckpt_rounds, self._ckpt_at = 0, 0.0  # publish rounds, clock since the last one
        self.checkpointed_step = 0  # the step of the last checkpoint taken
        self._ckpt_future: Any = None

    # -- the state, read-only views of its counters (AttributeError before start()) ----------

    step_count = _state_view("step_count")
    tokens = _state_view("tokens")
    seq = _state_view("seq")
    publishes = _state_view("publishes")
    bytes_sent = _state_view("bytes_sent")
    bytes_received = _state_view("bytes_received")
    base_version = _state_view("base_version")
    params = _state_view("params")

    # -- start and checkpoint ---------------------------------------------------------------

    def start(self) -> None:
        """Resume from this island's checkpoint if there is one, else start from the newest
        global versions; then take whatever is newer."""
        t = self.goodput.now()
        ckpt = self.store.load_checkpoint(self.name)
        step = None if ckpt is None else int(ckpt[1]["step"])
        if self.group.agree(lambda: step) != step:
            raise RuntimeError(f"island {self.name}: the checkpoint moved while its hosts started")
        self.resumed = ckpt is not None
        self.adopter.clear()
        keep_shadows = broadcast.enabled(self.cfg)
        if ckpt is None:
            heads, got = self.adopter.read_heads()
            self.state = IslandState.fresh(
                self.loop, heads, got, self.loader_at(None), keep_shadows
            )
        else:
            self.state = IslandState.resume(
                self.loop,
                self.frags,
                *ckpt,
                self.adopter.read_version,
                self.loader_at,
                keep_shadows,
            )
            self.adopter.adopt(self.state, range(self.P))
            self.goodput.charge("checkpoint_restore", t)
        # the open intervals the checkpoint's anchors hold count on (their steps and tokens)
        self.publisher.resume(self.state.step_count, ckpt[1].get("since") if ckpt else None)
        self._committed_past_checkpoint()
        if self.writer:
            self.store.collect_uncommitted_checkpoints(self.name)
        beat = (self.store.heartbeats().get(self.name) or {}) if self.writer else {}
        self.publisher.continue_tb_after(beat.get("step"))
        self.lost_steps = self.goodput.resume(
            ckpt[1].get("goodput") if ckpt else None,
            self.state.step_count if ckpt else None,
            beat.get("goodput_state"),
            beat.get("step"),
        )
        self._last_step_at = self.clock()
        self._timed = False
        if self.writer:  # round decisions are process 0's
            self._learn_round_clock()
        self._ckpt_rounds, self._ckpt_at = 0, self._now_if_timed()
        self.checkpointed_step = self.state.step_count

    def _committed_past_checkpoint(self) -> None:
        """What the island's previous process committed after the state it starts from: its
        own manifests from the state's seq on (process 0's listing, agreed). The next seq
        follows them, and each fragment they reach past the state's step is not published
        again up to there (checkpoint.committed_ahead; `_skip_committed`)."""
        state = self.state

        def listed() -> list[list[int]]:
            after = state.seq - 1 if state.seq > 0 else None
            out = []
            for ref in self.store.list_pseudograds(self.name, after_seq=after):
                m = ref.manifest
                step, nbytes = m.get("island_step"), m.get("nbytes", 0)
                if isinstance(step, int) and not isinstance(step, bool):
                    nbytes = nbytes if isinstance(nbytes, int) else 0
                    out.append([ref.fragment, ref.seq, step, nbytes])
            return out

        found = self.group.agree(listed)
        if not found:
            return
        state.committed_to = checkpointing.committed_ahead(
            state.step_count, state.committed_to, [(p, q, s) for p, q, s, _ in found]
        )
        state.seq = max(state.seq, 1 + max(q for _, q, _, _ in found))
        state.publishes += len(found)
        state.bytes_sent += sum(n for *_, n in found)
        for p, ahead in enumerate(state.committed_to):
            if ahead is not None:
                log.info(
                    "island %s: fragment %d is committed up to step %d (seq %d) past step "
                    "%d: those steps are not published again",
                    self.name,
                    p,
                    *ahead,
                    state.step_count,
                )

    def _skip_committed(self) -> None:
        """Each fragment whose committed contribution (`state.committed_to`) the island has
        now trained up to: its anchor moves as that publish's did (`Publisher.skip`), and its
        merge is awaited or looked for as after a publish."""
        state = self.state
        for p, ahead in enumerate(state.committed_to):
            if ahead is not None and state.step_count >= ahead[0]:
                self.publisher.skip(state, p)
                seq = ahead[1]
                self.adopter.published(p, seq, pseudograd_id(self.name, seq, p), state.step_count)

    def loader_at(self, cursor: dict | None) -> BatchLoader:
        """The island's batches from data cursor `cursor` (None: the first): its whole
        batch, on every host (training/island/multihost.py)."""
        make = StreamingLoader if isinstance(self.shard, LazyTokens) else BatchLoader
        return make(
            self.shard,
            self.batch_size,
            self.cfg.data.seq_len,
            seed=self.cfg.seed * 1000 + self.cfg.shard_of(self.name),
            cursor=cursor,
        )

    def _now_if_timed(self) -> float:
        return self.clock() if self.cfg.checkpoint.every_s is not None else 0.0

    def checkpoint(self, wait: bool = False) -> None:
        """Snapshot the state between two steps and write it (in the background thread when
        there is one; a checkpoint still in flight is waited for first, so at most one is).
        `wait`: return only once it is committed."""
        if self._ckpt_future is not None:
            self._ckpt_future.result()
        # the next steps donate the parameters and moments: a background write is from a copy
        tensors, meta = self.state.checkpoint(self.loop, self.frags, copy=self.ckpt_io.threaded)
        meta["goodput"] = self.goodput.state()
        meta["since"] = self.publisher.open_intervals()
        step = meta["step"]
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

    def adopt(self, fragments) -> int:
        """Take each fragment's newest version now if it is newer than this island's; returns
        how many fragments moved (training/island/adopt.py)."""
        return self.adopter.adopt(self.state, fragments)

    # -- the loop ---------------------------------------------------------------------------

    def blocked(self) -> bool:
        """Synchronous baseline only: waiting for this round's merge."""
        return bool(self.adopter.awaiting)

    def poll_merged(self) -> bool:
        """If every awaited contribution has been applied, adopt the result and unblock."""
        return self.adopter.poll_merged(self.state)

    def step(self) -> StepResult:
        """Adopt merges that are due, run one AdamW step, publish fragments that are due,
        checkpoint if due."""
        gp, state, publisher = self.goodput, self.state, self.publisher
        t = gp.now()
        for bg in self.backgrounds:
            bg.check()
        if self.adopter.between_steps(state, self.fetch_io):
            t = gp.charge("waiting_for_global", t)
        inputs, targets = state.loader.next_batch()
        t = gp.charge("data_loading", t)
        state.params, state.opt_state, loss = self.loop.step(
            state.params, state.opt_state, inputs, targets
        )
        publisher.dispatched(state.step_count + 1, loss)
        if self.chaos is not None:
            loss.block_until_ready()
            self.chaos.after_step(gp.now() - t)
        t = gp.step(t)
        now = self.clock()
        elapsed, self._last_step_at = now - self._last_step_at, now
        state.step_count += 1
        state.tokens += inputs.size
        self._step_tokens = int(inputs.size)
        if self.faults is not None:
            self.faults.hit("island.step")
        publisher.counted(inputs.size, elapsed, self._timed)
        self._timed = True
        result = StepResult(loss)
        for p in self.group.agree(lambda: [int(f) for f in self._due(now)]):
            if state.committed_to[p] is None:  # else: committed by the previous process
                result.published.append(self.publish(p))
        self._skip_committed()
        if result.published:
            if self.round_clock is None and self.writer:
                self._learn_round_clock()
            t = gp.charge("waiting_for_global", t)
            self._ckpt_rounds += 1
        if self.group.agree(self._checkpoint_due):
            self.checkpoint()
            t = gp.charge("checkpoint_save", t)
        if result.published and self.writer:
            publisher.check_budget(self._heartbeat_record(loss, None))
            gp.charge("waiting_for_global", t)
        publisher.trim()
        return result

    def publish(self, p: int, final: bool = False) -> str:
        """Publish fragment p's pseudo-gradient (training/island/publish.py) and schedule the
        adopt of its merge; returns its id."""
        pg_id, seq = self.publisher.publish(self.state, p, final)
        self.adopter.published(p, seq, pg_id, self.state.step_count)
        return pg_id

    def _checkpoint_due(self) -> bool:
        seconds = self.clock() - self._ckpt_at if self.cfg.checkpoint.every_s else 0.0
        return bool(checkpointing.checkpoint_due(self.cfg.checkpoint, self._ckpt_rounds, seconds))

    def _due(self, now: float) -> list[int]:
        """The fragments to publish after the step that just ended (training/protocol/rounds.py)."""
        if self.round_clock is None:
            return fragments_due(self.state.step_count, self.H, self.P)
        steps = [s["steps"] for s in self.publisher.since]
        due, self._next_at = rounds.clock_due(
            self.round_clock,
            now,
            self._next_at,
            steps,
            self.cfg.inner.H,
            self.H,
            self.publisher.step_time_s(),
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

    def _heartbeat_record(self, loss, tokens_per_s: float | None) -> dict[str, Any]:
        record = self.publisher.heartbeat_record(
            self.state, self.goodput.state(), loss, tokens_per_s
        )
        if self.adopter.download_s is not None:  # seconds per fragment version read
            record["download_s"] = self.adopter.download_s
        return record

    def heartbeat(self, loss, tokens_per_s: float | None, budget: bool = False) -> None:
        """Overwrite this island's heartbeat (`tokens_per_s` None: keep the last rate); `loss`
        may be a device scalar (fetched by the I/O thread). Process 0's only. `budget` (the
        loop's timed heartbeats): near the end of the budget, also add up every island's
        trained tokens (`Publisher.near_budget`), so that the islands stop within a heartbeat
        of the budget instead of at their next publish round (their last interval cut short:
        `publish_remainder` sends it)."""
        if self.writer:
            record = self._heartbeat_record(loss, tokens_per_s)
            if budget and self.publisher.near_budget(self.H * self._step_tokens):
                self.publisher.check_budget(record)
            else:
                self.io.submit(self.publisher.write_heartbeat, record)

    def _poll_stop(self) -> None:
        if self.store.stop_requested(self.name):
            self._stop_marker = True

    def finished(self) -> bool:
        """Stop requested (for this island or all) or its own token limit reached: the island
        is done. A SIGTERM alone (preemption, a relaunch killing this copy, a teardown) only ends
        this process: it checkpoints and exits without a done marker, so a relaunch resumes."""
        if self.publisher.budget_reached or self.store.stop_requested(self.name):
            return True
        return self.spec.max_tokens is not None and self.state.tokens >= self.spec.max_tokens

    def _done_by_flags(self) -> bool:
        """`finished()` from what the I/O thread last saw (no store call on this thread)."""
        limit = self.spec.max_tokens
        return (
            self.publisher.budget_reached
            or self._stop_marker
            or (limit is not None and self.state.tokens >= limit)
        )

    def run(self, max_steps: int | None = None) -> dict:
        """The island process: train until a stop marker, the token budget or SIGTERM."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._run(max_steps)
        finally:
            self.close_background()

    def drain_background(self) -> None:
        """Wait for every job of the background threads (uploads, reads, checkpoint writes)."""
        for bg in self.backgrounds:
            bg.drain()

    def close_background(self) -> None:
        """Stop the background threads after the jobs already submitted."""
        for bg in self.backgrounds:
            bg.close()

    def _on_sigterm(self, *_) -> None:
        self._stop = True
        self.group.announce_stop()  # a follower's SIGTERM stops the whole island

    def _stopping(self) -> bool:
        """Process 0 of a multi-host island, each step: SIGTERM on any host, or done."""
        return self._stop or self.group.peer_stopping() or self._done_by_flags()

    def _run(self, max_steps: int | None) -> dict:
        done = self.group.agree(lambda: self.store.done().get(self.name))
        if done is not None:  # relaunched after its done marker: nothing left to train
            log.info("island %s: already done (done/%s.json): nothing to do", self.name, self.name)
            keys = ("step", "tokens", "publishes", "bytes_sent", "bytes_received")
            return {k: done.get(k) for k in keys}
        self.start()
        state = self.state
        log.info(
            "island %s: %s at step %d",
            self.name,
            "resumed" if self.resumed else "started",
            state.step_count,
        )
        last_beat, beat_tokens, loss = 0.0, state.tokens, None
        steps, single = 0, self.group.single
        while True:
            if self.chaos is not None and self.chaos.stall_due():
                self.chaos.stall(lambda: self._stop)  # alive, silent, until SIGTERM / SIGKILL
                break
            now = time.monotonic()
            if now - last_beat >= self.cfg.heartbeat_s:
                rate = (state.tokens - beat_tokens) / (now - last_beat) if last_beat else 0.0
                self.heartbeat(loss, rate, budget=True)
                if self.writer:
                    self.io.submit(self._poll_stop)
                last_beat, beat_tokens = now, state.tokens
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
        self.fetch_io.drain()
        done = self.group.agree(
            lambda: not self._stop and not self.group.peer_stopping() and self.finished()
        )
        if done:  # blocked or not (sync): the other fragments' last steps still count
            self.publish_remainder()
        t = self.goodput.now()
        self.io.drain()
        self.checkpoint(wait=True)
        self.goodput.charge("checkpoint_save", t)
        self.goodput.closed = True  # a clean exit: the time until a restart is not downtime
        self.heartbeat(loss, 0.0)
        self.io.submit(self.publisher.flush_tb)
        self.io.drain()
        info = dict(
            step=state.step_count,
            tokens=state.tokens,
            publishes=state.publishes,
            bytes_sent=state.bytes_sent,
            bytes_received=state.bytes_received,
        )
        if done and self.writer:
            self.store.mark_done(self.name, info)
        return info

    def publish_remainder(self) -> list[str]:
        """On finishing, publish every fragment trained since its last publish, so the island's
        last partial interval reaches the global model instead of being dropped. A fragment
        still short of what the previous process committed (`state.committed_to`) has
        nothing of its own to send: those steps are counted already."""
        since, ahead = self.publisher.since, self.state.committed_to
        return [
            self.publish(p, final=True)
            for p in range(self.P)
            if since[p]["steps"] > 0 and ahead[p] is None
        ]
