"""Per-island objects of an experiment: heartbeats, done markers, checkpoints, metrics and
stop markers (docs/STORE.md). A mixin of `ExperimentStore` (training/store/experiment.py), which
supplies the I/O helpers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from training.config.names import validate_name
from training.store import island_records, safejson
from training.store.commit import CHECKPOINT
from training.store.keys import ROUNDS, checkpoint_dir, tb_events_key
from training.store.layout import (
    dump_json,
    iso,
    new_uuid8,
    now,
    unique_time_ns,
)
from training.store.objectstore import CorruptObject, ObjectNotFound
from training.store.record_fields import is_int
from training.store.tensors import stream_tensors

STOP_REASONS = ("budget", "user")  # who wrote control/STOP: the syncer at the budget, or a person
RUN_STATES = {None: "running", "budget": "finished", "user": "stopped"}
"""An experiment's state from its stop marker's reason: no marker, the budget merged, a person."""


def with_iso(record: Mapping[str, Any], key: str = "at") -> dict[str, Any]:
    """`record` with `{key}_iso` (ISO-8601 UTC) next to its epoch `key`, unless it has one or
    `key` is not a plausible unix time (benches run on virtual clocks)."""
    out = dict(record)
    value = out.get(key)
    if f"{key}_iso" not in out and _is_real(value) and 1e9 <= value < 1e11:
        out[f"{key}_iso"] = iso(value)
    return out


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class IslandObjects:
    """Heartbeats, done markers, checkpoints, metrics, control (mixed into ExperimentStore)."""

    # per-island status objects -------------------------------------------------------------
    def _per_island(
        self, folder: str, kind: str, parse: Callable[[bytes, str], dict[str, Any]], limit: int
    ) -> dict[str, dict[str, Any]]:
        """island -> its parsed record under `folder`; broken ones are skipped and counted."""
        islands = {
            f"{folder}/{n.island}.json": n.island for n in self.list_named(f"{folder}/", kind)
        }
        got = self.read_records(list(islands), limit, lambda d, r: parse(d, islands[r]))
        return {islands[relative]: record for relative, record in got}

    def write_heartbeat(self, island: str, info: Mapping[str, Any]) -> None:
        """Overwrite heartbeats/{island}.json with `info` plus island and "at" (unix seconds,
        unless `info` sets it)."""
        validate_name("island", island)
        record = with_iso({"at": now(), **info, "island": island})
        self.write_json(f"heartbeats/{island}.json", record)

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """island -> its last heartbeat."""
        return self._per_island(
            "heartbeats", "heartbeat", island_records.parse_heartbeat, safejson.HEARTBEAT.max_bytes
        )

    def mark_done(self, island: str, info: Mapping[str, Any]) -> None:
        """Write done/{island}.json: the island finished its work."""
        validate_name("island", island)
        self.write_json(f"done/{island}.json", with_iso({"at": now(), **info, "island": island}))

    def done(self) -> dict[str, dict[str, Any]]:
        """island -> its done record."""
        return self._per_island(
            "done", "done", island_records.parse_done, safejson.POINTER.max_bytes
        )

    def clear_done(self, island: str) -> None:
        """Remove done/{island}.json (missing is fine): the island rejoins (a scavenged slot's
        next window, training/config/scavenge.py); written by the Airflow workers, not the island."""
        self.store.delete(self.object_key(f"done/{validate_name('island', island)}.json"))

    # checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(
        self,
        island: str,
        step: int,
        tensors: Mapping[str, Any],
        meta: Mapping[str, Any],
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Write checkpoints/{island}/c{step:010d}-{uuid8}/ (state, then meta.json), then point
        LATEST.json at it (written last), then delete the island's checkpoints it supersedes
        (`prune_checkpoints`: the garbage collection's rule, applied at once). The writes are one
        commit (training/store/commit.py `CHECKPOINT`): no marker, LATEST.json the pointer,
        overwritten by its one writer.

        The state is streamed tensor by tensor (`tensors.stream_tensors`: values may be device
        arrays, fetched one at a time) through the backend's `write_stream`, hashed as it goes:
        no bytes object of the whole checkpoint is ever built. `before_commit` (if given) runs
        after the state and meta are written and before LATEST.json: the island waits there
        for the publishes its meta counts (if it raises, nothing is committed).
        """
        validate_name("island", island)
        if not is_int(step) or step < 0:
            raise ValueError(f"invalid step {step!r}")
        directory = checkpoint_dir(island, step, new_uuid8())
        commit = self.commit(CHECKPOINT)
        written: dict[str, Any] = {}

        def chunks() -> Iterator[Any]:  # one attempt of the streamed write, hashed as it goes
            digest, nbytes = hashlib.sha256(), 0
            for chunk in stream_tensors(tensors):
                digest.update(chunk)
                nbytes += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                yield chunk
            written.update(sha256=digest.hexdigest(), nbytes=nbytes)

        commit.write_stream(f"{directory}/state.safetensors", chunks)
        digest, nbytes = written["sha256"], written["nbytes"]
        fixed = {"island": island, "step": step, "created_at": now()}
        commit.write(f"{directory}/meta.json", dump_json({**meta, **fixed, "sha256": digest}))
        if before_commit is not None:
            before_commit()
        latest = {"step": step, "dir": directory, "sha256": digest, "nbytes": nbytes}
        commit.repoint(f"checkpoints/{island}/LATEST.json", dump_json(latest))
        self.prune_checkpoints(island, step, directory)

    def prune_checkpoints(
        self, island: str, latest_step: int, latest_dir: str | None = None
    ) -> int:
        """Delete `island`'s checkpoint directories older than step `latest_step` (that of its
        committed LATEST.json), and given `latest_dir` (that LATEST's directory) the others of
        the same step (a finishing island checkpoints twice at its last step): none can be
        restored any more, as garbage collection would decide (`plan_gc`'s checkpoint rule).
        Returns the directories deleted."""
        validate_name("island", island)
        names = self.list_named(f"checkpoints/{island}/", "checkpoint-file")
        old = sorted(
            {
                n.dir
                for n in names
                if n.island == island
                and (
                    n.step < latest_step
                    or (latest_dir is not None and n.step == latest_step and n.dir != latest_dir)
                )
            }
        )
        for directory in old:
            self.delete_prefix(f"{directory}/")
        return len(old)

    def collect_uncommitted_checkpoints(self, island: str) -> int:
        """Delete what checkpoint writes of `island` that never committed left: every
        checkpoint directory but the one its LATEST.json names (a newer one was cut off before
        its LATEST, an older one is superseded), and the temp files of writes cut off midway
        (`ObjectStore.drop_abandoned_writes`). Only at the island's start, when no write of
        its checkpoints is in flight. Returns the directories and temp files removed."""
        validate_name("island", island)
        latest = self.checkpoint_pointer(island)
        keep = None if latest is None else latest.dir
        names = self.list_named(f"checkpoints/{island}/", "checkpoint-file")
        stale = sorted({n.dir for n in names if n.island == island and n.dir != keep})
        for directory in stale:
            self.delete_prefix(f"{directory}/")
        return len(stale) + self.store.drop_abandoned_writes(
            self.object_key(f"checkpoints/{island}/")
        )

    def load_checkpoint(self, island: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(tensors, meta) of the checkpoint LATEST.json points to, or None if there is none.

        The state's size and sha256 are checked against LATEST.json (CorruptObject).
        """
        validate_name("island", island)
        latest = self.checkpoint_pointer(island)
        if latest is None:
            return None
        directory, step = latest.dir, latest.step
        what = f"{self.url} checkpoint of {island} at step {step}"
        tensors = self.read_verified_tensors(
            f"{directory}/state.safetensors", ("sha256", latest.sha256), latest.nbytes, what
        )
        return tensors, self.checkpoint_meta(island, latest)

    def checkpoint_pointer(self, island: str) -> island_records.CheckpointPointer | None:
        """checkpoints/{island}/LATEST.json, parsed (None if absent; BadCheckpoint)."""
        relative = f"checkpoints/{island}/LATEST.json"
        try:
            data = self.store.read(self.object_key(relative), safejson.POINTER.max_bytes)
        except ObjectNotFound:
            return None
        try:
            return island_records.parse_checkpoint_pointer(data, island)
        except CorruptObject as exc:
            raise type(exc)(f"{self.url}/{relative}: {exc}") from None

    def checkpoint_meta(
        self, island: str, latest: island_records.CheckpointPointer
    ) -> dict[str, Any]:
        """The meta.json of the checkpoint `latest` points at (BadCheckpoint, CorruptObject)."""
        relative = f"{latest.dir}/meta.json"
        try:
            data = self.store.read(self.object_key(relative), safejson.CHECKPOINT_META.max_bytes)
        except ObjectNotFound:
            raise CorruptObject(f"{self.url}/{relative} is missing") from None
        return island_records.parse_checkpoint_meta(data, island, latest.step)

    # metrics -------------------------------------------------------------------------------
    def append_metric(self, kind: str, record: Mapping[str, Any]) -> None:
        """Write one record as metrics/{kind}/{time_ns:020d}-{uuid8}.json (GCS has no append).

        The time in the name orders records (strictly increasing within one process). A record
        with an epoch "at" gets "at_iso" beside it.
        """
        validate_name("metric kind", kind)
        name = f"metrics/{kind}/{unique_time_ns():020d}-{new_uuid8()}.json"
        self.write_json(name, with_iso(record))

    def read_metrics(self, kind: str) -> list[dict[str, Any]]:
        """The records of `kind`, oldest first."""
        return [r for _, r in self.read_metrics_after(kind, None)]

    def read_metrics_after(self, kind: str, after: str | None) -> list[tuple[str, dict[str, Any]]]:
        """(name, record) of the records of `kind` whose name sorts after `after` (a name this
        returned earlier; None: all), oldest first: what a poller reads to get only new ones."""
        validate_name("metric kind", kind)
        relatives = [
            k
            for k in self.list_keys(f"metrics/{kind}/", after)
            if (n := self.parse_listed(k)) and n.kind == "metric" and n.metric == kind
        ]
        limit = safejson.METRIC.max_bytes
        return self.read_records(
            relatives, limit, lambda d, _: island_records.parse_metric(d, kind)
        )

    def newest_metric(self, kind: str) -> str | None:
        """The name of the newest record of `kind` (a listing, no reads; None when there is
        none): it changes with every new record (the evaluator's "a merge happened")."""
        validate_name("metric kind", kind)
        keys = self.list_keys(f"metrics/{kind}/")
        return keys[-1].rsplit("/", 1)[-1] if keys else None

    def write_events(self, run: str, data: bytes) -> None:
        """One new TensorBoard event file of run `run` under tb/ (training/store/tensorboard.py
        encodes it; a new object per flush, never overwritten)."""
        self.store.write(self.object_key(tb_events_key(run, unique_time_ns(), new_uuid8())), data)

    # control -------------------------------------------------------------------------------
    def _stop_key(self, island: str | None) -> str:
        return self.STOP if island is None else f"control/stop/{validate_name('island', island)}"

    def request_stop(self, island: str | None = None, reason: str = "user") -> None:
        """Ask every island (None) or one island to stop: control/STOP or control/stop/{island}.
        `reason` says who asked (STOP_REASONS): "budget" (the syncer, the token budget merged)
        or "user" (`diloco stop`, the page)."""
        if reason not in STOP_REASONS:
            raise ValueError(f"stop reason {reason!r} is not one of {STOP_REASONS}")
        self.write_json(self._stop_key(island), with_iso({"at": now(), "reason": reason}))

    def stop_reason(self) -> str | None:
        """Why control/STOP was written ("budget" or "user"); None when there is none. A marker
        that does not say (written before reasons were recorded, or not a small JSON object
        naming one) counts as "user": its existence alone stops the islands."""
        try:
            record = self.read_json_or_none(self.STOP, safejson.POINTER)
        except CorruptObject:
            return "user"
        if record is None:
            return None
        reason = record.get("reason")
        return reason if reason in STOP_REASONS else "user"

    def run_state(self) -> str:
        """ "running", "finished" (the token budget is merged) or "stopped" (a person asked):
        RUN_STATES of `stop_reason`. What `diloco list`, `diloco status` and the page show."""
        return RUN_STATES[self.stop_reason()]

    def clear_stop(self, island: str | None = None) -> None:
        """Remove a stop marker written by request_stop (missing is fine)."""
        self.store.delete(self.object_key(self._stop_key(island)))

    def stopped_islands(self) -> set[str]:
        """Islands asked to leave (control/stop/{island}), from a listing only."""
        return {n.island for n in self.list_named("control/stop/", "island-stop")}

    def stop_requested(self, island: str | None = None) -> bool:
        """True if an experiment-wide stop, or (given an island) that island's stop, exists."""
        if self.store.exists(self.object_key(self.STOP)):
            return True
        return island is not None and self.store.exists(self.object_key(self._stop_key(island)))

    # the round clock (training/protocol/rounds.py) -------------------------------------------------
    def create_round_clock(self, t0: float, period_s: float) -> bool:
        """Write control/rounds.json once (create-only); False if it already exists (the first
        writer's clock stands)."""
        island_records.parse_round_clock(dict(t0=t0, period_s=period_s))
        return self.create_json(ROUNDS, {"t0": float(t0), "period_s": float(period_s), "at": now()})

    def round_clock(self) -> tuple[float, float] | None:
        """(t0, period_s) of control/rounds.json, or None while it does not exist. A broken
        record is skipped and counted (islands then keep the step rule)."""
        try:
            data = self.store.read(self.object_key(ROUNDS), max_bytes=safejson.POINTER.max_bytes)
            return island_records.parse_round_clock(data)
        except ObjectNotFound:
            return None
        except CorruptObject as exc:
            self.note_skipped(ROUNDS, exc)
            return None
