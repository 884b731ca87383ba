"""An island's publish path: pseudo-gradients, heartbeats and the budget check.

Fragment p's pseudo-gradient is measured from its *anchor* (`delta = anchor - theta`), the
point its previous publish or adopt left it at, so nothing is counted twice and nothing is lost
while the syncer lags: an island whose syncer has not merged yet keeps training on its own
parameters and its next pseudo-gradient holds only the steps since its last publish (the merger
sums an island's pending contributions: they are consecutive increments). A publish moves the
anchor to the published parameters.

Off the critical path: the pseudo-gradient, its quantization and the error-feedback residual are
one jitted computation on the island's devices (training/island/encode.py, bit-identical to the
numpy codec on CPU); only the encoded payload is fetched, by the I/O thread, which uploads it (a
second publish of the same fragment waits for the first). Losses stay on the device (the host
runs at most `RUN_AHEAD` steps ahead of the device) and are fetched when a publish or heartbeat
needs them. A publish is the payload under a unique name, then the manifest (the commit marker).

The budget holds whether or not the syncer keeps up: after each publish round the island adds up
the tokens every island has trained (heartbeats) and finishes when they reach `token_budget`
(`budget_reached`, set by the I/O thread: seen a step or two later). Near the end
(`near_budget`) the timed heartbeats add them up too, so the islands stop within a heartbeat of
the budget and send their last interval cut short, not a whole interval past it.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from training.codecs import host as codecs
from training.island.background import Background
from training.island.encode import DeviceEncoder
from training.island.state import IslandState
from training.model.runtime import shared
from training.store.island_records import INTERVAL_KEYS
from training.store.layout import pseudograd_id
from training.store.tensorboard import ScalarWriter

RUN_AHEAD = 2
"""Steps the host may dispatch ahead of the device before it waits (for a step's loss)."""


class Publisher:
    """What one island writes about its training, and the per-fragment counts it needs.

    `since[p]`: steps, tokens and timed seconds since fragment p's publish (`first`: the step
    it counts from); `losses`: (step, device loss) since the oldest of those. Only process 0
    (`writer`) uploads; every process keeps the same counts and anchors.
    """

    def __init__(self, cfg, name: str, store, loop, frags, writer: bool, io: Background, clock):
        self.cfg = cfg
        self.name = name
        self.store = store
        self.loop = loop
        self.frags = frags
        self.writer = writer
        self.io = io
        self.clock = clock
        self.encoder = shared(("encoder", cfg.codec), lambda: DeviceEncoder(cfg.codec))
        self.since: list[dict] = [{} for _ in frags]
        self.losses: list[tuple[int, Any]] = []
        self.uploads: dict[int, Any] = {}  # fragment -> future of its last upload
        self.rate = 0.0  # tokens/s of the last heartbeat (kept by the publish-round heartbeat)
        self.budget_reached = False
        self.rest: int | None = None  # budget - all islands' trained tokens, at the last check
        self.islands_seen = 1  # islands with a heartbeat at the last check (this one included)
        tb = cfg.tensorboard
        # TensorBoard run island-{name}: the heartbeats' numbers, on the I/O thread only
        self.tb = (
            ScalarWriter(store, f"island-{name}", tb.flush_s) if writer and tb.enabled else None
        )
        # the highest step the island's run may already hold (`continue_tb_after`)
        self.tb_after: int | None = None

    def reset(self, fragments, step: int) -> None:
        """Count fragments' intervals from `step` on."""
        for p in fragments:
            self.since[p] = dict(steps=0, tokens=0, seconds=0.0, timed=0, first=step)

    def open_intervals(self) -> list[dict]:
        """Each fragment's open interval now (steps, tokens, seconds, timed), for a checkpoint:
        its anchor holds those steps, so the next pseudo-gradient after a resume counts them."""
        return [{k: s[k] for k in INTERVAL_KEYS} for s in self.since]

    def resume(self, step: int, since: list[dict] | None) -> None:
        """Count on from a checkpoint at `step` whose open intervals were `since` (None: a
        fresh start, or a checkpoint from before they were kept: count from `step`). The losses
        of the steps before `step` are gone: an interval's mean loss is over those it has."""
        self.reset(range(len(self.frags)), step)
        for p, interval in enumerate(since or []):
            self.since[p].update({k: interval[k] for k in INTERVAL_KEYS})

    # -- each step ----------------------------------------------------------------------------

    def dispatched(self, step: int, loss) -> None:
        """The step that ends at `step` was dispatched with device loss `loss`: keep it, and
        wait for the device only when the host is more than RUN_AHEAD steps ahead."""
        self.losses.append((step, loss))
        if len(self.losses) > RUN_AHEAD:  # bounded run-ahead, no sync on this step
            self.losses[-RUN_AHEAD - 1][1].block_until_ready()

    def counted(self, tokens: int, elapsed: float, timed: bool) -> None:
        """A step of `tokens` tokens ended, `elapsed` seconds after the one before (`timed`:
        not the first after a start, whose time is the compile's)."""
        for s in self.since:
            s["steps"] += 1
            s["tokens"] += tokens
            if timed:
                s["seconds"] += elapsed
                s["timed"] += 1

    @staticmethod
    def mean_step_s(interval: dict) -> float:
        """An interval's mean step time (its timed steps; 0.0 before any)."""
        return interval["seconds"] / interval["timed"] if interval["timed"] else 0.0

    def step_time_s(self) -> float:
        """The island's mean step time over its longest-timed open interval (0.0: none yet)."""
        return self.mean_step_s(max(self.since, key=lambda s: s["timed"]))

    def trim(self) -> None:
        """Drop the losses no interval counts any more."""
        first = min(s["first"] for s in self.since)
        self.losses = [(i, v) for i, v in self.losses if i > first]

    # -- publish ------------------------------------------------------------------------------

    def publish(self, state: IslandState, p: int, final: bool = False) -> tuple[str, int]:
        """Publish fragment p's pseudo-gradient (from its anchor); returns (its id, its seq).
        `final`: the island's last, partial interval. The encoding is dispatched to the
        devices; the upload is the I/O thread's (after the previous upload of this fragment)."""
        previous = self.uploads.get(p)
        if previous is not None:
            previous.exception()  # a second publish of a fragment waits for the first
        cfg, names = self.cfg, self.frags[p]
        residual = None
        if cfg.error_feedback and all(n in state.residual for n in names):
            residual = {n: state.residual[n] for n in names}
        payload, new_residual, new_anchor, finite = self.encoder.encode(
            {n: state.anchor[n] for n in names}, {n: state.params[n] for n in names}, residual
        )
        state.anchor.update(new_anchor)
        state.anchor_from[p], state.published_at[p] = "published", state.step_count
        if cfg.error_feedback:
            state.residual.update(new_residual)
        s = self.since[p]
        losses = [v for i, v in self.losses if i > s["first"]]
        manifest = dict(
            base_version=state.base_version[p],
            steps=s["steps"],
            tokens=s["tokens"],
            codec=cfg.codec,
            step_time_s=self.mean_step_s(s),
            published_at=self.clock(),
            island_step=state.step_count,
            island_tokens=state.tokens,
            final=final,
        )
        seq = state.seq
        shapes = {n: self.loop.param_shapes[n] for n in names}

        def upload() -> None:
            host = self.encoder.host_payload(payload, finite, shapes)
            total = 0.0
            for value in jax.device_get(losses):
                total += float(value)
            manifest["loss"] = total / max(len(losses), 1)
            self.store.publish_pseudograd(self.name, seq, p, host, manifest)
            state.bytes_sent += codecs.payload_nbytes(host)

        if self.writer:
            self.uploads[p] = self.io.submit(upload)
        state.seq += 1
        state.publishes += 1
        self.reset([p], state.step_count)
        return pseudograd_id(self.name, seq, p), seq

    def skip(self, state: IslandState, p: int) -> None:
        """Fragment p's steps up to now are in a contribution the island's previous process
        committed past its checkpoint (training/island/checkpoint.py `committed_ahead`): move
        the anchor to the parameters and count on from here, as that publish did, uploading
        nothing. The codec residual of those tensors is dropped (that publish consumed the
        one before it; its own is gone with the process)."""
        names = self.frags[p]
        state.anchor.update(self.loop.copy({n: state.params[n] for n in names}))
        for n in names:
            state.residual.pop(n, None)
        state.anchor_from[p], state.published_at[p] = "published", state.step_count
        state.committed_to[p] = None
        self.reset([p], state.step_count)

    # -- heartbeats and the budget --------------------------------------------------------------

    def heartbeat_record(
        self, state: IslandState, goodput: dict, loss, tokens_per_s: float | None
    ) -> dict[str, Any]:
        """The heartbeat now (`tokens_per_s` None: the last rate; `loss` may be on the device)."""
        if tokens_per_s is None:
            tokens_per_s = self.rate
        self.rate = tokens_per_s
        return dict(
            step=state.step_count,
            tokens=state.tokens,
            tokens_per_s=tokens_per_s,
            loss=loss,
            seq=state.seq,
            base_version=list(state.base_version),
            bytes_sent=state.bytes_sent,
            bytes_received=state.bytes_received,
            pid=os.getpid(),
            time=self.clock(),
            goodput=goodput["goodput"],
            goodput_state=goodput,
        )

    def write_heartbeat(self, record: dict[str, Any]) -> None:
        """Write the heartbeat, then its TensorBoard scalars (in that order: no step reaches
        TensorBoard before the heartbeat that a restart continues after, `continue_tb_after`)."""
        loss = record["loss"]
        loss = None if loss is None else float(loss)
        self.store.write_heartbeat(self.name, {**record, "loss": loss})
        self.tb_heartbeat(record, loss)

    def continue_tb_after(self, step: Any) -> None:
        """A restarted island: its previous process's last heartbeat was at island step `step`
        (None: none). TensorBoard run island-{name} has one writer at a time and steps that
        never go back: a resumed process trains again from its checkpoint, at or before
        `step`, and writes no scalar until it is past `step` (those steps' numbers are
        already in the run, from the process that first trained them)."""
        if isinstance(step, int) and not isinstance(step, bool):
            self.tb_after = step

    def tb_heartbeat(self, record: dict[str, Any], loss: float | None) -> None:
        """Buffer a heartbeat's numbers for TensorBoard at its step (a rate of 0, the first
        and the closing heartbeat's, is no measurement and not written; nor a step a previous
        process wrote, `continue_tb_after`), and flush when due."""
        if self.tb is None:
            return
        if self.tb_after is not None and record.get("step", 0) <= self.tb_after:
            return
        values = {"train/goodput": record.get("goodput"), "train/tokens": record.get("tokens")}
        if loss is not None:
            values["train/loss"] = loss
        if record.get("tokens_per_s"):
            values["train/tokens_per_s"] = record["tokens_per_s"]
        self.tb.add_all(values, record.get("step", 0), record.get("time"))
        self.tb.maybe_flush()

    def flush_tb(self) -> None:
        """Write what TensorBoard scalars are buffered (at the island's end)."""
        if self.tb is not None:
            self.tb.flush()

    def check_budget(self, record: dict[str, Any]) -> None:
        """After a publish round: write the heartbeat `record`, then set `budget_reached` if
        all islands together have trained `token_budget` tokens (in the I/O thread)."""

        def check() -> None:
            self.write_heartbeat(record)
            beats = self.store.heartbeats()
            trained = record["tokens"] + sum(
                int(b.get("tokens", 0))
                for island, b in beats.items()
                if island != self.name and isinstance(b.get("tokens", 0), int)
            )
            self.rest = self.cfg.token_budget - trained
            self.islands_seen = 1 + sum(1 for island in beats if island != self.name)
            if trained >= self.cfg.token_budget:
                self.budget_reached = True

        self.io.submit(check)

    def near_budget(self, interval_tokens: int) -> bool:
        """Whether the budget may be reached before the islands' next publish rounds: the
        rest at the last check is less than two whole intervals of every island seen (each
        island's counted as this island's `interval_tokens`). Far from it, a timed heartbeat
        only writes this island's; near it, it also adds up all islands' tokens (one listing
        and a small read per island, every `heartbeat_s`)."""
        return self.rest is not None and self.rest < 2 * self.islands_seen * interval_tokens
