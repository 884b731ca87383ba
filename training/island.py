"""An island: pull the global parameters, train, publish pseudo-gradients, repeat.

The island never waits for other islands (except under the synchronous baseline, `outer.method =
"sync"`, which blocks after each publish until that round is merged). Fragment p is published every
H_m inner steps on its staggered offset; `tau` steps later the island adopts fragment p's newest
version *if it is newer than the one it has* (`theta <- alpha * theta + (1 - alpha) * Theta`, or
the overlap steps kept on top), reading only that fragment's parameters, never the outer state.

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
- the checkpoint is written after each publish round and holds everything needed to continue:
  parameters, AdamW state, the global base each fragment was last synced to, the codec residuals,
  counters, the next sequence number and the data cursor. A restarted island resumes from it and
  then adopts the newest global version: it loses at most the steps since its last publish, and
  a sequence number already committed is never published twice (the store returns the first).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from training import codecs, inner, rounds
from training.chaos import IslandChaos
from training.config import ExperimentConfig
from training.data import BatchLoader, shard_tokens
from training.faults import fault_point
from training.fragments import fragments_due
from training.goodput import GoodputAccountant
from training.pseudograd import pseudo_gradient
from training.runtime import corpus_for, fragment_names, loop_for, shared
from training.store.experiment import ExperimentStore

__all__ = ["Island", "StepResult", "corpus_for", "fragment_names", "loop_for", "shared"]

log = logging.getLogger("diloco.island")


@dataclass
class StepResult:
    loss: float
    published: list[str] = field(default_factory=list)


class Island:
    """One island's training state and loop; the same code runs as a process and in benches."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        name: str,
        store: ExperimentStore,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.name = name
        self.store = store
        self.clock = clock
        self.spec = cfg.island(name)
        self.H = cfg.inner_steps(name) if cfg.outer.method != "sync" else cfg.inner.H
        self.P = cfg.fragments.count
        self.frags = fragment_names(cfg)
        self.loop = loop_for(cfg)
        corpus = corpus_for(cfg)
        self.shard = shard_tokens(corpus.train, cfg.shard_of(name), cfg.num_shards)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.publishes = 0
        self._stop = False
        self._budget_reached = False
        self._rate = 0.0  # tokens/s of the last heartbeat (kept by the publish-round heartbeat)
        self.since: list[dict] = [{} for _ in range(self.P)]  # per fragment, since its publish
        self.goodput = GoodputAccountant.for_clock(clock)
        self.chaos = IslandChaos.for_island(cfg, name, store)
        self.round_clock: rounds.RoundClock | None = None  # clock rounds, once learnt
        self._next_at: list[float] = []  # clock rounds: each fragment's pending boundary

    # -- state ------------------------------------------------------------------------------

    def start(self) -> None:
        """Resume from this island's checkpoint if there is one, else from the newest global."""
        cfg = self.cfg
        t = self.goodput.now()
        ckpt = self.store.load_checkpoint(self.name)
        self.resumed = ckpt is not None
        if ckpt is None:
            heads = self.store.heads(range(self.P))
            if any(h is None for h in heads):
                raise RuntimeError(f"experiment {cfg.name!r} has no global version: run init")
            params: dict[str, np.ndarray] = {}
            for fv in self.store._parallel(self.store.load_fragment, heads):
                params.update(fv.params)
                self.bytes_received += sum(int(v.nbytes) for v in fv.params.values())
            self.params = self.loop.put_params(params)
            self.opt_state = self.loop.init_opt_state(self.params)
            self.anchor = dict(params)
            self.base_version = [h.version for h in heads]
            self.residual: dict[str, np.ndarray] = {}
            self.seq = 0
            self.step_count = 0
            self.tokens = 0
            cursor = None
            self._reset_counters(range(self.P))
        else:
            tensors, meta = ckpt
            self.params = self.loop.put_params(_prefixed(tensors, "param/"))
            self.opt_state = self.loop.opt_state_from_host(_prefixed(tensors, "opt/"))
            self.anchor = _prefixed(tensors, "anchor/")
            self.residual = _prefixed(tensors, "resid/")
            self.base_version = list(meta["base_version"])
            self.seq = int(meta["seq"])
            self.step_count = int(meta["step"])
            self.tokens = int(meta["tokens"])
            self.bytes_sent = int(meta.get("bytes_sent", 0))
            self.bytes_received = int(meta.get("bytes_received", 0))
            self.publishes = int(meta.get("publishes", 0))
            cursor = meta["cursor"]
            self._reset_counters(range(self.P))
            self._adopt(range(self.P))
            self.goodput.charge("checkpoint_restore", t)
        beat = self.store.heartbeats().get(self.name) or {}
        self.lost_steps = self.goodput.resume(
            ckpt[1].get("goodput") if ckpt else None,
            self.step_count if ckpt else None,
            beat.get("goodput_state"),
            beat.get("step"),
        )
        self.loader = BatchLoader(
            self.shard,
            cfg.data.batch_size,
            cfg.data.seq_len,
            seed=cfg.seed * 1000 + cfg.shard_of(self.name),
            cursor=cursor,
        )
        self.pending_adopt: dict[int, int] = {}
        self.awaiting: dict[int, str] = {}
        self._last_step_at = self.clock()
        self._timed = False  # the first step after a start (the compile) is not timed
        self._learn_round_clock()

    def _reset_counters(self, fragments) -> None:
        for p in fragments:
            self.since[p] = dict(steps=0, tokens=0, loss=0.0, seconds=0.0, timed=0)

    def checkpoint(self) -> None:
        host = inner.to_host(self.params)
        tensors = {f"param/{k}": v for k, v in host.items()}
        tensors.update(
            {f"opt/{k}": v for k, v in self.loop.opt_state_to_host(self.opt_state).items()}
        )
        tensors.update({f"anchor/{k}": v for k, v in self.anchor.items()})
        tensors.update({f"resid/{k}": v for k, v in self.residual.items()})
        meta = dict(
            base_version=self.base_version,
            seq=self.seq,
            step=self.step_count,
            tokens=self.tokens,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            publishes=self.publishes,
            cursor=self.loader.state(),
            goodput=self.goodput.state(),
        )
        self.store.save_checkpoint(self.name, self.step_count, tensors, meta)

    # -- global versions --------------------------------------------------------------------

    def _adopt(self, fragments) -> int:
        """Take each fragment's newest version if it is newer than the one this island has;
        returns how many fragments moved.

        With `inner.keep_overlap` the steps trained since the fragment was published are kept on
        top of it (`theta <- Theta + (theta - anchor)`): they are in no pseudo-gradient yet, so
        nothing is counted twice and the overlap steps are not wasted. Else the fragment is
        overwritten, or blended with `inner.alpha`. The anchor moves to the adopted version (for
        a blend, to the blended point less its unpublished steps).
        """
        wanted = list(fragments)
        heads = self.store.heads(wanted)
        moved = 0
        alpha = self.cfg.inner.alpha
        for p, head in zip(wanted, heads, strict=True):
            if head is None or head.version <= self.base_version[p]:
                continue  # nothing newer: keep training on our own parameters
            fresh = self.store.load_fragment(head).params
            self.bytes_received += sum(int(v.nbytes) for v in fresh.values())
            for n in self.frags[p]:
                local = np.asarray(jax.device_get(self.params[n]), np.float32)
                unpublished = local - self.anchor[n]
                if self.cfg.inner.keep_overlap:
                    new, anchor = fresh[n] + unpublished, fresh[n]
                elif alpha:
                    new = alpha * local + (1 - alpha) * fresh[n]
                    anchor = new - alpha * unpublished
                else:
                    new, anchor = fresh[n], fresh[n]
                self.params[n] = jax.device_put(
                    np.asarray(new, np.float32), self.loop.param_sharding[n]
                )
                self.anchor[n] = np.asarray(anchor, np.float32)
            self.base_version[p] = head.version
            moved += 1
        return moved

    # -- the loop ---------------------------------------------------------------------------

    def blocked(self) -> bool:
        """Synchronous baseline only: waiting for this round's merge."""
        return bool(self.awaiting)

    def poll_merged(self) -> bool:
        """If every awaited contribution has been applied, adopt the result and unblock."""
        if not self.awaiting:
            return True
        if all(self.store.is_applied(pg) for pg in self.awaiting.values()):
            self._adopt(sorted(self.awaiting))
            self.awaiting.clear()
            return True
        return False

    def step(self) -> StepResult:
        """Adopt merges that are due, run one AdamW step, publish fragments that are due."""
        gp = self.goodput
        t = gp.now()
        due_adopt = [p for p, at in self.pending_adopt.items() if at <= self.step_count]
        if due_adopt:
            self._adopt(due_adopt)
            for p in due_adopt:
                del self.pending_adopt[p]
            t = gp.charge("waiting_for_global", t)
        inputs, targets = self.loader.next_batch()
        t = gp.charge("data_loading", t)
        self.params, self.opt_state, loss = self.loop.step(
            self.params, self.opt_state, inputs, targets
        )
        loss = float(loss)
        if self.chaos is not None:
            self.chaos.after_step(gp.now() - t)
        t = gp.step(t)
        now = self.clock()
        elapsed, self._last_step_at = now - self._last_step_at, now
        self.step_count += 1
        self.tokens += inputs.size
        fault_point("island.step")
        for s in self.since:
            s["steps"] += 1
            s["tokens"] += inputs.size
            s["loss"] += loss
            if self._timed:
                s["seconds"] += elapsed
                s["timed"] += 1
        self._timed = True
        result = StepResult(loss)
        for p in self._due(now):
            result.published.append(self.publish(p))
        if result.published:
            if self.round_clock is None:
                self._learn_round_clock()
            t = gp.charge("waiting_for_global", t)
            self.checkpoint()
            t = gp.charge("checkpoint_save", t)
            self._check_budget(loss)
            gp.charge("waiting_for_global", t)
        return result

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

    def _check_budget(self, loss: float) -> None:
        """After a publish round: heartbeat, then finish if all islands together have trained
        `token_budget` tokens (so the budget holds even when the syncer lags)."""
        self.heartbeat(loss, None)
        beats = self.store.heartbeats()
        trained = self.tokens + sum(
            int(b.get("tokens", 0))
            for island, b in beats.items()
            if island != self.name and isinstance(b.get("tokens", 0), int)
        )
        if trained >= self.cfg.token_budget:
            self._budget_reached = True

    def publish(self, p: int, final: bool = False) -> str:
        """Publish fragment p's pseudo-gradient (from its anchor); returns its id. `final`:
        the island's last, partial interval."""
        names = self.frags[p]
        local = {n: np.asarray(jax.device_get(self.params[n]), np.float32) for n in names}
        delta = pseudo_gradient({n: self.anchor[n] for n in names}, local)
        self.anchor.update(local)
        residual = {n: self.residual[n] for n in names if n in self.residual}
        payload, new_residual = codecs.encode(delta, self.cfg.codec, residual)
        if self.cfg.error_feedback:
            self.residual.update(new_residual)
        s = self.since[p]
        manifest = dict(
            base_version=self.base_version[p],
            steps=s["steps"],
            tokens=s["tokens"],
            loss=s["loss"] / max(s["steps"], 1),
            codec=self.cfg.codec,
            step_time_s=s["seconds"] / s["timed"] if s["timed"] else 0.0,
            published_at=self.clock(),
            island_step=self.step_count,
            island_tokens=self.tokens,
            final=final,
        )
        ref = self.store.publish_pseudograd(self.name, self.seq, p, payload, manifest)
        self.seq += 1
        self.publishes += 1
        self.bytes_sent += codecs.payload_nbytes(payload)
        self._reset_counters([p])
        if self.cfg.outer.method == "sync":
            self.awaiting[p] = ref.id
        else:
            self.pending_adopt[p] = self.step_count + self.cfg.inner.tau
        return ref.id

    def heartbeat(self, loss: float | None, tokens_per_s: float | None) -> None:
        """Overwrite this island's heartbeat (`tokens_per_s` None: keep the last rate)."""
        if tokens_per_s is None:
            tokens_per_s = self._rate
        self._rate = tokens_per_s
        goodput = self.goodput.state()
        self.store.write_heartbeat(
            self.name,
            dict(
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
            ),
        )

    def should_stop(self) -> bool:
        return self._stop or self.finished()

    def finished(self) -> bool:
        """Stop requested (for this island or all) or its own token limit reached: the island
        is done. A SIGTERM alone (preemption, a relaunch killing this copy, a teardown) only ends
        this process: it checkpoints and exits without a done marker, so a relaunch resumes."""
        if self._budget_reached or self.store.stop_requested(self.name):
            return True
        return self.spec.max_tokens is not None and self.tokens >= self.spec.max_tokens

    def run(self, max_steps: int | None = None) -> dict:
        """The island process: train until a stop marker, the token budget or SIGTERM."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        self.start()
        log.info(
            "island %s: %s at step %d",
            self.name,
            "resumed" if self.resumed else "started",
            self.step_count,
        )
        last_beat, beat_tokens, loss = 0.0, self.tokens, None
        steps = 0
        while True:
            if self.chaos is not None and self.chaos.stall_due():
                self.chaos.stall(lambda: self._stop)  # alive, silent, until SIGTERM / SIGKILL
                break
            now = time.monotonic()
            if now - last_beat >= self.cfg.heartbeat_s:
                rate = (self.tokens - beat_tokens) / (now - last_beat) if last_beat else 0.0
                self.heartbeat(loss, rate)
                last_beat, beat_tokens = now, self.tokens
                if self.should_stop():
                    break
            if self.blocked():
                t = self.goodput.now()
                if not self.poll_merged():
                    time.sleep(0.2)
                self.goodput.charge("waiting_for_global", t)
                continue
            loss = self.step().loss
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
            if self._budget_reached or (
                self.spec.max_tokens is not None and self.tokens >= self.spec.max_tokens
            ):
                break
        done = not self._stop and self.finished()
        if done and not self.blocked():
            self.publish_remainder()
        t = self.goodput.now()
        self.checkpoint()
        self.goodput.charge("checkpoint_save", t)
        self.goodput.closed = True  # a clean exit: the time until a restart is not downtime
        self.heartbeat(loss, 0.0)
        info = dict(
            step=self.step_count,
            tokens=self.tokens,
            publishes=self.publishes,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )
        if done:
            self.store.mark_done(self.name, info)
        return info

    def publish_remainder(self) -> list[str]:
        """On finishing, publish every fragment trained since its last publish, so the island's
        last partial interval reaches the global model instead of being dropped."""
        return [self.publish(p, final=True) for p in range(self.P) if self.since[p]["steps"] > 0]


def _prefixed(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
