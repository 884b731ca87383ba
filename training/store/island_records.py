"""Strict parsers of the islands' side records and the experiment's control records: config.json,
checkpoint pointers and metas, heartbeats, metrics, done markers, the round clock
(docs/STORE.md).

The contract every parser keeps (bytes or a loaded dict in; the record or its own `BadRecord`
out, nothing else) and the shared field checks are in training/store/record_fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.config.experiment import MAX_ROUND_S, without_retired_fields
from training.store import safejson
from training.store.keys import CHECKPOINT_DIR, MAX_SEQ, MAX_VERSION
from training.store.record_fields import (
    SHA256,
    BadRecord,
    Fields,
    is_int,
    is_real,
    load_object,
)
from training.store.safejson import one_line, show


class BadConfigRecord(BadRecord):
    """config.json is not a valid experiment config."""


class BadCheckpoint(BadRecord):
    """A checkpoint's LATEST.json or meta.json is invalid."""


class BadHeartbeat(BadRecord):
    """A heartbeat is invalid."""


class BadMetric(BadRecord):
    """A metric record is invalid."""


class BadRoundClock(BadRecord):
    """control/rounds.json is not a valid round clock."""


class BadDoneMarker(BadRecord):
    """A done marker is invalid."""


# ---------------------------------------------------------------------------------------------
# Config, checkpoints, heartbeats, metrics, done markers, round clock


def parse_config_record(data: Any, experiment: str | None = None) -> dict[str, Any]:
    """config.json's top level: a JSON object whose `name`, if present, is `experiment`, without
    the fields the config no longer has (an experiment created before they were removed still
    loads: `without_retired_fields`). BadConfigRecord. (`parse_experiment_config` validates
    every field.)"""
    m = without_retired_fields(load_object(data, safejson.CONFIG, BadConfigRecord, "config.json"))
    if "name" in m and experiment is not None and m["name"] != experiment:
        raise BadConfigRecord(f"config.json names experiment {show(m['name'])}, not {experiment!r}")
    return m


def parse_experiment_config(data: Any, experiment: str | None = None):
    """config.json as a validated `ExperimentConfig`. BadConfigRecord with the first problem."""
    from training.config.experiment import ConfigError, parse_config

    m = parse_config_record(data, experiment)
    try:
        return parse_config(m)
    except ConfigError as exc:
        raise BadConfigRecord(one_line(f"config.json: {exc}")) from None


@dataclass(frozen=True)
class CheckpointPointer:
    dir: str
    step: int
    sha256: str
    nbytes: int


def parse_checkpoint_pointer(data: Any, island: str) -> CheckpointPointer:
    """checkpoints/{island}/LATEST.json: a dir `checkpoints/{island}/c{step:010d}-<8 hex>`
    matching `step`, and the state's sha256 and nbytes. BadCheckpoint."""
    m = load_object(data, safejson.POINTER, BadCheckpoint, f"checkpoint LATEST of {island}")
    f = Fields(m, BadCheckpoint, f"checkpoint LATEST of {island}")
    step = f.int("step", 0, 10**10 - 1)
    directory = f.str("dir", max_len=200)
    prefix = f"checkpoints/{island}/"
    match = CHECKPOINT_DIR.fullmatch(directory.removeprefix(prefix))
    if not directory.startswith(prefix) or match is None or int(match[1]) != step:
        f.fail(f"dir {show(directory, 120)} is not {prefix}c{step:010d}-<hex8>")
    return CheckpointPointer(directory, step, f.str("sha256", SHA256), f.int("nbytes"))


ANCHOR_KINDS = ("version", "params", "saved")
"""How a checkpoint holds each fragment's anchor (training/island/checkpoint.py): `version`, the
fragment's base version in the store (not in the checkpoint); `params`, equal to the
checkpointed parameters; `saved`, its own tensors `anchor/<name>` in the checkpoint."""


def parse_checkpoint_meta(data: Any, island: str, step: int | None = None) -> dict[str, Any]:
    """A checkpoint's meta.json: names `island` and `step`; if present, base_version an int or
    a list of ints >= 0, seq and tokens ints >= 0, anchor a list (as long as base_version)
    of ANCHOR_KINDS, publishes, bytes_sent and bytes_received ints >= 0, since one open interval
    per fragment (`_check_interval`), committed_to null or [island_step, seq] per fragment
    (`_is_ahead`). BadCheckpoint."""
    m = load_object(data, safejson.CHECKPOINT_META, BadCheckpoint, f"checkpoint meta of {island}")
    f = Fields(m, BadCheckpoint, f"checkpoint meta of {island}")
    if m.get("island") != island:
        f.fail(f"names island {show(m.get('island'))}")
    got = f.int("step", 0, 10**10 - 1)
    if step is not None and got != step:
        f.fail(f"step {got} is not LATEST's {step}")
    base = m.get("base_version", [])
    bases = base if isinstance(base, list) else [base]
    if not all(is_int(b) and 0 <= b <= MAX_VERSION for b in bases):
        f.fail(f"base_version {show(base)} is not a version or a list of versions")
    f.int("seq", 0, MAX_SEQ + 1, optional=True)
    f.int("tokens", optional=True)
    for key in ("publishes", "bytes_sent", "bytes_received"):
        f.int(key, optional=True)
    anchor = m.get("anchor")
    if anchor is not None and not (
        isinstance(anchor, list)
        and len(anchor) == len(bases)
        and all(isinstance(k, str) and k in ANCHOR_KINDS for k in anchor)
    ):
        f.fail(f"anchor {show(anchor)} is not one of {ANCHOR_KINDS} per fragment")
    ahead = m.get("committed_to")
    if ahead is not None and not (
        isinstance(ahead, list)
        and len(ahead) == len(bases)
        and all(a is None or _is_ahead(a, got) for a in ahead)
    ):
        f.fail(f"committed_to {show(ahead)} is not null or [island_step > step, seq] per fragment")
    since = m.get("since")
    if since is not None:
        if not isinstance(since, list) or len(since) != len(bases):
            f.fail(f"since {show(since)} is not one open interval per fragment")
        for p, interval in enumerate(since):
            _check_interval(interval, got, f"checkpoint meta of {island}: since[{p}]")
    return m


def _is_ahead(value: Any, step: int) -> bool:
    """One fragment's `committed_to` entry: [island_step, seq] of a contribution committed
    past the checkpoint's `step` (training/island/checkpoint.py `committed_ahead`)."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and is_int(value[0])
        and step < value[0] < 10**10
        and is_int(value[1])
        and 0 <= value[1] <= MAX_SEQ
    )


# the counts of a fragment's open interval a checkpoint keeps (training/island/publish.py)
INTERVAL_KEYS = frozenset({"steps", "tokens", "seconds", "timed"})


def _check_interval(interval: Any, step: int, what: str) -> None:
    """One fragment's open interval at a checkpoint: steps (at most the checkpoint's step),
    tokens, timed (at most steps) ints >= 0 and seconds a finite number >= 0, nothing else."""
    if not isinstance(interval, dict) or set(interval) != INTERVAL_KEYS:
        raise BadCheckpoint(one_line(f"{what}: {show(interval)} is not {sorted(INTERVAL_KEYS)}"))
    f = Fields(interval, BadCheckpoint, what)
    steps = f.int("steps", 0, step)
    f.int("tokens")
    f.int("timed", 0, steps)
    f.real("seconds", lo=0.0)


def _goodput_state_ok(s: Any) -> bool:
    return (
        isinstance(s, dict)
        and isinstance(s.get("seconds"), dict)
        and len(s["seconds"]) <= 64
        and all(is_real(v) and v >= 0 for v in s["seconds"].values())
        and is_real(s.get("elapsed_s"))
        and is_real(s.get("wall"))
        and all(
            is_int(s.get(k, 0)) and s.get(k, 0) >= 0 for k in ("steps", "lost_steps", "restarts")
        )
    )


def _versions_ok(base: Any) -> bool:
    """A version, or one per fragment (layout 2)."""
    bases = base if isinstance(base, list) else [base]
    return len(bases) <= 1000 and all(is_int(b) and 0 <= b <= MAX_VERSION for b in bases)


def parse_heartbeat(data: Any, island: str) -> dict[str, Any]:
    """heartbeats/{island}.json: names `island`; "at" a number; if present: step, tokens, seq,
    bytes_sent, pid (ints >= 0), base_version (a version or one per fragment), tokens_per_s,
    download_s (numbers >= 0), time (a number), loss, goodput
    (numbers or null), goodput_state (a goodput snapshot). BadHeartbeat."""
    m = load_object(data, safejson.HEARTBEAT, BadHeartbeat, f"heartbeat of {island}")
    f = Fields(m, BadHeartbeat, f"heartbeat of {island}")
    if m.get("island") != island:
        f.fail(f"names island {show(m.get('island'))}")
    f.real("at")
    for key in ("step", "tokens", "seq", "bytes_sent", "pid"):
        f.int(key, optional=True)
    f.get("base_version", _versions_ok, "a version or a list of versions", optional=True)
    f.real("tokens_per_s", 0.0, optional=True)
    f.real("download_s", 0.0, optional=True)
    f.real("time", optional=True)
    f.real("loss", optional=True, nullable=True)
    f.real("goodput", optional=True, nullable=True)
    f.get("goodput_state", _goodput_state_ok, "a goodput snapshot", optional=True, nullable=True)
    return m


_METRIC_FIELDS: dict[str, dict[str, str]] = {
    "eval": {"version": "int", "loss": "real?", "tokens_merged": "int"},
    "merge": {"version": "int", "applied": "int", "quarantined": "int", "tokens_merged": "int"},
}


def parse_metric(data: Any, kind: str) -> dict[str, Any]:
    """A record of metrics/{kind}/: an object; "eval" and "merge" records need their fields
    (version, loss-or-null, counts as ints >= 0), other kinds are free-form. BadMetric."""
    m = load_object(data, safejson.METRIC, BadMetric, f"{kind} metric")
    f = Fields(m, BadMetric, f"{kind} metric")
    for key, type_ in _METRIC_FIELDS.get(kind, {}).items():
        if type_ == "int":
            f.int(key, optional=key == "tokens_merged")
        else:
            f.real(key, nullable=True)
    return m


def parse_done(data: Any, island: str) -> dict[str, Any]:
    """done/{island}.json: names `island`; "at" a number; step, tokens, publishes, bytes_sent
    ints >= 0 if present. BadDoneMarker."""
    m = load_object(data, safejson.POINTER, BadDoneMarker, f"done marker of {island}")
    f = Fields(m, BadDoneMarker, f"done marker of {island}")
    if m.get("island") != island:
        f.fail(f"names island {show(m.get('island'))}")
    f.real("at")
    for key in ("step", "tokens", "publishes", "bytes_sent"):
        f.int(key, optional=True)
    return m


def parse_round_clock(data: Any) -> tuple[float, float]:
    """control/rounds.json: t0 (unix seconds, finite, >= 0) and period_s in (0, 86400];
    returns (t0, period_s). BadRoundClock."""
    m = load_object(data, safejson.POINTER, BadRoundClock, "round clock")
    f = Fields(m, BadRoundClock, "round clock")
    t0 = float(f.real("t0", lo=0.0))
    period = float(f.real("period_s", lo=0.0))
    if not 0 < period <= MAX_ROUND_S:
        f.fail(f"period_s {show(period)} is not in (0, {MAX_ROUND_S:g}]")
    return t0, period
