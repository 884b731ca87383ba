"""Hostile and corrupt pseudo-gradients: rejected, quarantined with their reason, counted, while
the merge goes on with the good ones (docs/STORE.md "Validation on reads", training/merge/merger.py).

Every case commits one bad pseudo-gradient from island "a" next to a good one from island "b",
runs one merge, and checks: only the good one is applied, the bad one is quarantined with the
expected reason (in the store and in the MergeResult), and a second merge does not look at it
again. tests/test_merge.py covers a missing tensor, a wrong shape, a payload rewritten after commit,
a lower replayed sequence number and staleness; these are the rest.
"""

from __future__ import annotations

import pickle
import uuid

import numpy as np
import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from tests.reference_outer import global_norm
from training.merge.merger import Merger
from training.store.experiment import dump_json
from training.store.tensors import encode_tensors, sha256

KERNEL = "blocks/0/mlp_up/kernel"
GOOD = "b/00000000-f000"
BAD = "a/00000000-f000"


def _cfg(**outer):
    return small_config(outer={"method": "nesterov", **outer})


def _manifest(store, island, seq, payload_key, data, /, **fields):
    base = dict(base_version=0, steps=4, tokens=512, loss=1.0, codec="fp32", step_time_s=1.0)
    return {
        **base,
        "published_at": float(seq),
        "experiment": store.experiment,
        "island": island,
        "seq": seq,
        "fragment": 0,
        "payload": payload_key,
        "nbytes": len(data),
        "sha256": sha256(data),
        "created_at": 0.0,
        **fields,
    }


def _commit_raw(store, island, seq, data: bytes, /, **fields):
    """Commit arbitrary payload bytes the way publish_pseudograd would (valid size and sha256),
    with manifest `fields` overriding the defaults: what a buggy or hostile island can write."""
    stem = f"pseudograds/{island}/{seq:08d}-f000"
    key = fields.pop("payload", f"{stem}-{uuid.uuid4().hex[:8]}.safetensors")
    if isinstance(key, str) and key.startswith("pseudograds/"):  # never clobber config.json
        store.store.write(store.object_key(key), data)
    assert store.store.create(
        store.object_key(f"{stem}.json"),
        dump_json(_manifest(store, island, seq, key, data, **fields)),
    )
    return f"{island}/{seq:08d}-f000"


def _rewrite_payload(store, pg_id, transform):
    """Replace the committed payload of `pg_id` with transform(bytes) (manifest unchanged)."""
    ref = next(r for r in store.list_pseudograds() if r.id == pg_id)
    key = store.object_key(ref.payload_key)
    store.store.write(key, transform(store.store.read(key)))


def _merge_with_good_one(cfg, store, theta):
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    return Merger(cfg, store).merge_once()


def _assert_quarantined_and_merge_went_on(cfg, store, r, pg_id, reason):
    """Only the good one applied; the bad one quarantined with `reason`, in the store and in the
    result (counted once); a later merge neither re-reads nor re-counts it."""
    recorded = store.quarantined()
    assert r.version == 1 and r.applied == [GOOD]
    assert reason in recorded[pg_id], recorded[pg_id]
    assert r.quarantined == {pg_id: recorded[pg_id]} and list(recorded) == [pg_id]
    assert store.applied() == {GOOD: 1}
    assert store.read_metrics("merge")[-1]["quarantined"] == 1
    again = Merger(cfg, store).merge_once()
    assert again.version is None and again.quarantined == {}


# -- payload contents: tree, dtype, values -----------------------------------------------------


def _with(theta, seed=7, **changes):
    delta = random_delta(theta, seed)
    delta.update(changes)
    return delta


def _nonfinite(value):
    def make(theta):
        delta = random_delta(theta, 7)
        delta[KERNEL][1, 2] = value
        return delta

    return make


PAYLOADS = {
    "extra tensor": (
        lambda t: _with(t, **{"blocks/99/evil": np.zeros(3, np.float32)}),
        "wrong tree for fragment 0: extra ['blocks/99/evil'], missing []",
    ),
    "renamed tensor": (
        lambda t: {("x" + k if k == KERNEL else k): v for k, v in random_delta(t, 7).items()},
        f"missing ['{KERNEL}']",
    ),
    "float16 under fp32": (
        lambda t: _with(t, **{KERNEL: random_delta(t, 7)[KERNEL].astype(np.float16)}),
        f"payload tensor '{KERNEL}' has dtype float16",
    ),
    "float64 under fp32": (  # twice the bytes: refused by size before it is read
        lambda t: _with(t, **{KERNEL: random_delta(t, 7)[KERNEL].astype(np.float64)}),
        "-byte limit of fragment 0 in fp32",
    ),
    "int32 under fp32": (
        lambda t: _with(t, **{KERNEL: np.zeros(t[KERNEL].shape, np.int32)}),
        "has dtype int32",
    ),
    "transposed": (
        lambda t: _with(t, **{KERNEL: np.ascontiguousarray(random_delta(t, 7)[KERNEL].T)}),
        f"wrong shape for {KERNEL}",
    ),
    "nan": (_nonfinite(np.nan), f"non-finite values in {KERNEL}"),
    "inf": (_nonfinite(np.inf), f"non-finite values in {KERNEL}"),
    "-inf": (_nonfinite(-np.inf), f"non-finite values in {KERNEL}"),
}


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_bad_payload_contents_are_quarantined(kind):
    """Validly committed (size and sha256 match) but the tensors are wrong."""
    make, reason = PAYLOADS[kind]
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    _commit_raw(store, "a", 0, encode_tensors(make(theta)))
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, BAD, reason)


# -- payload bytes: checksum, truncation, pickle ------------------------------------------------


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x40])


BYTES = {
    "altered after commit": (_flip_last_byte, "fails its crc32c checksum"),
    "truncated after commit": (lambda d: d[: len(d) // 2], "bytes, not"),
    "emptied after commit": (lambda d: b"", "has 0 bytes, not"),
}


@pytest.mark.parametrize("kind", sorted(BYTES))
def test_payload_changed_after_commit_is_quarantined(kind):
    transform, reason = BYTES[kind]
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 7))
    _rewrite_payload(store, BAD, transform)
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, BAD, reason)


def test_truncated_payload_committed_with_matching_checksum_is_quarantined():
    """The island itself wrote a short file (and hashed it): the strict reader catches it."""
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    data = encode_tensors(random_delta(theta, 7))
    _commit_raw(store, "a", 0, data[: len(data) - 100])
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, BAD, "(truncated?)")


def test_payload_deleted_after_commit_is_quarantined():
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    ref = publish_delta(store, cfg, "a", 0, random_delta(theta, 7))
    store.store.delete(store.object_key(ref.payload_key))
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, BAD, "is missing")


class _Boom:
    """Unpickling this creates `path`: the proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_is_quarantined_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    data = pickle.dumps({"blocks/0/mlp_up/kernel": _Boom(str(marker))})
    pickle.loads(pickle.dumps(_Boom(str(tmp_path / "canary"))))  # the bomb does work
    assert (tmp_path / "canary").exists()
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    _commit_raw(store, "a", 0, data)  # size and sha256 match: the bytes reach the decoder
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, BAD, "not safetensors")
    assert not marker.exists()


# -- manifests -----------------------------------------------------------------------------------

MANIFESTS = {
    "payload of another island": (
        dict(payload="pseudograds/b/00000000-f000-0123abcd.safetensors"),
        "payload key 'pseudograds/b/00000000-f000-0123abcd.safetensors' is not inside",
    ),
    "payload outside the experiment": (
        dict(payload="../other/pseudograds/a/00000000-f000-0123abcd.safetensors"),
        "is not inside pseudograds/a/",
    ),
    "payload is the config": (dict(payload="config.json"), "'config.json' is not inside"),
    "payload key not a string": (dict(payload=["x"]), "payload key ['x'] is not inside"),
    "another experiment": (dict(experiment="other"), "manifest names experiment 'other'"),
    "island differs from its name": (dict(island="b"), "island/fragment do not match"),
    "seq differs from its name": (dict(seq=3), "does not describe this pseudo-gradient"),
    "base version from the future": (dict(base_version=5), "base_version 5 is not a committed"),
    "base version not an int": (dict(base_version="0"), "base_version '0' is not a committed"),
    "base version a bool": (dict(base_version=False), "base_version False is not a committed"),
    "negative tokens": (dict(tokens=-512), "bad steps/tokens"),
    "fractional steps": (dict(steps=0.5), "bad steps/tokens"),
    "unknown codec": (dict(codec="pickle"), "unknown codec 'pickle'"),
    "codec mismatch": (dict(codec="int8"), "unreadable payload"),
    "published_at not a number": (dict(published_at="soon"), "bad published_at"),
    "step_time_s not a number": (dict(step_time_s=[1]), "bad step_time_s"),
    "published_at nan": (dict(published_at=float("nan")), "bad published_at"),
}


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_bad_manifests_are_quarantined(kind):
    fields, reason = MANIFESTS[kind]
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    pg_id = _commit_raw(store, "a", 0, encode_tensors(random_delta(theta, 7)), **fields)
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, pg_id, reason)


def test_marker_that_is_not_json_is_quarantined_not_ignored():
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    store.store.create(store.object_key("pseudograds/a/00000000-f000.json"), b"\x80garbage")
    r = _merge_with_good_one(cfg, store, theta)
    _assert_quarantined_and_merge_went_on(cfg, store, r, BAD, "unreadable manifest: not valid JSON")


def test_commit_replayed_under_a_new_sequence_number_is_quarantined():
    """An old commit's manifest and payload copied to a fresh seq: its manifest names the old seq."""
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    old = publish_delta(store, cfg, "a", 0, random_delta(theta, 7))
    assert Merger(cfg, store).merge_once().applied == [old.id]
    store.store.create(
        store.object_key("pseudograds/a/00000001-f000.json"),
        store.store.read(store.object_key("pseudograds/a/00000000-f000.json")),
    )
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1), base_version=1)
    r = Merger(cfg, store).merge_once()
    assert r.applied == [GOOD]
    reason = store.quarantined()["a/00000001-f000"]
    assert "manifest does not describe this pseudo-gradient" in reason
    assert r.quarantined == {"a/00000001-f000": reason}


def test_replay_of_a_merged_sequence_number_with_a_lost_ledger_entry_is_not_applied():
    """Defence in depth: if the ledger entry of an older version is lost, the per-island cursors
    in the fragment's merge state still stop the contribution from being applied twice."""
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 4, random_delta(theta, 0))
    assert Merger(cfg, store).merge_once().version == 1
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1), base_version=1)
    assert Merger(cfg, store).merge_once().version == 2
    store.store.delete(store.object_key("ledger/a/00000004-f000.json"))  # HEAD (2) repairs only b
    r = Merger(cfg, store).merge_once()
    assert r.version is None and r.applied == [] and r.quarantined == {}
    assert [v["applied"] for v in store.list_fragment_versions(0)] == [
        [],
        ["a/00000004-f000"],
        [GOOD],
    ]


# -- norms -----------------------------------------------------------------------------------


def _history(cfg, store, theta, n=4):
    """n merged contributions of norm ~1 from island c (seeds the running median)."""
    for seq in range(n):
        d = random_delta(theta, 100 + seq)
        scale = 1.0 / global_norm(d)
        publish_delta(store, cfg, "c", seq, {k: v * scale for k, v in d.items()}, base_version=seq)
        assert Merger(cfg, store).merge_once().version == seq + 1


def test_enormous_norm_is_clipped_to_k_times_the_running_median():
    # outer SGD, lr 1, no momentum: the change of the parameters is exactly the applied update
    cfg = small_config(
        islands=("a", "b", "c"),
        outer={"method": "nesterov", "lr": 1.0, "momentum": 0.0, "rda": False},
    )
    store = new_store(cfg)
    theta = store.load_params()
    _history(cfg, store, theta)
    before = store.load_fragment(store.head(0))
    huge = {
        k: v * (50.0 / global_norm(random_delta(theta, 7)))
        for k, v in random_delta(theta, 7).items()
    }
    publish_delta(store, cfg, "a", 0, huge, base_version=4)
    r = Merger(cfg, store).merge_once()
    assert r.applied == ["a/00000000-f000"] and not r.quarantined
    after = store.load_fragment(store.head(0))
    step = global_norm({k: before.params[k] - after.params[k] for k in theta})
    limit = cfg.outer.clip_multiplier * 1.0  # k x median of four norms of 1
    assert step == pytest.approx(limit, rel=1e-4)
    assert after.manifest["contributions"][0]["norm"] == pytest.approx(50.0, rel=1e-5)


def test_absurd_norm_is_quarantined():
    cfg = small_config(islands=("a", "b", "c"), outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    _history(cfg, store, theta)
    d = random_delta(theta, 7)
    absurd = {k: v * (1e5 / global_norm(d)) for k, v in d.items()}  # 20000x the 5x limit
    publish_delta(store, cfg, "a", 0, absurd, base_version=4)
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1), base_version=4)
    r = Merger(cfg, store).merge_once()
    assert r.applied == [GOOD]
    reason = store.quarantined()[BAD]
    assert reason.startswith("norm 1e+05 is over 1000x the clip limit 5")
    assert r.quarantined == {BAD: reason}


def test_absurd_first_contribution_is_quarantined_against_the_global_parameters():
    """Before a running median exists (fewer than 4 merged norms) the bound is 1000 x k x the
    norm of the global parameters."""
    cfg = small_config(islands=("a", "b", "c"), outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    bound = cfg.outer.clip_multiplier * global_norm(theta)
    d = random_delta(theta, 7)
    publish_delta(
        store, cfg, "a", 0, {k: v * (2000 * bound / global_norm(d)) for k, v in d.items()}
    )
    publish_delta(store, cfg, "b", 0, {k: v * (500 * bound / global_norm(d)) for k, v in d.items()})
    r = Merger(cfg, store).merge_once()
    reason = store.quarantined()[BAD]
    assert "is over 1000x the bound" in reason and "no running median yet" in reason
    assert r.applied == [GOOD] and r.quarantined == {BAD: reason}


# -- races ----------------------------------------------------------------------------------


def test_a_merger_behind_head_does_not_quarantine_a_contribution_based_on_a_newer_version():
    """Merger A read HEAD v0; B then published v1 and an island published X based on v1. From
    A's view X's base is "not a committed version": A must leave X for the next round, not
    quarantine it for good."""
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    stale = store.head(0)
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    assert Merger(cfg, store).merge_once().version == 1  # merger B
    x = publish_delta(store, cfg, "a", 0, random_delta(theta, 7), base_version=1)
    publish_delta(store, cfg, "b", 1, random_delta(theta, 2), base_version=1)
    real_head = store.head
    calls = iter([stale])
    store.head = lambda p: next(calls, None) or real_head(p)  # A's first read is the old HEAD
    r = Merger(cfg, store).merge_once()
    store.head = real_head
    assert r.version is None and r.quarantined == {} and store.quarantined() == {}
    r = Merger(cfg, store).merge_once()
    assert sorted(r.applied) == [x.id, "b/00000001-f000"] and r.version == 2


def test_hostile_base_version_is_quarantined_when_head_did_not_move():
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    x = publish_delta(store, cfg, "a", 0, random_delta(theta, 7), base_version=1)
    r = Merger(cfg, store).merge_once()
    assert r.quarantined == {x.id: "base_version 1 is not a committed version (head 0)"}


# -- counting ---------------------------------------------------------------------------------


def test_many_hostile_commits_in_one_merge_are_each_counted_once(tmp_path):
    cfg = _cfg()
    store = new_store(cfg)
    theta = store.load_params()
    seq = 0
    bad = {}
    for make, reason in PAYLOADS.values():
        bad[_commit_raw(store, "a", seq, encode_tensors(make(theta)))] = reason
        seq += 1
    for fields, reason in MANIFESTS.values():
        data = encode_tensors(random_delta(theta, seq))
        bad[_commit_raw(store, "a", seq, data, **fields)] = reason
        seq += 1
    bad[_commit_raw(store, "a", seq, pickle.dumps(_Boom(str(tmp_path / "boom"))))] = "safetensors"
    r = _merge_with_good_one(cfg, store, theta)
    assert r.applied == [GOOD]
    recorded = store.quarantined()
    assert sorted(recorded) == sorted(bad) == sorted(r.quarantined)
    for pg_id, reason in bad.items():
        assert reason in recorded[pg_id], (pg_id, recorded[pg_id])
    assert store.read_metrics("merge")[-1]["quarantined"] == len(bad)
    assert not (tmp_path / "boom").exists()
