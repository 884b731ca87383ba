"""Strict parsers of the merge side's records: pseudo-gradient manifests, fragment HEADs and
version manifests (their typed `MergeState`, applied ids), ledger and quarantine entries (docs/STORE.md).

The contract every parser keeps (bytes or a loaded dict in; the record or its own `BadRecord`
out, nothing else) and the shared field checks are in training/store/record_fields.py.

Past 500 lines on purpose: one parser per merge-side record kind (five kinds), each the one
reader of its object, side by side so that their limits and field rules read alike; the
island's records are training/store/island_records.py, the syncer's syncer_records.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, get_args

from training.config.experiment import Codec
from training.store import safejson
from training.store.keys import (
    MAX_SEQ,
    MAX_VERSION,
    BadName,
    is_name,
    parse_fragment_dir,
    parse_pseudograd_id,
    pseudograd_id,
)
from training.store.objectstore import CorruptObject
from training.store.record_fields import (
    CHECKSUM_PATTERNS,
    MAX_COUNT,
    BadRecord,
    Fields,
    checksum_field,
    is_int,
    is_real,
    load_object,
)
from training.store.safejson import show


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


MAX_REASON = 2000  # characters of a quarantine reason
MAX_APPLIED = 2**20
CODECS: tuple[str, ...] = get_args(Codec)  # the config's type (int2 was missing here)


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
    m = load_object(data, safejson.MANIFEST, BadPseudoGradManifest, "manifest")
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
    m = load_object(data, safejson.MANIFEST, BadPseudoGradManifest, "manifest")
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
    m = load_object(data, safejson.POINTER, BadHead, "HEAD")
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


# -- a fragment version's merge_state


class IslandNorm(NamedTuple):
    """One merged norm of a merge state's `norms`, `[island, norm]` in JSON."""

    island: str
    norm: float


class LastClaim(NamedTuple):
    """An island's newest applied claim, `[seq, island_step, published_at]` in JSON (for the
    claims' bounds, training/protocol/claims.py). The merger writes two ints and a time; any
    finite numbers are accepted, and kept as they are."""

    seq: int
    island_step: int
    published_at: float


@dataclass(frozen=True)
class MergeState:
    """A fragment version's merge_state (docs/STORE.md), parsed by `parse_merge_state`: the
    outer optimizer's counters (steps, seen), the cursors (island -> the highest seq applied to
    the fragment), the last merged norms (`IslandNorm`s; a bare number is a legacy entry of
    older stores), sync_s (the merger's running sync time), and for the claims' bounds
    version_times (version, as its decimal key, -> merger time) and last_claim (island ->
    `LastClaim`). Numbers are kept as stored, so `to_json` gives back the same JSON. Never
    changed in place: the next version's is a new one (`dataclasses.replace`)."""

    steps: int
    seen: int
    cursors: Mapping[str, int] = field(default_factory=dict)
    norms: tuple[IslandNorm | float, ...] = ()
    sync_s: float = 0.0
    version_times: Mapping[str, float] = field(default_factory=dict)
    last_claim: Mapping[str, LastClaim] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the manifest's `merge_state` (lists for the pairs and triples)."""
        return dict(
            steps=self.steps,
            seen=self.seen,
            cursors=dict(self.cursors),
            norms=[list(n) if isinstance(n, IslandNorm) else n for n in self.norms],
            sync_s=self.sync_s,
            version_times=dict(self.version_times),
            last_claim={island: list(c) for island, c in self.last_claim.items()},
        )


def _norm(n: Any) -> IslandNorm | float | None:
    """A `norms` entry: [island, norm >= 0] or a bare norm >= 0 (legacy); None if neither."""
    if isinstance(n, list) and len(n) == 2 and is_name(n[0]):
        return IslandNorm(n[0], n[1]) if is_real(n[1]) and n[1] >= 0 else None
    return n if is_real(n) and n >= 0 else None


def parse_merge_state(value: Any, error: type[CorruptObject] = BadFragmentManifest) -> MergeState:
    """A fragment's merge_state: steps and seen (ints >= 0), cursors (island -> the highest seq
    applied, an int in [-1, 10^8)), norms ([island, norm] or bare norms >= 0), sync_s (>= 0);
    if present version_times (version -> unix time) and last_claim (island -> [seq,
    island_step, published_at]). Other keys are ignored. `error` (BadFragmentManifest), the
    message naming the field."""
    f = Fields(value if isinstance(value, dict) else {}, error, "merge_state")
    if not isinstance(value, dict):
        f.fail(f"{show(value)} is not an object")
    steps, seen = f.int("steps"), f.int("seen")
    norms = value.get("norms")
    parsed = [_norm(n) for n in norms] if isinstance(norms, list) else [None]
    if any(n is None for n in parsed):
        f.fail(f"norms {show(norms)} is not a list of [island, norm >= 0]")
    cursors = value.get("cursors")
    if not isinstance(cursors, dict):
        f.fail(f"cursors {show(cursors)} is not an object")
    for island, seq in cursors.items():
        if not (is_name(island) and is_int(seq) and -1 <= seq <= MAX_SEQ):
            f.fail(f"cursor {show(island)}: {show(seq)} is not island: seq")
    sync_s = f.real("sync_s", 0.0)
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
    return MergeState(
        steps,
        seen,
        dict(cursors),
        tuple(parsed),
        sync_s,
        dict(times),
        {island: LastClaim(*c) for island, c in last.items()},
    )


def merge_state_of(manifest: Mapping[str, Any]) -> MergeState:
    """The merge state of a fragment version's manifest (its JSON object: a checked one's
    `raw`, as the store's readers give it). BadFragmentManifest if it has none."""
    if "merge_state" not in manifest:
        raise BadFragmentManifest("merge_state: missing")
    return parse_merge_state(manifest["merge_state"])


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
    merge_state: MergeState | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    # a light version (syncer.full_every > 1): no outer state and no broadcast shadow; its
    # nearest full ancestor (version, dir), where a cold start replays forward from
    full_at: tuple[int, str] | None = None
    # a light version without params (update broadcast): (crc32c, nbytes) of the params
    # payload it would hold, which a replay of it must reproduce
    params_sum: tuple[str, int] | None = None


def light_ancestor(m: Mapping[str, Any]) -> tuple[int, str] | None:
    """(version, dir) of the nearest full ancestor a light version's manifest (already parsed
    by parse_fragment_manifest) names; None for a full version (no `full` field: full)."""
    if m.get("full", True) is True:
        return None
    return m["full_version"], m["full_dir"]


def _full_fields(m: Mapping[str, Any], f: Fields, fragment: int, v: int) -> tuple | None:
    """`full` (optional; absent: a full version) and, on a light version only, its nearest
    full ancestor `full_version` (< v) and `full_dir` (that version's directory)."""
    full = m.get("full", True)
    if not isinstance(full, bool):
        f.fail(f"full is {show(full)}, not a boolean")
    if full:
        if "full_version" in m or "full_dir" in m:
            f.fail("a full version names a full ancestor")
        return None
    if v == 0:
        f.fail("version 0 is light")
    at = f.int("full_version", 0, max(v - 1, 0))
    directory = f.str("full_dir", max_len=200)
    try:
        ok = parse_fragment_dir(directory, fragment)[1] == at
    except BadName:
        ok = False
    if not ok:
        f.fail(f"full ancestor {show(at)} / {show(directory)} is not a directory of that version")
    return at, directory


PARAMS_SUM = ("params_crc32c", "params_nbytes")


def params_sum(m: Mapping[str, Any]) -> tuple[str, int] | None:
    """(crc32c, nbytes) of the params a light version without params records (its manifest
    already parsed by parse_fragment_manifest); None when the version holds its params."""
    if "params_crc32c" not in m:
        return None
    return m["params_crc32c"], m["params_nbytes"]


def _params_sum_fields(m: Mapping[str, Any], f: Fields, light: bool, digests: Any, sizes: Any):
    """`params_crc32c` (8 hex) and `params_nbytes` (int): both or neither; only on a light
    version, and exactly when it lists no params payload."""
    present = [k in m for k in PARAMS_SUM]
    if not any(present):
        return None
    if not all(present):
        f.fail("params_crc32c and params_nbytes come together")
    if not light:
        f.fail("a full version records params_crc32c (it holds its params)")
    if (isinstance(digests, dict) and "params" in digests) or (
        isinstance(sizes, dict) and "params" in sizes
    ):
        f.fail("a version lists params and records params_crc32c")
    return f.str("params_crc32c", CHECKSUM_PATTERNS["crc32c"]), f.int("params_nbytes")


def parse_fragment_manifest(
    data: Any,
    experiment: str,
    fragment: int,
    version: int | None = None,
    payloads=None,
) -> FragmentManifest:
    """A fragment version's manifest.json: names `experiment`, `fragment` and `version` (when
    given); a parent (version - 1 and its directory of the same fragment) or none; `applied`
    ids (of this fragment); nbytes and one checksum kind (crc32c or sha256: a map payload ->
    hex) of each payload (`payloads`; default params, and outer_state unless light); if
    present tokens_merged (int), merge_state (parse_merge_state) and merged_at (the merger's
    fields); `full` false (a light version) with its full ancestor, and on a light version
    without params `params_crc32c` and `params_nbytes` instead of the params payload.
    BadFragmentManifest."""
    m = load_object(data, safejson.FRAGMENT_MANIFEST, BadFragmentManifest, "fragment manifest")
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
    full_at = _full_fields(m, f, fragment, v)
    algorithm, digests = checksum_field(m, f)
    sizes = m.get("nbytes")
    if not isinstance(digests, dict) or not isinstance(sizes, dict):
        f.fail(f"lacks {algorithm} / nbytes")
    summed = _params_sum_fields(m, f, full_at is not None, digests, sizes)
    if payloads is None:
        payloads = ("params",) if full_at is None or summed is None else ()
        payloads += () if full_at is not None else ("outer_state",)
    for name in payloads:
        what = f"fragment manifest {algorithm}"
        Fields(digests, BadFragmentManifest, what).str(name, CHECKSUM_PATTERNS[algorithm])
        Fields(sizes, BadFragmentManifest, "fragment manifest nbytes").int(name)
    f.int("tokens_merged", optional=True)
    f.real("merged_at", optional=True)
    merge_state = parse_merge_state(m["merge_state"]) if "merge_state" in m else None
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
        merge_state=merge_state,
        raw=m,
        full_at=full_at,
        params_sum=summed,
    )


class BadPromotion(BadRecord):
    """A promotion marker (`full.json` beside a light version) that cannot be trusted."""


PROMOTED_PAYLOADS = ("params", "outer_state", "shadow")
"""What a promotion may hold (training/store/promotions.py): params only where the version
leaves them out, the outer state always, the broadcast shadow where the merger held one."""


@dataclass(frozen=True)
class Promotion:
    """A light version's full state, written beside it after it was committed: each payload's
    (crc32c, nbytes) by name (PROMOTED_PAYLOADS)."""

    fragment: int
    version: int
    directory: str
    sums: dict[str, tuple[str, int]]
    created_at: float


def parse_promotion(
    data: Any, experiment: str, fragment: int, version: int, directory: str, manifest: Mapping
) -> Promotion:
    """The promotion marker of the light version (`fragment`, `version`) in `directory`, whose
    `manifest` was parsed by parse_fragment_manifest: it names that very version, lists an
    outer state, lists params exactly when the version leaves them out, with the crc32c and
    size the manifest records for them. BadPromotion."""
    m = load_object(data, safejson.POINTER, BadPromotion, "promotion")
    f = Fields(m, BadPromotion, "promotion")
    unknown = sorted(
        set(m) - {"experiment", "fragment", "version", "dir", "created_at", "crc32c", "nbytes"}
    )
    if unknown:
        f.fail(f"unknown fields {show(unknown)}")
    if m.get("experiment") != experiment:
        f.fail(f"names experiment {show(m.get('experiment'))}, not {experiment!r}")
    if (m.get("fragment"), m.get("version"), m.get("dir")) != (fragment, version, directory):
        f.fail(f"names {show(m.get('dir'))}, not {directory}")
    if light_ancestor(manifest) is None:
        f.fail("promotes a full version")
    digests, sizes = m.get("crc32c"), m.get("nbytes")
    if not isinstance(digests, dict) or not isinstance(sizes, dict) or set(digests) != set(sizes):
        f.fail("needs crc32c and nbytes of the same payloads")
    summed = params_sum(manifest)
    names = set(digests)
    want = {"outer_state"} | ({"params"} if summed else set())
    if not want <= names <= want | {"shadow"}:
        f.fail(f"lists payloads {show(sorted(names))}, not {sorted(want)} (and a shadow)")
    sums = {}
    for name in sorted(names):
        crc = Fields(digests, BadPromotion, "promotion crc32c").str(
            name, CHECKSUM_PATTERNS["crc32c"]
        )
        sums[name] = (crc, Fields(sizes, BadPromotion, "promotion nbytes").int(name))
    if summed and sums["params"] != summed:
        f.fail(f"params {sums['params']} are not the version's {summed}")
    return Promotion(fragment, version, directory, sums, float(f.real("created_at")))


def parse_ledger_entry(data: Any) -> int:
    """A ledger entry {"version": n}: the version n >= 0. BadLedgerEntry."""
    m = load_object(data, safejson.POINTER, BadLedgerEntry, "ledger entry")
    return Fields(m, BadLedgerEntry, "ledger entry").int("version", 0, MAX_VERSION)


@dataclass(frozen=True)
class QuarantineEntry:
    reason: str
    at: float | None


def parse_quarantine_entry(data: Any) -> QuarantineEntry:
    """{"reason": str (<= 2000 characters), "at": unix time}. BadQuarantineEntry."""
    m = load_object(data, safejson.QUARANTINE, BadQuarantineEntry, "quarantine entry")
    f = Fields(m, BadQuarantineEntry, "quarantine entry")
    reason = f.str("reason", max_len=MAX_REASON)
    at = f.real("at", optional=True)
    return QuarantineEntry(reason, None if at is None else float(at))
