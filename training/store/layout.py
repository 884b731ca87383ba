"""The experiment layout (docs/STORE.md): object names, the JSON encoding, and the refs readers get.

Every object name is parsed by training/store/keys.py (one rule in one place) and every JSON
object read by training/store/safejson.py; this module re-exports the pieces the store modules
use and holds the refs readers get.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from training.store import safejson
from training.store.keys import (  # the one name parser: re-exported for the store modules
    MAX_FRAGMENT,
    fragment_dir,
    fragment_root,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import CorruptObject, Generation, StoreError
from training.store.safejson import JSONLimits, dump_json

ANY = JSONLimits(16 * 2**20)  # objects without caps of their own

__all__ = [
    "ANY",
    "LAYOUT_VERSION",
    "MAX_FRAGMENT",
    "dump_json",
    "fragment_dir",
    "fragment_root",
    "load_json",
    "parse_pseudograd_id",
    "pseudograd_id",
]

LAYOUT_VERSION = 2  # recorded in config.json as "layout"; a store of another layout is refused

# manifest fields the store writes itself: a fragment version's and a pseudo-gradient's extra
# fields (the caller's) may not use them
FRAGMENT_RESERVED = frozenset(
    {"experiment", "fragment", "version", "parent_version", "parent_dir", "created_at"}
    | {"created_at_iso", "applied", "sha256", "crc32c", "nbytes", "full", "full_version"}
    | {"full_dir", "params_crc32c", "params_nbytes"}
)
PG_RESERVED = frozenset(
    {"experiment", "island", "seq", "fragment", "payload", "nbytes", "sha256", "crc32c"}
    | {"created_at"}
)


class ExperimentExists(StoreError):
    """config.json already exists with different content."""


class DoubleApply(StoreError):
    """A pseudo-gradient is already recorded as applied in a different version."""


# ---------------------------------------------------------------------------------------------
# JSON: the one reader is safejson.load_json (bounded, strict), the one writer safejson.dump_json


def load_json(data: bytes, what: str, limits: JSONLimits = ANY) -> dict[str, Any]:
    """Parse a JSON object under `limits` (safejson.load_json); CorruptObject naming `what`."""
    try:
        return safejson.load_json(data, limits)
    except CorruptObject as exc:
        raise type(exc)(f"{what}: {exc}") from None


def now() -> float:
    """The time now in unix seconds, to the millisecond: what records store as their times."""
    return round(time.time(), 3)


def iso(t: float) -> str:
    """ISO-8601 UTC (second precision) of a unix time: stored next to every epoch time."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def new_uuid8() -> str:
    """8 random hex digits: the suffix that makes a directory or record name unique."""
    return uuid.uuid4().hex[:8]


_last_time_ns = 0
_time_ns_lock = threading.Lock()


def unique_time_ns() -> int:
    """time.time_ns(), strictly increasing within this process (orders metric records)."""
    global _last_time_ns
    with _time_ns_lock:
        _last_time_ns = max(time.time_ns(), _last_time_ns + 1)
        return _last_time_ns


# ---------------------------------------------------------------------------------------------
# Refs


@dataclass(frozen=True)
class HeadPointer:
    """What fragments/f{p:03d}/HEAD.json says, plus its store generation (the CAS token)."""

    fragment: int
    version: int
    dir: str
    generation: Generation


def parent_of(pointer: HeadPointer, manifest: Mapping[str, Any]) -> HeadPointer | None:
    """The version before `pointer`'s on its chain, from its `manifest`'s parent_dir and
    parent_version (None when it names none: version 0, or a manifest without them)."""
    parent_dir, parent_version = manifest.get("parent_dir"), manifest.get("parent_version")
    if not isinstance(parent_dir, str) or not isinstance(parent_version, int):
        return None
    return HeadPointer(pointer.fragment, parent_version, parent_dir, 0)


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
    error: str | None = field(default=None, compare=False)  # the marker could not be read
