"""The experiment layout (docs/STORE.md): object names, the JSON encoding, and the refs readers get.

Every name pattern of the layout lives here, once; the store modules import them.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from training.names import validate_name
from training.store.objectstore import CorruptObject, Generation, StoreError

LAYOUT_VERSION = 2  # recorded in config.json as "layout"; a store of another layout is refused

MAX_FRAGMENT = 999
_NAME = r"[a-z0-9][a-z0-9-]{0,62}"
_PG_ID = re.compile(rf"^({_NAME})/(\d{{8,}})-f(\d{{3}})$")
_FRAGMENT_DIR = re.compile(r"^fragments/f(\d{3})/v(\d{8,})-[0-9a-f]{8}$")
_SNAPSHOT = re.compile(r"^snapshots/\d{20}-[0-9a-f]{8}\.json$")
_PG_MARKER = re.compile(rf"^pseudograds/({_NAME}/\d{{8,}}-f\d{{3}})\.json$")
_LEDGER_ENTRY = re.compile(rf"^ledger/({_NAME}/\d{{8,}}-f\d{{3}})\.json$")
_QUARANTINE_ENTRY = re.compile(rf"^quarantine/({_NAME}/\d{{8,}}-f\d{{3}})\.json$")
_PER_ISLAND = re.compile(rf"^[a-z]+/({_NAME})\.json$")
_NAME_RE = re.compile(_NAME)
_METRIC = re.compile(r"^metrics/[a-z0-9-]+/\d{20}-[0-9a-f]{8}\.json$")

_FRAGMENT_RESERVED = frozenset(
    {"experiment", "fragment", "version", "parent_version", "parent_dir", "created_at"}
    | {"created_at_iso", "applied", "sha256", "nbytes"}
)
_PG_RESERVED = frozenset(
    {"experiment", "island", "seq", "fragment", "payload", "nbytes", "sha256", "created_at"}
)


class ExperimentExists(StoreError):
    """config.json already exists with different content."""


class DoubleApply(StoreError):
    """A pseudo-gradient is already recorded as applied in a different version."""


# ---------------------------------------------------------------------------------------------
# JSON and ids


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def dump_json(obj: Any) -> bytes:
    """The one JSON encoding used for every store object: sorted keys, compact, UTF-8.

    numpy scalars and arrays become plain numbers and lists. NaN/inf are written as NaN/Infinity
    (what Python's json reads back), so metrics with a diverged loss still round-trip.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default
    ).encode()


def load_json(data: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object; CorruptObject naming `what` if it is not one."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptObject(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CorruptObject(f"{what}: not a JSON object")
    return obj


def pseudograd_id(island: str, seq: int, fragment: int) -> str:
    """The id of a pseudo-gradient: "{island}/{seq:08d}-f{fragment:03d}"."""
    validate_name("island", island)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"invalid seq {seq!r}: must be an int >= 0")
    if isinstance(fragment, bool) or not isinstance(fragment, int):
        raise ValueError(f"invalid fragment {fragment!r}: must be an int")
    if not 0 <= fragment <= MAX_FRAGMENT:
        raise ValueError(f"invalid fragment {fragment!r}: must be in [0, {MAX_FRAGMENT}]")
    return f"{island}/{seq:08d}-f{fragment:03d}"


def parse_pseudograd_id(pg_id: str) -> tuple[str, int, int]:
    """(island, seq, fragment) of a canonical pseudo-gradient id; ValueError otherwise."""
    match = _PG_ID.fullmatch(pg_id) if isinstance(pg_id, str) else None
    if match is None or pseudograd_id(match[1], int(match[2]), int(match[3])) != pg_id:
        raise ValueError(f"invalid pseudo-gradient id {pg_id!r}: expected island/SSSSSSSS-fFFF")
    return match[1], int(match[2]), int(match[3])


def _now() -> float:
    return round(time.time(), 3)


def iso(t: float) -> str:
    """ISO-8601 UTC (second precision) of a unix time: stored next to every epoch time."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def fragment_root(fragment: int) -> str:
    """The folder of fragment p's version chain: fragments/f{p:03d}."""
    if (
        isinstance(fragment, bool)
        or not isinstance(fragment, int)
        or not 0 <= fragment <= MAX_FRAGMENT
    ):
        raise ValueError(f"invalid fragment {fragment!r}: must be an int in [0, {MAX_FRAGMENT}]")
    return f"fragments/f{fragment:03d}"


def _uuid8() -> str:
    return uuid.uuid4().hex[:8]


_last_time_ns = 0
_time_ns_lock = threading.Lock()


def _unique_time_ns() -> int:
    """time.time_ns(), strictly increasing within this process (orders metric records)."""
    global _last_time_ns
    with _time_ns_lock:
        _last_time_ns = max(time.time_ns(), _last_time_ns + 1)
        return _last_time_ns


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# Refs


@dataclass(frozen=True)
class HeadPointer:
    """What fragments/f{p:03d}/HEAD.json says, plus its store generation (the CAS token)."""

    fragment: int
    version: int
    dir: str
    generation: Generation


@dataclass(frozen=True, eq=False)
class FragmentVersion:
    """A committed, checksum-verified version of one fragment (outer_state empty unless asked)."""

    fragment: int
    version: int
    params: dict[str, np.ndarray]
    outer_state: dict[str, np.ndarray]
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Snapshot:
    """A vector of fragment versions: one point of the run that can be evaluated and replayed."""

    versions: tuple[int, ...]
    dirs: tuple[str, ...]
    tokens_merged: int = 0
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "versions": list(self.versions),
            "dirs": list(self.dirs),
            "tokens_merged": self.tokens_merged,
            "at": self.at,
            "at_iso": iso(self.at),
        }


@dataclass(frozen=True)
class PseudoGradRef:
    """A committed pseudo-gradient. `payload_key` is relative to the experiment root."""

    island: str
    seq: int
    fragment: int
    id: str
    manifest: dict[str, Any] = field(compare=False)
    payload_key: str
