"""Typed, validated parsers of every record an experiment's store holds (docs/STORE.md).

Each parser takes the object's bytes (read through `safejson.load_json` with the kind's caps)
or an already loaded dict, and returns the validated record or raises its own error type, a
`CorruptObject` with a one-line reason. Nothing else escapes, whatever the input: the property
tests in tests/test_fuzz_records.py hold every parser to that. Values in messages are shortened
(`show`), so a hostile megabyte never ends up in a log line or a quarantine reason.

Names are parsed by `training.store.keys`; JSON by `training.store.safejson`.

Length: one parser per record kind, side by side so that their strictness stays alike; past 500
lines on purpose (splitting by kind would scatter the shared field checks).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, get_args

from training.config import MAX_ROUND_S, Codec
from training.store import safejson
from training.store.keys import (
    CHECKPOINT_DIR,
    MAX_SEQ,
    MAX_VERSION,
    BadName,
    is_name,
    parse_fragment_dir,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import CorruptObject
from training.store.safejson import JSONLimits, one_line, show


class BadRecord(CorruptObject):
    """Base of the per-kind record errors."""


class BadPseudoGradManifest(BadRecord):
    """A pseudo-gradient marker (manifest) that is invalid for its name."""


class BadHead(BadRecord):
    """A fragment's HEAD.json is not a valid pointer."""


class BadFragmentManifest(BadRecord):
    """A fragment version's manifest.json is invalid."""


class BadLedgerEntry(BadRecord):
    """A ledger entry is not {"version": n}."""


class BadQuarantineEntry(BadRecord):
    """A quarantine entry is not {"reason": str, "at": time}."""


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


MAX_COUNT = 2**53  # steps, tokens, bytes: exact as floats, far above anything real
MAX_REASON = 2000  # characters of a quarantine reason
MAX_APPLIED = 2**20
CODECS: tuple[str, ...] = get_args(Codec)  # the config's type (int2 was missing here)
SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
CHECKSUM_PATTERNS = {"crc32c": re.compile(r"[0-9a-f]{8}", re.ASCII), "sha256": SHA256}
"""The payload checksums a manifest may carry (tensors.CHECKSUMS), each under its own key."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


class Fields:
    """Checked access to one JSON object's fields; every failure raises `error` with
    "`what`: reason" (just the reason when `what` is empty)."""

    def __init__(self, obj: Mapping[str, Any], error: type[CorruptObject], what: str = ""):
        self.obj, self.error, self.what = obj, error, what

    def fail(self, reason: str) -> NoReturn:
        raise self.error(one_line(f"{self.what}: {reason}" if self.what else reason))

    def get(
        self,
        key: str,
        check: Callable[[Any], bool],
        expected: str,
        optional: bool = False,
        nullable: bool = False,
    ) -> Any:
        """obj[key] if `check` holds; None if absent (`optional`) or null (`nullable`)."""
        if key not in self.obj:
            if optional:
                return None
            self.fail(f"missing {key!r}")
        value = self.obj[key]
        if value is None and nullable:
            return None
        if not check(value):
            self.fail(f"{key} {show(value)} is not {expected}")
        return value

    def int(self, key: str, lo: int = 0, hi: int = MAX_COUNT, **kw: bool) -> Any:
        return self.get(key, lambda v: is_int(v) and lo <= v <= hi, f"an int in [{lo}, {hi}]", **kw)

    def real(self, key: str, lo: float = -math.inf, **kw: bool) -> Any:
        return self.get(key, lambda v: is_real(v) and v >= lo, f"a finite number >= {lo}", **kw)

    def str(self, key: str, pattern: re.Pattern | None = None, max_len: int = 4096, **kw: bool):
        def ok(v: Any) -> bool:
            if not isinstance(v, str) or len(v) > max_len:
                return False
            return pattern is None or pattern.fullmatch(v) is not None

        return self.get(key, ok, "a valid string", **kw)

    def name(self, key: str, **kw: bool) -> Any:
        return self.get(key, is_name, "a name matching [a-z0-9][a-z0-9-]{0,62}", **kw)


def checksum_field(m: dict, f: Fields) -> tuple[str, Any]:
    """(algorithm, value) of the one checksum key of `m` (crc32c or sha256); f.fail if there
    is none or more than one."""
    present = [a for a in CHECKSUM_PATTERNS if a in m]
    if len(present) != 1:
        f.fail(f"needs exactly one checksum of {sorted(CHECKSUM_PATTERNS)}, has {present}")
    return present[0], m[present[0]]


def _obj(data: Any, limits: JSONLimits, error: type[CorruptObject], what: str) -> dict:
    """The JSON object of `data` (bytes, read under `limits`) or `data` itself (a dict)."""
    if isinstance(data, dict):
        return data
    try:
        return safejson.load_json(data, limits, error)
    except error as exc:
        raise error(one_line(f"{what}: {exc}")) from None


# ---------------------------------------------------------------------------------------------
# Pseudo-gradients


@dataclass(frozen=True)
class PseudoGradCommit:
    """The store's fields of a pseudo-gradient marker (docs/STORE.md "Manifests")."""

    id: str
    island: str
    seq: int
    fragment: int
    payload: str
    nbytes: int
    checksum: tuple[str, str]  # (algorithm, hex): ("crc32c", 8 hex) or ("sha256", 64 hex)
    created_at: float
    raw: dict[str, Any] = field(repr=False, compare=False)


def parse_pseudograd_commit(data: Any, pg_id: str, experiment: str) -> PseudoGradCommit:
    """The store's fields of marker `pg_id` (bytes or a loaded dict) in `experiment`: it names
    this experiment, island, seq and fragment; its payload is
    `pseudograds/{pg_id}-<8 hex>.safetensors` (so inside the island's prefix); nbytes is an
    int in [0, 2^53]; one checksum, crc32c (8 lowercase hex) or sha256 (64); created_at a
    number. BadPseudoGradManifest
    (BadName for a bad `pg_id`)."""
    island, seq, fragment = parse_pseudograd_id(pg_id)
    m = _obj(data, safejson.MANIFEST, BadPseudoGradManifest, "manifest")
    f = Fields(m, BadPseudoGradManifest)
    if m.get("experiment") != experiment:
        f.fail(f"manifest names experiment {show(m.get('experiment'))}, not {experiment!r}")
    if m.get("island") != island or m.get("fragment") != fragment or not is_int(m["fragment"]):
        f.fail("manifest island/fragment do not match its name")
    if m.get("seq") != seq or not is_int(m["seq"]):
        f.fail(f"manifest does not describe this pseudo-gradient (seq {show(m.get('seq'))})")
    payload = m.get("payload")
    pattern = re.escape(f"pseudograds/{pg_id}-") + r"[0-9a-f]{8}\.safetensors"
    if not isinstance(payload, str) or re.fullmatch(pattern, payload, re.ASCII) is None:
        f.fail(f"payload key {show(payload, 120)} is not inside pseudograds/{island}/")
    algorithm, _ = checksum_field(m, f)
    return PseudoGradCommit(
        pg_id,
        island,
        seq,
        fragment,
        payload,
        nbytes=f.int("nbytes"),
        checksum=(algorithm, f.str(algorithm, CHECKSUM_PATTERNS[algorithm])),
        created_at=float(f.real("created_at")),
        raw=m,
    )


@dataclass(frozen=True)
class PseudoGradManifest:
    """A contribution's validated manifest: the commit plus the fields the merger reads."""

    commit: PseudoGradCommit
    base_version: int
    steps: int
    tokens: int
    codec: str
    published_at: float | None
    step_time_s: float | None
    island_step: int | None
    loss: float | None

    @property
    def id(self) -> str:
        return self.commit.id

    @property
    def island(self) -> str:
        return self.commit.island

    @property
    def seq(self) -> int:
        return self.commit.seq

    @property
    def fragment(self) -> int:
        return self.commit.fragment

    @property
    def raw(self) -> dict[str, Any]:
        return self.commit.raw


def parse_pseudograd_manifest(data: Any, pg_id: str, experiment: str) -> PseudoGradManifest:
    """A contribution's manifest: `parse_pseudograd_commit`, then the fields an island adds:
    base_version (int >= 0), steps and tokens (ints in (0, 2^53)), codec (known), and if
    present published_at and step_time_s (numbers), island_step (int >= 0), loss (number or
    null). Checks that need the config or HEAD (ranges, claims, sizes) are the merger's.
    Messages keep the merger's wording (tests/test_hostile.py). BadPseudoGradManifest."""
    m = _obj(data, safejson.MANIFEST, BadPseudoGradManifest, "manifest")
    commit = parse_pseudograd_commit(m, pg_id, experiment)
    f = Fields(m, BadPseudoGradManifest)
    base, steps, tokens = m.get("base_version"), m.get("steps"), m.get("tokens")
    if not (is_int(base) and 0 <= base <= MAX_VERSION):
        f.fail(f"base_version {show(base)} is not a committed version (not an int >= 0)")
    if not (is_int(steps) and is_int(tokens) and 0 < steps < MAX_COUNT and 0 < tokens < MAX_COUNT):
        f.fail(f"bad steps/tokens in manifest: {show(steps)}/{show(tokens)}")
    for key in ("published_at", "step_time_s"):
        if key in m and not is_real(m[key]):
            f.fail(f"bad {key} in manifest: {show(m[key])}")
    if m.get("codec") not in CODECS:
        f.fail(f"unknown codec {show(m.get('codec'))}")
    return PseudoGradManifest(
        commit,
        base_version=base,
        steps=steps,
        tokens=tokens,
        codec=m["codec"],
        published_at=None if m.get("published_at") is None else float(m["published_at"]),
        step_time_s=f.real("step_time_s", 0.0, optional=True),
        island_step=f.int("island_step", optional=True),
        loss=f.real("loss", optional=True, nullable=True),
    )


# ---------------------------------------------------------------------------------------------
# Fragment versions, ledger, quarantine


@dataclass(frozen=True)
class HeadRecord:
    version: int
    dir: str


def parse_head(data: Any, fragment: int) -> HeadRecord:
    """fragments/f{p:03d}/HEAD.json: {"dir": "fragments/f{p:03d}/v{version:08d}-<8 hex>",
    "version": n}. BadHead."""
    m = _obj(data, safejson.POINTER, BadHead, "HEAD")
    f = Fields(m, BadHead, "HEAD")
    version = f.int("version", 0, MAX_VERSION)
    directory = f.str("dir", max_len=200)
    try:
        got = parse_fragment_dir(directory, fragment)
    except BadName as exc:
        f.fail(str(exc))
    if got[1] != version:
        f.fail(f"dir {show(directory)} is not version {version}")
    return HeadRecord(version, directory)


def validate_applied(value: Any, error: type[CorruptObject] = BadFragmentManifest) -> list[str]:
    """An `applied` list: canonical pseudo-gradient ids, each once."""
    f = Fields({"applied": value}, error)
    if not isinstance(value, list) or len(value) > MAX_APPLIED:
        f.fail(f"applied {show(value)} is not a list of ids")
    try:
        ids = [pseudograd_id(*parse_pseudograd_id(i)) for i in value]
    except BadName as exc:
        f.fail(f"applied lists {exc}")
    if len(set(ids)) != len(ids):
        f.fail("applied lists an id twice")
    return ids


def _norm_ok(n: Any) -> bool:
    if isinstance(n, list) and len(n) == 2 and is_name(n[0]):
        n = n[1]
    return is_real(n) and n >= 0


def validate_merge_state(value: Any, error: type[CorruptObject] = BadFragmentManifest) -> dict:
    """A fragment's merge_state: steps and seen (ints >= 0), cursors (island -> the highest seq
    applied, an int in [-1, 10^8)), norms ([island, norm] or bare norms >= 0), sync_s (>= 0);
    if present version_times (version -> unix time) and last_claim (island -> [seq,
    island_step, published_at]). Other keys pass unchecked."""
    f = Fields(value if isinstance(value, dict) else {}, error, "merge_state")
    if not isinstance(value, dict):
        f.fail(f"{show(value)} is not an object")
    f.int("steps")
    f.int("seen")
    norms = value.get("norms")
    if not isinstance(norms, list) or not all(_norm_ok(n) for n in norms):
        f.fail(f"norms {show(norms)} is not a list of [island, norm >= 0]")
    cursors = value.get("cursors")
    if not isinstance(cursors, dict):
        f.fail(f"cursors {show(cursors)} is not an object")
    for island, seq in cursors.items():
        if not (is_name(island) and is_int(seq) and -1 <= seq <= MAX_SEQ):
            f.fail(f"cursor {show(island)}: {show(seq)} is not island: seq")
    f.real("sync_s", 0.0)
    times = value.get("version_times", {})
    if not isinstance(times, dict) or not all(
        isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 8 and is_real(t)
        for v, t in times.items()
    ):
        f.fail(f"version_times {show(times)} is not version: time")
    last = value.get("last_claim", {})
    if not isinstance(last, dict) or not all(
        is_name(i) and isinstance(c, list) and len(c) == 3 and all(is_real(x) for x in c)
        for i, c in last.items()
    ):
        f.fail(f"last_claim {show(last)} is not island: [seq, island_step, published_at]")
    return value


@dataclass(frozen=True)
class FragmentManifest:
    fragment: int
    version: int
    parent_version: int | None
    parent_dir: str | None
    created_at: float
    applied: list[str]
    checksums: dict[str, tuple[str, str]]  # payload -> (algorithm, hex)
    nbytes: dict[str, int]
    raw: dict[str, Any] = field(repr=False, compare=False)


def parse_fragment_manifest(
    data: Any,
    experiment: str,
    fragment: int,
    version: int | None = None,
    payloads=("params", "outer_state"),
) -> FragmentManifest:
    """A fragment version's manifest.json: names `experiment`, `fragment` and `version` (when
    given); a parent (version - 1 and its directory of the same fragment) or none; `applied`
    ids (of this fragment); nbytes and one checksum kind (crc32c or sha256: a map payload ->
    hex) of each payload; if present tokens_merged (int),
    merge_state (validate_merge_state) and merged_at (the merger's fields). BadFragmentManifest."""
    m = _obj(data, safejson.FRAGMENT_MANIFEST, BadFragmentManifest, "fragment manifest")
    f = Fields(m, BadFragmentManifest, "fragment manifest")
    if m.get("experiment") != experiment:
        f.fail(f"names experiment {show(m.get('experiment'))}, not {experiment!r}")
    if m.get("fragment") != fragment or not is_int(m["fragment"]):
        f.fail(f"names fragment {show(m.get('fragment'))}, not {fragment}")
    v = f.int("version", 0, MAX_VERSION)
    if version is not None and v != version:
        f.fail(f"describes version {v}, not {version}")
    parent = f.int("parent_version", 0, MAX_VERSION, nullable=True)
    parent_dir = f.str("parent_dir", max_len=200, nullable=True)
    ok = (parent is None) == (parent_dir is None)
    if ok and parent is not None:
        try:
            ok = parent == v - 1 and parse_fragment_dir(parent_dir, fragment)[1] == parent
        except BadName:
            ok = False
    if not ok:
        f.fail(f"parent {show(parent)} / {show(parent_dir)} is not version {v - 1}")
    algorithm, digests = checksum_field(m, f)
    sizes = m.get("nbytes")
    if not isinstance(digests, dict) or not isinstance(sizes, dict):
        f.fail(f"lacks {algorithm} / nbytes")
    for name in payloads:
        what = f"fragment manifest {algorithm}"
        Fields(digests, BadFragmentManifest, what).str(name, CHECKSUM_PATTERNS[algorithm])
        Fields(sizes, BadFragmentManifest, "fragment manifest nbytes").int(name)
    f.int("tokens_merged", optional=True)
    f.real("merged_at", optional=True)
    if "merge_state" in m:
        validate_merge_state(m["merge_state"])
    applied = validate_applied(m.get("applied"))
    if any(parse_pseudograd_id(i)[2] != fragment for i in applied):
        f.fail(f"applied lists a pseudo-gradient of another fragment than {fragment}")
    return FragmentManifest(
        fragment=fragment,
        version=v,
        parent_version=parent,
        parent_dir=parent_dir,
        created_at=float(f.real("created_at")),
        applied=applied,
        checksums={n: (algorithm, digests[n]) for n in payloads},
        nbytes={n: sizes[n] for n in payloads},
        raw=m,
    )


def parse_ledger_entry(data: Any) -> int:
    """A ledger entry {"version": n}: the version n >= 0. BadLedgerEntry."""
    m = _obj(data, safejson.POINTER, BadLedgerEntry, "ledger entry")
    return Fields(m, BadLedgerEntry, "ledger entry").int("version", 0, MAX_VERSION)


@dataclass(frozen=True)
class QuarantineEntry:
    reason: str
    at: float | None


def parse_quarantine_entry(data: Any) -> QuarantineEntry:
    """{"reason": str (<= 2000 characters), "at": unix time}. BadQuarantineEntry."""
    m = _obj(data, safejson.QUARANTINE, BadQuarantineEntry, "quarantine entry")
    f = Fields(m, BadQuarantineEntry, "quarantine entry")
    reason = f.str("reason", max_len=MAX_REASON)
    at = f.real("at", optional=True)
    return QuarantineEntry(reason, None if at is None else float(at))


# ---------------------------------------------------------------------------------------------
# Config, checkpoints, heartbeats, metrics, done markers


def parse_config_record(data: Any, experiment: str | None = None) -> dict[str, Any]:
    """config.json's top level: a JSON object whose `name`, if present, is `experiment`.
    BadConfigRecord. (`parse_experiment_config` validates every field.)"""
    m = _obj(data, safejson.CONFIG, BadConfigRecord, "config.json")
    if "name" in m and experiment is not None and m["name"] != experiment:
        raise BadConfigRecord(f"config.json names experiment {show(m['name'])}, not {experiment!r}")
    return m


def parse_experiment_config(data: Any, experiment: str | None = None):
    """config.json as a validated `ExperimentConfig`. BadConfigRecord with the first problem."""
    from training.config import ConfigError, parse_config

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
    m = _obj(data, safejson.POINTER, BadCheckpoint, f"checkpoint LATEST of {island}")
    f = Fields(m, BadCheckpoint, f"checkpoint LATEST of {island}")
    step = f.int("step", 0, 10**10 - 1)
    directory = f.str("dir", max_len=200)
    prefix = f"checkpoints/{island}/"
    match = CHECKPOINT_DIR.fullmatch(directory.removeprefix(prefix))
    if not directory.startswith(prefix) or match is None or int(match[1]) != step:
        f.fail(f"dir {show(directory, 120)} is not {prefix}c{step:010d}-<hex8>")
    return CheckpointPointer(directory, step, f.str("sha256", SHA256), f.int("nbytes"))


ANCHOR_KINDS = ("version", "params", "saved")
"""How a checkpoint holds each fragment's anchor (training/checkpointing.py): `version`, the
fragment's base version in the store (not in the checkpoint); `params`, equal to the
checkpointed parameters; `saved`, its own tensors `anchor/<name>` in the checkpoint."""


def parse_checkpoint_meta(data: Any, island: str, step: int | None = None) -> dict[str, Any]:
    """A checkpoint's meta.json: names `island` and `step`; if present, base_version an int or
    a list of ints >= 0, seq and tokens ints >= 0, anchor a list (as long as base_version)
    of ANCHOR_KINDS, publishes, bytes_sent and bytes_received ints >= 0. BadCheckpoint."""
    m = _obj(data, safejson.CHECKPOINT_META, BadCheckpoint, f"checkpoint meta of {island}")
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
    return m


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
    bytes_sent, pid (ints >= 0), base_version (a version or one per fragment), tokens_per_s, time (numbers), loss, goodput
    (numbers or null), goodput_state (a goodput snapshot). BadHeartbeat."""
    m = _obj(data, safejson.HEARTBEAT, BadHeartbeat, f"heartbeat of {island}")
    f = Fields(m, BadHeartbeat, f"heartbeat of {island}")
    if m.get("island") != island:
        f.fail(f"names island {show(m.get('island'))}")
    f.real("at")
    for key in ("step", "tokens", "seq", "bytes_sent", "pid"):
        f.int(key, optional=True)
    f.get("base_version", _versions_ok, "a version or a list of versions", optional=True)
    f.real("tokens_per_s", 0.0, optional=True)
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
    m = _obj(data, safejson.METRIC, BadMetric, f"{kind} metric")
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
    m = _obj(data, safejson.POINTER, BadDoneMarker, f"done marker of {island}")
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
    m = _obj(data, safejson.POINTER, BadRoundClock, "round clock")
    f = Fields(m, BadRoundClock, "round clock")
    t0 = float(f.real("t0", lo=0.0))
    period = float(f.real("period_s", lo=0.0))
    if not 0 < period <= MAX_ROUND_S:
        f.fail(f"period_s {show(period)} is not in (0, {MAX_ROUND_S:g}]")
    return t0, period
