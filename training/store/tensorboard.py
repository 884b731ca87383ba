"""TensorBoard event files under an experiment's prefix: `{experiment}/tb/{run}/...`.

`tensorboard --logdir gs://BUCKET/PREFIX/EXP/tb` (or a file:// store's directory) shows one
run per producer: `island-{name}` (training loss, tokens/s, goodput, from the island's
heartbeats), `merge-s{shard}` for a syncer shard and `merge` for a merger of every fragment
(contributions, staleness, publish-to-applied latency, weights, tokens merged, from each merge
pass; `merge_run`) and `eval` (eval loss per snapshot, from the evaluator). One writer at a time
per run, whose steps never go back: an island's restart continues after its last heartbeat's
step (training/island/publish.py `continue_tb_after`), each merge shard writes its own run,
and the end of a run evaluates the merges no eval saw oldest first.

GCS objects cannot be appended to, so a `ScalarWriter` buffers scalars in memory and each
`flush` writes the buffer as one new immutable object, `tb_events_key` (the TFRecord framing of
`tensorboard`'s own `RecordWriter`: length, masked crc32c, an `Event` proto, masked crc32c; a
file_version event first). Names carry the flush time in nanoseconds (20 digits), so the name
order TensorBoard reads a run directory in is time order. Writing is batched (`add` only
appends to a list; `maybe_flush` writes at most every `flush_s`) and never raises: a failed
write is counted (`failures`), logged in one line, and its scalars dropped, so metrics can
never fail training or a merge.
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping

from training.store.keys import tb_events_key
from training.store.objectstore import one_line

log = logging.getLogger(__name__)

MAX_BUFFER = 100_000  # scalars kept between flushes at most (older ones dropped and counted)


def encode_events(scalars: list[tuple[str, float, int, float]]) -> bytes:
    """One event file's bytes: a file_version event, then one event per (tag, value, step,
    wall_time)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    buf = io.BytesIO()
    writer = RecordWriter(buf)
    first = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
    writer.write(first.SerializeToString())
    for tag, value, step, wall_time in scalars:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]
        )
        event = event_pb2.Event(wall_time=wall_time, step=step, summary=summary)
        writer.write(event.SerializeToString())
    return buf.getvalue()


class ScalarWriter:
    """Buffered scalars of one TensorBoard run of experiment store `estore` (anything with
    `write_events(run, bytes)`: `ExperimentStore`'s). Thread-safe; never raises from
    `add`, `flush` or `maybe_flush`."""

    def __init__(
        self,
        estore,
        run: str,
        flush_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.estore, self.run, self.flush_s, self.clock = estore, run, flush_s, clock
        self.failures = 0  # flushes that failed (their scalars are lost)
        self.dropped = 0  # scalars dropped because the buffer was full or not a finite number
        self.written = 0  # objects written
        self.raised = 0  # scalars written at their tag's highest step so far instead of a lower one
        self._last_step: dict[str, int] = {}  # tag -> the highest step added
        self._buffer: list[tuple[str, float, int, float]] = []
        self._lock = threading.Lock()
        self._flushed_at = clock()
        tb_events_key(run, 0)  # a bad run name fails here, not at the first flush

    def add(self, tag: str, value, step: int, wall_time: float | None = None) -> None:
        """Buffer scalar `value` of `tag` at `step` (None, NaN and inf are dropped and counted).
        A step below one this writer already added for `tag` is raised to that one (counted in
        `raised`): TensorBoard drops a series' points from a step that comes back on, so a
        writer's steps never go back (the merge's `merge/tokens_merged`, at each pass's highest
        version, would: a pass may publish only lower fragments)."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        with self._lock:
            if not math.isfinite(number) or len(self._buffer) >= MAX_BUFFER:
                self.dropped += 1
                return
            step, last = int(step), self._last_step.get(tag)
            if last is not None and step < last:
                step = last
                self.raised += 1
            self._last_step[tag] = step
            self._buffer.append((tag, number, step, wall_time or time.time()))

    def add_all(self, values: Mapping[str, object], step: int, wall_time=None) -> None:
        """`add` each (tag, value) of `values` at `step`."""
        for tag, value in values.items():
            self.add(tag, value, step, wall_time)

    def maybe_flush(self) -> bool:
        """`flush` if `flush_s` passed since the last one; whether it flushed."""
        if self.clock() - self._flushed_at < self.flush_s:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Write the buffered scalars as one new event-file object (nothing if none)."""
        with self._lock:
            scalars, self._buffer = self._buffer, []
            self._flushed_at = self.clock()
        if not scalars:
            return
        try:
            self.estore.write_events(self.run, encode_events(scalars))
            self.written += 1
        except Exception as exc:  # noqa: BLE001 (metrics must never fail the caller)
            self.failures += 1
            log.warning(
                "tensorboard %s: %d scalars not written (%d failures): %s",
                self.run,
                len(scalars),
                self.failures,
                one_line(exc),
            )


def merge_run(fragments, count: int) -> str:
    """The TensorBoard run of a merger of `fragments` of the `count` fragments: "merge" for all
    of them (`diloco merge`, finalize's merge), else "merge-s{the lowest}": syncer shard s of S
    merges the fragments p with p % S == s (training/merge/syncer.py `shard_fragments`), so its
    lowest is s. Two shards never write one run, whose steps (its fragments' versions, its
    passes' highest version) would then go back and forth."""
    fragments = sorted(set(fragments))
    if not fragments or fragments == list(range(count)):
        return "merge"
    return f"merge-s{fragments[0]}"


def merge_scalars(result) -> list[tuple[str, float, int]]:
    """TensorBoard (tag, value, step) of merge pass `result` (training/merge/merger.py
    `MergeResult`), per fragment ("{stat}/fFFF" at the fragment's new version): contributions applied, mean and max staleness (versions), mean and
    max publish-to-applied latency (seconds, merged_at - published_at), mean weight; and
    "merge/tokens_merged" at the pass's highest version."""
    out: list[tuple[str, float, int]] = []
    if result.tokens_merged is not None and result.version is not None:
        out.append(("merge/tokens_merged", result.tokens_merged, result.version))
    by_fragment: dict[int, list[dict]] = {}
    for c in result.contributions:
        by_fragment.setdefault(c["fragment"], []).append(c)
    for p, cs in sorted(by_fragment.items()):
        f, step = f"f{p:03d}", result.versions.get(p)
        if step is None:
            continue
        stale = [float(c["staleness"]) for c in cs]
        late = [
            float(c["merged_at"]) - float(c["published_at"])
            for c in cs
            if c.get("published_at") is not None and c.get("merged_at") is not None
        ]
        out += [
            (f"contributions/{f}", len(cs), step),
            (f"staleness_mean/{f}", sum(stale) / len(stale), step),
            (f"staleness_max/{f}", max(stale), step),
            (f"weight_mean/{f}", sum(float(c["weight"]) for c in cs) / len(cs), step),
        ]
        if late:
            out += [
                (f"latency_s_mean/{f}", sum(late) / len(late), step),
                (f"latency_s_max/{f}", max(late), step),
            ]
    return out
