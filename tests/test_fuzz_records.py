"""Property-based tests of every store reader: whatever the bytes, only the documented error
type escapes (training/store/keys.py, safejson.py, merge_records.py, island_records.py,
syncer_records.py, tensors.py, training/codecs/host.py).

Inputs: random bytes, mutations of valid objects (fields deleted, replaced by values of the
wrong type, huge numbers, deep nesting, unicode; bytes flipped, truncated, spliced), and names
with other widths and non-ASCII digits. The fast profile runs FAST examples per reader in the
default suite; the `slow` tests run the same properties with SLOW examples.

Past 500 lines: one property per reader, on one set of strategies (the mutations above).
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.codecs import host as codecs
from training.protocol.claims import norm_median
from training.store import island_records, keys, merge_records, safejson, syncer_records
from training.store.tensors import BadTensors, decode_tensors, encode_tensors, sha256

FAST = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOW = settings(FAST, max_examples=3000)

# -- values and mutations -------------------------------------------------------------------

HOSTILE_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**53, max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "\u0661\u0662", "\uff11", "a/../b", "\x00", "é" * 5, "0" * 9]),
)
JSON_VALUES = st.recursive(
    HOSTILE_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _encode(obj) -> bytes:
    return json.dumps(obj, allow_nan=True, ensure_ascii=False, default=str).encode(
        "utf-8", "surrogatepass"
    )


@st.composite
def mutated(draw, valid: dict) -> bytes:
    """A valid record, its fields mutated, then maybe its bytes mutated."""
    obj = dict(valid)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["delete", "replace", "add"]))
        if op == "delete" and obj:
            obj.pop(draw(st.sampled_from(sorted(obj))))
        elif op == "replace" and obj:
            obj[draw(st.sampled_from(sorted(obj)))] = draw(JSON_VALUES)
        else:
            obj[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    data = _encode(obj)
    op = draw(st.sampled_from(["none", "none", "flip", "truncate", "splice", "nest"]))
    if op == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    elif op == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif op == "splice":
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.binary(max_size=16)) + data[i:]
    elif op == "nest":
        depth = draw(st.integers(1, 3000))
        data = b'{"x":' + b"[" * depth + b"]" * draw(st.integers(0, depth)) + b"}"
    return data


def hostile_bytes(valid: dict):
    return st.one_of(
        st.binary(max_size=200),
        mutated(valid),
        st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 5000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.sampled_from(
            [b"NaN", b'{"a":NaN}', b'{"a":1e999}', b'{"a":-Infinity}', b'{"a":1,"a":2}']
        ),
        st.integers(1, 6000).map(lambda n: b'{"a":' + b"9" * n + b"}"),
        st.just(b'{"a":"\\ud800"}'),
        st.just(b"\xef\xbb\xbf{}"),
    )


# -- the readers and their error types ---------------------------------------------------------

PG = "isl-a/00000003-f001"
PAYLOAD = f"pseudograds/{PG}-0123abcd.safetensors"
COMMIT = dict(
    experiment="exp",
    island="isl-a",
    seq=3,
    fragment=1,
    payload=PAYLOAD,
    nbytes=100,
    sha256="0" * 64,
    created_at=1.5,
)
MANIFEST = dict(
    COMMIT,
    base_version=2,
    steps=4,
    tokens=512,
    codec="int8",
    loss=1.0,
    published_at=2.0,
    step_time_s=0.5,
    island_step=40,
)
FRAGMENT = dict(
    experiment="exp",
    fragment=0,
    version=2,
    parent_version=1,
    parent_dir="fragments/f000/v00000001-0123abcd",
    created_at=1.0,
    applied=["isl-a/00000001-f000"],
    sha256={"params": "a" * 64, "outer_state": "b" * 64},
    nbytes={"params": 10, "outer_state": 20},
    tokens_merged=5,
    merge_state=dict(
        steps=2,
        seen=2,
        norms=[["isl-a", 1.0], 0.5],
        cursors={"isl-a": 1},
        sync_s=0.1,
        version_times={"2": 1.0},
        last_claim={"isl-a": [1, 40, 2.0]},
    ),
)
BEAT = dict(
    island="isl-a",
    at=1.0,
    step=3,
    tokens=10,
    loss=None,
    time=2.0,
    base_version=1,
    goodput_state=dict(seconds={"productive": 1.0}, elapsed_s=2.0, wall=3.0, steps=3),
)
LATEST = dict(dir="checkpoints/isl-a/c0000000007-0123abcd", step=7, sha256="c" * 64, nbytes=1000)
META = dict(island="isl-a", step=7, base_version=[1, 2], seq=4, tokens=9, cursor={"epoch": 0})
CONFIG_OK = dict(name="exp", islands=[{"name": "isl-a"}])

READERS = {
    "pseudograd commit": (
        COMMIT,
        lambda d: merge_records.parse_pseudograd_commit(d, PG, "exp"),
        merge_records.BadPseudoGradManifest,
    ),
    "pseudograd manifest": (
        MANIFEST,
        lambda d: merge_records.parse_pseudograd_manifest(d, PG, "exp"),
        merge_records.BadPseudoGradManifest,
    ),
    "head": (
        {"version": 3, "dir": "fragments/f000/v00000003-0123abcd"},
        lambda d: merge_records.parse_head(d, 0),
        merge_records.BadHead,
    ),
    "fragment manifest": (
        FRAGMENT,
        lambda d: merge_records.parse_fragment_manifest(d, "exp", 0, 2),
        merge_records.BadFragmentManifest,
    ),
    "merge state": (
        FRAGMENT["merge_state"],
        lambda d: merge_records.parse_merge_state(
            safejson.load_json(d, safejson.FRAGMENT_MANIFEST, merge_records.BadFragmentManifest)
        ),
        merge_records.BadFragmentManifest,
    ),
    "ledger entry": (
        {"version": 4},
        merge_records.parse_ledger_entry,
        merge_records.BadLedgerEntry,
    ),
    "quarantine entry": (
        {"reason": "x", "at": 1.0},
        merge_records.parse_quarantine_entry,
        merge_records.BadQuarantineEntry,
    ),
    "config top level": (
        CONFIG_OK,
        lambda d: island_records.parse_config_record(d, "exp"),
        island_records.BadConfigRecord,
    ),
    "config": (
        CONFIG_OK,
        lambda d: island_records.parse_experiment_config(d, "exp"),
        island_records.BadConfigRecord,
    ),
    "checkpoint LATEST": (
        LATEST,
        lambda d: island_records.parse_checkpoint_pointer(d, "isl-a"),
        island_records.BadCheckpoint,
    ),
    "checkpoint meta": (
        META,
        lambda d: island_records.parse_checkpoint_meta(d, "isl-a", 7),
        island_records.BadCheckpoint,
    ),
    "heartbeat": (
        BEAT,
        lambda d: island_records.parse_heartbeat(d, "isl-a"),
        island_records.BadHeartbeat,
    ),
    "eval metric": (
        {"version": 1, "loss": 2.5, "tokens_merged": 3},
        lambda d: island_records.parse_metric(d, "eval"),
        island_records.BadMetric,
    ),
    "chaos metric": (
        {"event": "kill", "at": 1.0},
        lambda d: island_records.parse_metric(d, "chaos"),
        island_records.BadMetric,
    ),
    "done marker": (
        {"island": "isl-a", "at": 1.0, "step": 3},
        lambda d: island_records.parse_done(d, "isl-a"),
        island_records.BadDoneMarker,
    ),
    "syncer lease": (
        {"owner": "manual__2026-01-01T00:00:00+00:00", "expires_at": 1.0, "holder": "h/1"},
        syncer_records.parse_lease,
        syncer_records.BadLease,
    ),
    "run marker": (
        {"run_id": "run-1", "ended_at": 1.0, "islands": ["isl-a"]},
        lambda d: syncer_records.parse_run_marker(d, "run-1"),
        syncer_records.BadRunMarker,
    ),
    "bounded JSON": (
        {"a": [1, {"b": "c"}]},
        lambda d: safejson.load_json(d, safejson.MANIFEST),
        safejson.BadJSON,
    ),
}


def _only_its_error(reader: str, data: bytes) -> None:
    valid, parse, error = READERS[reader]
    try:
        parse(data)
    except error as exc:
        text = str(exc)
        assert "\n" not in text and 0 < len(text) <= 400, text
    # anything else (another error type, RecursionError, ...) fails the test


@pytest.mark.parametrize("reader", sorted(READERS))
def test_valid_records_parse(reader):
    valid, parse, _ = READERS[reader]
    parse(safejson.dump_json(valid))


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_reader_raises_only_its_own_error(reader):
    FAST(given(hostile_bytes(READERS[reader][0]))(lambda data: _only_its_error(reader, data)))()


@pytest.mark.slow
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_reader_raises_only_its_own_error_long_run(reader):
    SLOW(given(hostile_bytes(READERS[reader][0]))(lambda data: _only_its_error(reader, data)))()


# -- a merge state writes back the JSON it was parsed from ---------------------------------------

MERGE_FIELDS = ("steps", "seen", "cursors", "norms", "sync_s", "version_times", "last_claim")
ENTRY_KEYS = st.one_of(
    st.sampled_from(["isl-a", "isl-b", "7", "007", "Isl", ""]), st.text(max_size=9)
)
ENTRIES = st.one_of(
    JSON_VALUES,
    st.integers(-2, 3),
    st.floats(0, 1e9),
    st.lists(st.one_of(st.integers(0, 9), st.floats(0, 9)), min_size=3, max_size=3),
    st.tuples(st.sampled_from(["isl-a", "isl-b"]), st.floats(0, 9)).map(list),
)


@st.composite
def merge_state_fields(draw) -> dict:
    """FRAGMENT's merge_state with fields replaced, deleted or added, and entries added to its
    maps and list."""
    obj = json.loads(json.dumps(FRAGMENT["merge_state"]))
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from([*MERGE_FIELDS, "other"]))
        op = draw(st.sampled_from(["replace", "delete", "entry", "entry"]))
        if op == "replace":
            obj[key] = draw(st.one_of(JSON_VALUES, ENTRIES))
        elif op == "delete":
            obj.pop(key, None)
        elif isinstance(obj.get(key), dict):
            obj[key][draw(ENTRY_KEYS)] = draw(ENTRIES)
        elif isinstance(obj.get(key), list):
            obj[key].append(draw(ENTRIES))
    return obj


def _merge_state_property(obj: dict) -> None:
    try:
        state = merge_records.parse_merge_state(obj)
    except merge_records.BadFragmentManifest as exc:
        assert "\n" not in str(exc)
        return
    written = {k: obj.get(k, {}) for k in MERGE_FIELDS}  # absent optional maps: empty
    assert safejson.dump_json(state.to_json()) == safejson.dump_json(written)
    assert merge_records.parse_merge_state(state.to_json()) == state


def test_a_merge_state_writes_back_the_json_it_was_parsed_from():
    FAST(given(merge_state_fields())(_merge_state_property))()


@pytest.mark.slow
def test_a_merge_state_writes_back_the_json_it_was_parsed_from_long_run():
    SLOW(given(merge_state_fields())(_merge_state_property))()


# -- bounded JSON round-trips what the store writes ---------------------------------------------

WRITABLE = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20).filter(lambda t: all(not 0xD800 <= ord(c) <= 0xDFFF for c in t)),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


def _finite(node):
    if isinstance(node, float):
        return node if math.isfinite(node) else None
    if isinstance(node, dict):
        return {k: _finite(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_finite(v) for v in node]
    return node


def _roundtrip(obj):
    back = safejson.load_json(safejson.dump_json({"v": obj}), safejson.JSONLimits(2**20, 16))
    assert back == {"v": _finite(obj)}


def test_what_dump_json_writes_load_json_reads_back():
    FAST(given(WRITABLE)(_roundtrip))()


@pytest.mark.slow
def test_what_dump_json_writes_load_json_reads_back_long_run():
    SLOW(given(WRITABLE)(_roundtrip))()


# -- names ---------------------------------------------------------------------------------------

VALID_KEYS = [
    "config.json",
    "fragments/f000/HEAD.json",
    "fragments/f003/v00000012-0123abcd/manifest.json",
    "snapshots/BEST.json",
    "snapshots/00000000000000000001-0123abcd.json",
    f"pseudograds/{PG}.json",
    PAYLOAD,
    f"ledger/{PG}.json",
    f"quarantine/{PG}.json",
    "heartbeats/isl-a.json",
    "done/isl-a.json",
    "checkpoints/isl-a/LATEST.json",
    "checkpoints/isl-a/c0000000007-0123abcd/meta.json",
    "metrics/eval/00000000000000000001-0123abcd.json",
    "control/STOP",
    "control/stop/isl-a",
    "control/syncer/shard-3.json",
    "control/runs/manual__2026-01-01T00_00_00_00_00-33e279c4.json",
]


@st.composite
def mutated_key(draw) -> str:
    key = draw(st.sampled_from(VALID_KEYS))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(key)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        c = draw(st.sampled_from(["0", "9", "\u0661", "\uff11", "/", "-", "f", "A", ".", "é"]))
        if op == "insert":
            key = key[:i] + c + key[i:]
        elif op == "delete":
            key = key[:i] + key[i + 1 :]
        else:
            key = key[:i] + c + key[i + 1 :]
    return key


def _name_property(key) -> None:
    try:
        name = keys.parse_key(key)
    except keys.BadName as exc:
        assert "\n" not in str(exc)
        return
    assert name.kind in keys.KINDS
    assert key.isascii()  # every accepted name is plain ASCII
    if name.id is not None:  # the listing's id is an id the id parser accepts, and vice versa
        assert keys.pseudograd_id(*keys.parse_pseudograd_id(name.id)) == name.id
        assert name.id in key


def _id_property(text) -> None:
    try:
        island, seq, fragment = keys.parse_pseudograd_id(text)
    except keys.BadName:
        return
    assert keys.pseudograd_id(island, seq, fragment) == text
    assert keys.parse_key(f"pseudograds/{text}.json").id == text


NAMES = st.one_of(mutated_key(), st.text(max_size=60), st.integers(), st.none())


def test_names_parse_to_one_layout_or_raise_bad_name():
    FAST(given(NAMES)(_name_property))()
    FAST(
        given(st.one_of(st.text(max_size=30), mutated_key().map(lambda k: k[12:])))(_id_property)
    )()


@pytest.mark.slow
def test_names_parse_to_one_layout_or_raise_bad_name_long_run():
    SLOW(given(NAMES)(_name_property))()


# -- safetensors -------------------------------------------------------------------------------

SMALL_TENSORS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int8)}
VALID_ST = encode_tensors(SMALL_TENSORS)
HEADER_LEN = struct.unpack("<Q", VALID_ST[:8])[0]
VALID_HEADER = json.loads(VALID_ST[8 : 8 + HEADER_LEN])


@st.composite
def hostile_safetensors(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "flip", "truncate", "header", "deep", "length"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "flip":
        i = draw(st.integers(0, len(VALID_ST) - 1))
        return VALID_ST[:i] + bytes([VALID_ST[i] ^ draw(st.integers(1, 255))]) + VALID_ST[i + 1 :]
    if kind == "truncate":
        return VALID_ST[: draw(st.integers(0, len(VALID_ST) - 1))]
    if kind == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + VALID_ST[8:]
    if kind == "deep":
        n = draw(st.integers(1, 5000))
        header = b'{"w":' + b"[" * n + b"]" * n + b"}"
    else:
        header = draw(mutated(VALID_HEADER))
    return struct.pack("<Q", len(header)) + header + VALID_ST[8 + HEADER_LEN :]


def _tensors_property(data: bytes) -> None:
    try:
        tensors, _ = decode_tensors(data)
    except BadTensors as exc:
        assert "\n" not in str(exc)
        return
    assert all(isinstance(v, np.ndarray) for v in tensors.values())


def test_decode_tensors_raises_only_bad_tensors():
    FAST(given(hostile_safetensors())(_tensors_property))()


@pytest.mark.slow
def test_decode_tensors_raises_only_bad_tensors_long_run():
    SLOW(given(hostile_safetensors())(_tensors_property))()


# -- codecs: decoded payload tensors of any shape and dtype are a ValueError or tensors ------------

ARRAYS = st.builds(
    lambda shape, dtype, fill: np.full(shape, fill, dtype=dtype),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.sampled_from([np.float32, np.int8, np.uint8, np.int32, np.float16, np.uint16]),
    st.integers(0, 9),
)
PAYLOADS = st.dictionaries(
    st.sampled_from(["w", "w.__scale", "w.__shape", "v", "v.__scale", "x.__y"]), ARRAYS, max_size=4
)


def _codec_property(payload, codec) -> None:
    try:
        out = codecs.decode(payload, codec)
    except ValueError:
        return
    assert all(v.dtype == np.float32 for v in out.values())


def test_codec_decode_raises_only_value_error():
    FAST(given(PAYLOADS, st.sampled_from(codecs.CODECS))(_codec_property))()


# -- the payload size limit holds every honest payload ------------------------------------------

SHAPES = st.dictionaries(
    st.text("abcdefgh/_0123456789", min_size=1, max_size=30),
    st.lists(st.integers(0, 40), max_size=3).map(tuple),
    min_size=1,
    max_size=5,
)


def _limit_property(shapes, codec) -> None:
    delta = {n: np.ones(s, np.float32) for n, s in shapes.items()}
    payload, _ = codecs.encode(delta, codec)
    data = encode_tensors(payload)
    max_nbytes, max_header = codecs.payload_limits(shapes, codec)
    assert len(data) <= max_nbytes
    assert 8 + struct.unpack("<Q", data[:8])[0] <= max_header
    decode_tensors(data, max_header_bytes=max_header)  # the header limit admits it
    assert sha256(data)


def test_payload_limits_admit_every_honest_payload():
    FAST(given(SHAPES, st.sampled_from(codecs.CODECS))(_limit_property))()


# -- the norm median --------------------------------------------------------------------------


def test_norm_median_gives_each_island_one_vote():
    history = [["a", 1e-9]] * 50 + [["b", 2.0], ["b", 4.0], ["c", 3.0]]
    assert norm_median(history) == 3.0  # median of {1e-9, 3, 3}
    assert norm_median([1.0, 2.0, 30.0]) == 2.0  # bare numbers (older states): a vote each
    assert norm_median([]) == 0.0
