"""Strict records of the syncer's control objects (docs/STORE.md, "The syncer's objects"): a merge
shard's lease, `control/syncer/shard-{s}.json`, the marker that a DAG run's islands ended,
`control/runs/{slug}-{hex8}.json` (names: `training.store.keys.lease_key`, `run_marker_key`),
and the claim of the experiment's one finalize, `control/finalized.json` (`keys.FINALIZED`).

Each record has one writer (`lease_record`, `run_marker_record`: the bytes the syncer has always
written, checked by the parser before they are written) and one reader (`parse_lease`,
`parse_run_marker`: exactly the writer's fields, their types, finite times, bounded sizes;
`BadLease` / `BadRunMarker` with a one-line reason otherwise). The contract every parser keeps
and the shared field checks are in training/store/record_fields.py. The I/O (compare-and-swap of
a lease, what a refused lease means) is training/store/syncer_control.py's; the decisions are
training/merge/syncer.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from training.store import safejson
from training.store.keys import is_name
from training.store.record_fields import BadRecord, Fields, load_object
from training.store.safejson import show


class BadLease(BadRecord):
    """A syncer shard's lease is invalid."""


class BadRunMarker(BadRecord):
    """A run's islands-ended marker is invalid."""


MAX_OWNER = 250  # a lease's owner is a DAG run id (Airflow keeps at most 250 characters)
MAX_HOLDER = 200  # "host/pid" of the process holding a lease, for people (cut to this)
MAX_RUN_ID = 250
LEASE_FIELDS = ("owner", "expires_at", "holder")  # in the order they are written
RUN_MARKER_FIELDS = ("ended_at", "islands", "run_id")


@dataclass(frozen=True)
class Lease:
    """One shard's lease: `owner` merges the shard until `expires_at` (unix seconds; 0:
    released). `holder` names the process, for people."""

    owner: str
    expires_at: float
    holder: str = ""

    def live(self, now: float) -> bool:
        return self.expires_at > now


def parse_lease(data: Any) -> Lease:
    """control/syncer/shard-{s}.json: exactly owner (a string of at most MAX_OWNER characters),
    expires_at (a finite number >= 0) and holder (a string of at most MAX_HOLDER). BadLease."""
    m = load_object(data, safejson.LEASE, BadLease, "syncer lease")
    f = Fields(m, BadLease, "syncer lease")
    if set(m) != set(LEASE_FIELDS):
        f.fail(f"fields {show(sorted(m))} are not {sorted(LEASE_FIELDS)}")
    owner = f.str("owner", max_len=MAX_OWNER)
    expires_at = float(f.real("expires_at", lo=0.0))
    return Lease(owner, expires_at, f.str("holder", max_len=MAX_HOLDER))


def lease_record(lease: Lease) -> bytes:
    """The bytes of `lease` (`json.dumps` of owner, expires_at, holder in that order). ValueError
    for a lease `parse_lease` would refuse (a reader would take it for a free one)."""
    data = json.dumps(
        {"owner": lease.owner, "expires_at": lease.expires_at, "holder": lease.holder}
    ).encode()
    try:
        parse_lease(data)
    except BadLease as exc:
        raise ValueError(f"not a valid lease: {exc}") from None
    return data


@dataclass(frozen=True)
class RunMarker:
    """DAG run `run_id`'s island tasks were over at `ended_at` (unix seconds); `islands`: the
    islands it ran."""

    run_id: str
    ended_at: float
    islands: tuple[str, ...]


def parse_run_marker(data: Any, run_id: str | None = None) -> RunMarker:
    """control/runs/{slug}.json: exactly run_id (a string of at most MAX_RUN_ID characters; it
    must be `run_id`, if given), ended_at (a finite number >= 0) and islands (a list of island
    names). BadRunMarker."""
    m = load_object(data, safejson.RUN_MARKER, BadRunMarker, "run marker")
    f = Fields(m, BadRunMarker, "run marker")
    if set(m) != set(RUN_MARKER_FIELDS):
        f.fail(f"fields {show(sorted(m))} are not {sorted(RUN_MARKER_FIELDS)}")
    got = f.str("run_id", max_len=MAX_RUN_ID)
    if run_id is not None and got != run_id:
        f.fail(f"names run {show(got)}, not {show(run_id)}")
    ended_at = float(f.real("ended_at", lo=0.0))
    islands = f.get(
        "islands",
        lambda v: isinstance(v, list) and all(is_name(i) for i in v),
        "a list of island names",
    )
    return RunMarker(got, ended_at, tuple(islands))


def run_marker_record(run_id: str, ended_at: float, islands: Iterable[str]) -> bytes:
    """The bytes of run `run_id`'s marker (`json.dumps`, keys sorted). ValueError for a marker
    `parse_run_marker` would refuse."""
    record = {"run_id": run_id, "ended_at": ended_at, "islands": list(islands)}
    data = json.dumps(record, sort_keys=True).encode()
    try:
        parse_run_marker(data, run_id)
    except BadRunMarker as exc:
        raise ValueError(f"not a valid run marker: {exc}") from None
    return data


class BadFinalized(BadRecord):
    """The claim of an experiment's finalize is invalid."""


FINALIZED_FIELDS = ("at", "run_id")


@dataclass(frozen=True)
class Finalized:
    """DAG run `run_id` claimed the experiment's finalize at `at` (unix seconds)."""

    run_id: str
    at: float


def parse_finalized(data: Any) -> Finalized:
    """control/finalized.json: exactly run_id (a string of at most MAX_RUN_ID characters) and
    at (a finite number >= 0). BadFinalized."""
    m = load_object(data, safejson.FINALIZED, BadFinalized, "finalize claim")
    f = Fields(m, BadFinalized, "finalize claim")
    if set(m) != set(FINALIZED_FIELDS):
        f.fail(f"fields {show(sorted(m))} are not {sorted(FINALIZED_FIELDS)}")
    return Finalized(f.str("run_id", max_len=MAX_RUN_ID), float(f.real("at", lo=0.0)))


def finalized_record(run_id: str, at: float) -> bytes:
    """The bytes of run `run_id`'s finalize claim. ValueError for one `parse_finalized` refuses."""
    data = json.dumps({"at": at, "run_id": run_id}, sort_keys=True).encode()
    try:
        parse_finalized(data)
    except BadFinalized as exc:
        raise ValueError(f"not a valid finalize claim: {exc}") from None
    return data
