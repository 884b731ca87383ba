"""The one parser of object names in an experiment's layout (docs/STORE.md), ids included.

`parse_key` reads every name a listing returns; `parse_pseudograd_id` and `pseudograd_id` use
the same pieces, so listing and ids can never disagree (a name that lists is an id that
parses). Widths are exact, digits are ASCII (`re.ASCII`: no Arabic-Indic or full-width digits),
hex is lowercase, island names follow `training.config.names.NAME_PATTERN`. Anything else raises
`BadName`, a `CorruptObject` and a `ValueError`. The builders of the names the code writes
(`pseudograd_id`, `fragment_dir`, `checkpoint_dir`, and the syncer's `lease_key` and
`run_marker_key`) make only names `parse_key` accepts.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from training.config.names import NAME_PATTERN
from training.store.objectstore import CorruptObject
from training.store.safejson import one_line, show


class BadName(CorruptObject, ValueError):
    """An object name or id that does not fit the layout."""


SEQ_DIGITS, FRAGMENT_DIGITS, VERSION_DIGITS, STEP_DIGITS = 8, 3, 8, 10
MAX_SEQ = 10**SEQ_DIGITS - 1
MAX_FRAGMENT = 10**FRAGMENT_DIGITS - 1
MAX_VERSION = 10**VERSION_DIGITS - 1
MAX_STEP = 10**STEP_DIGITS - 1

_A = re.ASCII
PG_STEM = re.compile(r"([0-9]{8})-f([0-9]{3})", _A)
PG_PAYLOAD = re.compile(r"([0-9]{8})-f([0-9]{3})-([0-9a-f]{8})\.safetensors", _A)
FRAGMENT_ROOT = re.compile(r"fragments/f([0-9]{3})", _A)
FRAGMENT_DIR = re.compile(r"fragments/f([0-9]{3})/v([0-9]{8})-([0-9a-f]{8})", _A)
PROMOTION = "full.json"  # a light version's promotion marker (training/store/promotions.py)


def promoted_payload(name: str) -> str:
    """The file name of a promoted light version's payload `name` (params, outer_state, shadow)."""
    return f"full.{name}.safetensors"


FRAGMENT_FILES = frozenset(
    {"params.safetensors", "outer_state.safetensors", "manifest.json", "collected.json"}
    | {"update.safetensors", "shadow.safetensors"}  # outer.broadcast = "codec"
    | {PROMOTION}
    | {promoted_payload(n) for n in ("params", "outer_state", "shadow")}
)
CHECKPOINT_DIR = re.compile(r"c([0-9]{10})-([0-9a-f]{8})", _A)
CHECKPOINT_FILES = frozenset({"state.safetensors", "meta.json"})
METRIC_FILE = re.compile(r"([0-9]{20})-([0-9a-f]{8})\.json", _A)
SNAPSHOT = re.compile(r"snapshots/([0-9]{20})-([0-9a-f]{8})\.json", _A)
BEST = "snapshots/BEST.json"
FINAL = "snapshots/FINAL.json"  # the model a finished run ends with (finalize writes it once)
ROUNDS = "control/rounds.json"
LEASE_DIR = "control/syncer"  # a syncer shard's lease (training/merge/syncer.py)
RUNS_DIR = "control/runs"  # a DAG run's "its islands ended" marker (same)
FINALIZED = "control/finalized.json"  # the one finalize of the experiment (same)
LEASE = re.compile(r"control/syncer/shard-(0|[1-9][0-9]{0,2})\.json", _A)
RUN_SLUG = 80  # at most this many characters of a run id's slug
RUN_MARKER = re.compile(r"control/runs/([A-Za-z0-9_-]{1,80})-([0-9a-f]{8})\.json", _A)
TB_DIR = "tb"  # TensorBoard event files (training/store/tensorboard.py): tb/{run}/{file}
TB_RUN = re.compile(r"(island-[a-z0-9][a-z0-9-]{0,62}|merge(?:-s(?:0|[1-9][0-9]{0,2}))?|eval)", _A)
TB_FILE = re.compile(r"events\.out\.tfevents\.([0-9]{20})\.diloco\.([0-9a-f]{8})", _A)


@dataclass(frozen=True)
class ObjectName:
    """A parsed object name. `kind`: one of KINDS; the other fields are set where they apply:
    `id` for pseudo-gradient markers, payloads, ledger and quarantine entries; `fragment` for
    fragment HEADs and files; `dir` and `file` for fragment-version and checkpoint files;
    `metric` for metric records; `shard` for syncer leases."""

    kind: str
    island: str | None = None
    seq: int | None = None
    fragment: int | None = None
    id: str | None = None
    version: int | None = None
    step: int | None = None
    dir: str | None = None
    file: str | None = None
    metric: str | None = None
    shard: int | None = None


KINDS = (
    "config",
    "head",
    "fragment-file",
    "snapshot",
    "best",
    "pseudograd-marker",
    "pseudograd-payload",
    "ledger",
    "quarantine",
    "heartbeat",
    "done",
    "checkpoint-latest",
    "checkpoint-file",
    "metric",
    "stop",
    "island-stop",
    "rounds",
    "syncer-lease",
    "run-marker",
    "finalized",
    "tensorboard",
)


def is_name(text: Any) -> bool:
    """Whether `text` is an island / experiment / metric-kind name (NAME_PATTERN)."""
    return isinstance(text, str) and NAME_PATTERN.fullmatch(text) is not None


def _count(label: str, value: Any, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise BadName(f"invalid {label} {show(value)}: must be an int in [0, {top}]")
    return value


def pseudograd_id(island: str, seq: int, fragment: int) -> str:
    """ "{island}/{seq:08d}-f{fragment:03d}"; BadName if a part is out of range."""
    if not is_name(island):
        raise BadName(f"invalid island name {show(island)}")
    _count("seq", seq, MAX_SEQ)
    _count("fragment", fragment, MAX_FRAGMENT)
    return f"{island}/{seq:08d}-f{fragment:03d}"


def _pg_parts(island: str, stem: str) -> tuple[str, int, int] | None:
    match = PG_STEM.fullmatch(stem)
    if match is None or not is_name(island):
        return None
    return island, int(match[1]), int(match[2])


def parse_pseudograd_id(pg_id: Any) -> tuple[str, int, int]:
    """(island, seq, fragment) of a canonical id; BadName otherwise."""
    island, _, stem = pg_id.partition("/") if isinstance(pg_id, str) else ("", "", "")
    parts = _pg_parts(island, stem)
    if parts is None:
        raise BadName(f"invalid pseudo-gradient id {show(pg_id)}: expected island/SSSSSSSS-fFFF")
    return parts


def fragment_root(fragment: int) -> str:
    """ "fragments/f{fragment:03d}"; BadName if out of range."""
    return f"fragments/f{_count('fragment', fragment, MAX_FRAGMENT):03d}"


def fragment_dir(fragment: int, version: int, uuid8: str) -> str:
    """ "fragments/f{fragment:03d}/v{version:08d}-{uuid8}"; BadName if out of range."""
    name = f"{fragment_root(fragment)}/v{_count('version', version, MAX_VERSION):08d}-{uuid8}"
    if FRAGMENT_DIR.fullmatch(name) is None:
        raise BadName(f"invalid fragment directory {show(name)}")
    return name


def parse_fragment_dir(directory: Any, fragment: int | None = None) -> tuple[int, int]:
    """(fragment, version) of a fragment-version directory name (of `fragment`, if given);
    BadName otherwise."""
    match = FRAGMENT_DIR.fullmatch(directory) if isinstance(directory, str) else None
    if match is None or (fragment is not None and int(match[1]) != fragment):
        want = "fragments/fFFF" if fragment is None else f"fragments/f{fragment:03d}"
        raise BadName(
            f"invalid fragment directory {show(directory, 120)}: not {want}/vNNNNNNNN-<hex8>"
        )
    return int(match[1]), int(match[2])


def checkpoint_dir(island: str, step: int, uuid8: str) -> str:
    """ "checkpoints/{island}/c{step:010d}-{uuid8}"; BadName if out of range."""
    if not is_name(island):
        raise BadName(f"invalid island name {show(island)}")
    name = f"c{_count('step', step, MAX_STEP):010d}-{uuid8}"
    if CHECKPOINT_DIR.fullmatch(name) is None:
        raise BadName(f"invalid checkpoint directory {show(name)}")
    return f"checkpoints/{island}/{name}"


def lease_key(shard: int) -> str:
    """ "control/syncer/shard-{shard}.json": the lease of syncer shard `shard` (a shard owns at
    least one fragment, so shard <= MAX_FRAGMENT); BadName if out of range."""
    return f"{LEASE_DIR}/shard-{_count('shard', shard, MAX_FRAGMENT)}.json"


def run_slug(run_id: str) -> str:
    """A store-safe name for a DAG run id (Airflow's contain ':' and '+'): its letters, digits,
    '_' and '-' (others become '_'; at most RUN_SLUG, '_' stripped at both ends; "run" when
    nothing is left), '-', then the first 8 hex digits of the id's sha1 (ids that share a slug
    get different names)."""
    try:
        digest = hashlib.sha1(run_id.encode()).hexdigest()[:8]
    except (AttributeError, UnicodeError):  # not a string; a lone surrogate
        raise BadName(f"invalid run id {show(run_id)}: not a UTF-8 string") from None
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)[:RUN_SLUG].strip("_") or "run"
    return f"{slug}-{digest}"


def run_marker_key(run_id: str) -> str:
    """ "control/runs/{run_slug(run_id)}.json": the marker that DAG run `run_id`'s islands
    ended; BadName if `run_id` is not a UTF-8 string."""
    return f"{RUNS_DIR}/{run_slug(run_id)}.json"


def tb_events_key(run: str, time_ns: int, uuid8: str = "00000000") -> str:
    """ "tb/{run}/events.out.tfevents.{time_ns:020d}.diloco.{uuid8}": one flush of TensorBoard
    run `run` (TB_RUN: "island-{island}", "merge", "merge-s{shard}", "eval"); the 20-digit time makes name order
    time order (TensorBoard reads a run's files in name order); BadName if out of range."""
    if not isinstance(run, str) or TB_RUN.fullmatch(run) is None:
        raise BadName(
            f"invalid TensorBoard run {show(run)}: not island-<name>, merge, merge-s<shard> or eval"
        )
    name = f"events.out.tfevents.{_count('time', time_ns, 10**20 - 1):020d}.diloco.{uuid8}"
    if TB_FILE.fullmatch(name) is None:
        raise BadName(f"invalid TensorBoard file name {show(name)}")
    return f"{TB_DIR}/{run}/{name}"


def _refuse(key: Any, why: str) -> NoReturn:
    raise BadName(one_line(f"object name {show(key, 120)} {why}"))


def parse_key(key: Any) -> ObjectName:
    """The parsed name of object `key` (relative to the experiment root); BadName if `key` is
    not exactly one of the layout's names."""
    if not isinstance(key, str):
        _refuse(key, "is not a string")
    parts = key.split("/")
    top, n = parts[0], len(parts)
    if key == "config.json":
        return ObjectName("config")
    if key == "control/STOP":
        return ObjectName("stop")
    if key == ROUNDS:
        return ObjectName("rounds")
    if key == FINALIZED:
        return ObjectName("finalized")
    if top == "control" and n == 3 and parts[1] == "stop" and is_name(parts[2]):
        return ObjectName("island-stop", island=parts[2])
    if top == "control" and n == 3 and parts[1] == "syncer":
        match = LEASE.fullmatch(key)
        if match is None:
            _refuse(key, "is not control/syncer/shard-<shard>.json")
        return ObjectName("syncer-lease", shard=int(match[1]))
    if top == "control" and n == 3 and parts[1] == "runs":
        if RUN_MARKER.fullmatch(key) is None:
            _refuse(key, "is not control/runs/<run slug>-<hex8>.json")
        return ObjectName("run-marker")
    if top == "fragments":
        root = FRAGMENT_ROOT.fullmatch("/".join(parts[:2])) if n >= 2 else None
        if root and n == 3 and parts[2] == "HEAD.json":
            return ObjectName("head", fragment=int(root[1]))
        directory = "/".join(parts[:3])
        match = FRAGMENT_DIR.fullmatch(directory) if n == 4 else None
        if match and parts[3] in FRAGMENT_FILES:
            return ObjectName(
                "fragment-file",
                fragment=int(match[1]),
                version=int(match[2]),
                dir=directory,
                file=parts[3],
            )
        _refuse(key, "is not fragments/fFFF/HEAD.json or fragments/fFFF/vNNNNNNNN-<hex8>/<file>")
    if top == "snapshots":
        if key == BEST:
            return ObjectName("best")
        if key == FINAL:
            return ObjectName("final")
        if SNAPSHOT.fullmatch(key):
            return ObjectName("snapshot")
        _refuse(key, "is not snapshots/BEST.json, FINAL.json or snapshots/<20 digits>-<hex8>.json")
    if top in ("pseudograds", "ledger", "quarantine") and n == 3:
        if parts[2].endswith(".json"):
            got = _pg_parts(parts[1], parts[2][: -len(".json")])
            if got is not None:
                kind = "pseudograd-marker" if top == "pseudograds" else top
                return ObjectName(kind, *got, id=pseudograd_id(*got))
        elif top == "pseudograds" and is_name(parts[1]):
            match = PG_PAYLOAD.fullmatch(parts[2])
            if match is not None:
                got = (parts[1], int(match[1]), int(match[2]))
                return ObjectName("pseudograd-payload", *got, id=pseudograd_id(*got))
    if top in ("pseudograds", "ledger", "quarantine"):
        _refuse(key, f"is not {top}/ISLAND/SSSSSSSS-fFFF.json")
    if top in ("heartbeats", "done") and n == 2 and parts[1].endswith(".json"):
        island = parts[1][: -len(".json")]
        if is_name(island):
            return ObjectName("heartbeat" if top == "heartbeats" else "done", island=island)
    if top == "checkpoints" and n in (3, 4) and is_name(parts[1]):
        if n == 3 and parts[2] == "LATEST.json":
            return ObjectName("checkpoint-latest", island=parts[1])
        match = CHECKPOINT_DIR.fullmatch(parts[2]) if n == 4 else None
        if match and parts[3] in CHECKPOINT_FILES:
            directory = "/".join(parts[:3])
            step = int(match[1])
            return ObjectName(
                "checkpoint-file", island=parts[1], step=step, dir=directory, file=parts[3]
            )
    if top == "metrics" and n == 3 and is_name(parts[1]) and METRIC_FILE.fullmatch(parts[2]):
        return ObjectName("metric", metric=parts[1])
    if top == TB_DIR and n == 3 and TB_RUN.fullmatch(parts[1]) and TB_FILE.fullmatch(parts[2]):
        return ObjectName("tensorboard", dir=parts[1], file=parts[2])
    _refuse(key, "fits no name of the layout")


def parse_key_or_none(key: Any) -> ObjectName | None:
    """parse_key, or None for a name outside the layout (for listings that skip and count)."""
    try:
        return parse_key(key)
    except BadName:
        return None


class SkipTally:
    """Objects a reader skipped because they cannot be attributed to a contribution (a junk
    name, a broken heartbeat): counted, the first `keep` reasons kept for reports.
    Thread-safe enough for counting (a lost increment under a race only lowers a report)."""

    def __init__(self, keep: int = 10):
        self.count = 0
        self.keep = keep
        self.examples: list[str] = []

    def note(self, key: str, reason: str) -> None:
        self.count += 1
        if len(self.examples) < self.keep:
            self.examples.append(one_line(f"{key}: {reason}", 200))

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "examples": list(self.examples)}
