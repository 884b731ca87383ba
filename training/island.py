"""An island: pull the global parameters, train, publish pseudo-gradients, repeat.

The island never waits for other islands (except under the synchronous baseline, `outer.method =
"sync"`, which blocks after each publish until that round is merged). Fragment p is published every
H_m inner steps on its staggered offset; `tau` steps later the island adopts the newest global
version of that fragment (`theta <- alpha * theta + (1 - alpha) * Theta`).

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

from training import codecs, inner, model
from training.chaos import IslandChaos
from training.config import ExperimentConfig
from training.data import BatchLoader, Corpus, load_corpus, shard_tokens
from training.faults import fault_point
from training.fragments import assign_fragments, fragments_due, split_by_fragment
from training.goodput import GoodputAccountant
from training.pseudograd import pseudo_gradient
from training.store.experiment import ExperimentStore

log = logging.getLogger("diloco.island")

_cache: dict[tuple, object] = {}


def shared(key: tuple, build: Callable[[], object]):
    """Process-wide cache for compiled loops and corpora (islands in one process share them)."""
    if key not in _cache:
        _cache[key] = build()
    return _cache[key]


def corpus_for(cfg: ExperimentConfig) -> Corpus:
    vocab = cfg.model.dims()["vocab_size"]
    key = ("corpus", cfg.data.source, cfg.data.eval_fraction, vocab)
    return shared(key, lambda: load_corpus(cfg.data.source, cfg.data.eval_fraction, vocab))


def loop_for(cfg: ExperimentConfig) -> inner.InnerLoop:
    key = ("loop", cfg.model, cfg.inner, len(jax.devices()))
    return shared(
        key,
        lambda: inner.InnerLoop(
            cfg.model, cfg.inner, inner.make_mesh(), shard_params=cfg.inner.shard_params
        ),
    )


def fragment_names(cfg: ExperimentConfig) -> list[list[str]]:
    """Parameter names of each fragment, in a fixed order."""
    shapes = {k: v.shape for k, v in model.abstract_params(cfg.model).items()}
    assignment = assign_fragments(shapes, cfg.fragments.count, cfg.fragments.strategy)
    return [sorted(split_by_fragment(shapes, assignment, p)) for p in range(cfg.fragments.count)]


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
        self.publishes = 0
        self._stop = False
        self._global_cache: tuple[int, dict[str, np.ndarray]] | None = None
        self.at_publish: dict[int, dict[str, np.ndarray]] = {}  # fragment -> params published
        self.since: list[dict] = [{} for _ in range(self.P)]  # per fragment, since its publish
        self.goodput = GoodputAccountant.for_clock(clock)
        self.chaos = IslandChaos.for_island(cfg, name, store)

    # -- state ------------------------------------------------------------------------------

    def start(self) -> None:
        """Resume from this island's checkpoint if there is one, else from the newest global."""
        cfg = self.cfg
        t = self.goodput.now()
        ckpt = self.store.load_checkpoint(self.name)
        self.resumed = ckpt is not None
        if ckpt is None:
            version, params = self._newest_global()
            self.params = self.loop.put_params(params)
            self.opt_state = self.loop.init_opt_state(self.params)
            self.base = dict(params)
            self.base_version = [version] * self.P
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
            self.base = _prefixed(tensors, "base/")
            self.residual = _prefixed(tensors, "resid/")
            self.base_version = list(meta["base_version"])
            self.seq = int(meta["seq"])
            self.step_count = int(meta["step"])
            self.tokens = int(meta["tokens"])
            self.bytes_sent = int(meta.get("bytes_sent", 0))
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

    def _reset_counters(self, fragments) -> None:
        for p in fragments:
            self.since[p] = dict(steps=0, tokens=0, loss=0.0, seconds=0.0)

    def checkpoint(self) -> None:
        host = inner.to_host(self.params)
        tensors = {f"param/{k}": v for k, v in host.items()}
        tensors.update(
            {f"opt/{k}": v for k, v in self.loop.opt_state_to_host(self.opt_state).items()}
        )
        tensors.update({f"base/{k}": v for k, v in self.base.items()})
        tensors.update({f"resid/{k}": v for k, v in self.residual.items()})
        meta = dict(
            base_version=self.base_version,
            seq=self.seq,
            step=self.step_count,
            tokens=self.tokens,
            bytes_sent=self.bytes_sent,
            publishes=self.publishes,
            cursor=self.loader.state(),
            goodput=self.goodput.state(),
        )
        self.store.save_checkpoint(self.name, self.step_count, tensors, meta)

    # -- global versions --------------------------------------------------------------------

    def _newest_global(self) -> tuple[int, dict[str, np.ndarray]]:
        head = self.store.head()
        if head is None:
            raise RuntimeError(f"experiment {self.cfg.name!r} has no global version: run init")
        if self._global_cache is None or self._global_cache[0] != head.version:
            g = self.store.load_global(head)
            self._global_cache = (g.version, g.params)
        return self._global_cache

    def _adopt(self, fragments) -> int:
        """Take the newest global version of the given fragments.

        With `inner.keep_overlap` the steps trained since the fragment was published are kept on
        top of it (`theta <- Theta + (theta - theta_at_publish)`): they are not in the published
        pseudo-gradient, so nothing is counted twice and the overlap steps are not wasted. Else
        the fragment is overwritten, or blended with `inner.alpha`.
        """
        version, params = self._newest_global()
        alpha = self.cfg.inner.alpha
        for p in fragments:
            at_publish = self.at_publish.pop(p, None) if self.cfg.inner.keep_overlap else None
            for n in self.frags[p]:
                new = params[n]
                if at_publish is not None:
                    new = new + (np.asarray(jax.device_get(self.params[n])) - at_publish[n])
                elif alpha:
                    new = alpha * np.asarray(jax.device_get(self.params[n])) + (1 - alpha) * new
                self.params[n] = jax.device_put(
                    np.asarray(new, np.float32), self.loop.param_sharding[n]
                )
                self.base[n] = params[n]
            self.base_version[p] = version
        return version

    # -- the loop ---------------------------------------------------------------------------

    def blocked(self) -> bool:
        """Synchronous baseline only: waiting for this round's merge."""
        return bool(self.awaiting)

    def poll_merged(self) -> bool:
        """If every awaited contribution has been applied, adopt the result and unblock."""
        if not self.awaiting:
            return True
        applied = self.store.applied()
        if all(pg in applied for pg in self.awaiting.values()):
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
            s["seconds"] += elapsed
        result = StepResult(loss)
        for p in fragments_due(self.step_count, self.H, self.P):
            result.published.append(self.publish(p))
        if result.published:
            t = gp.charge("waiting_for_global", t)
            self.checkpoint()
            gp.charge("checkpoint_save", t)
        return result

    def publish(self, p: int) -> str:
        """Publish fragment p's pseudo-gradient; returns its id."""
        names = self.frags[p]
        local = {n: np.asarray(jax.device_get(self.params[n]), np.float32) for n in names}
        delta = pseudo_gradient({n: self.base[n] for n in names}, local)
        self.at_publish[p] = local
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
            step_time_s=s["seconds"] / max(s["steps"], 1),
            published_at=self.clock(),
            island_step=self.step_count,
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

    def heartbeat(self, loss: float | None, tokens_per_s: float) -> None:
        goodput = self.goodput.state()
        self.store.write_heartbeat(
            self.name,
            dict(
                step=self.step_count,
                tokens=self.tokens,
                tokens_per_s=tokens_per_s,
                loss=loss,
                seq=self.seq,
                base_version=max(self.base_version),
                bytes_sent=self.bytes_sent,
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
        if self.store.stop_requested(self.name):
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
            if self.spec.max_tokens is not None and self.tokens >= self.spec.max_tokens:
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
        )
        if done:
            self.store.mark_done(self.name, info)
        return info

    def publish_remainder(self) -> list[str]:
        """On finishing, publish every fragment trained since its last publish, so the island's
        last partial interval reaches the global model instead of being dropped."""
        return [self.publish(p) for p in range(self.P) if self.since[p]["steps"] > 0]


def _prefixed(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
