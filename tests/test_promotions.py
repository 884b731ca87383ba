"""Promoted light versions (training/store/promotions.py): before its memory goes (SIGTERM, idle
and deferring, the end of `diloco merge`) a merger writes its light HEAD's full state beside
it, full.json last; a cold start begins there instead of replaying since the full ancestor,
with the bits of a merger that stayed warm; a promotion that cannot be trusted is passed over;
`diloco replay` checks a promotion against the replay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import new_store, publish_delta, random_delta
from tests.test_light_versions import _cfg, _params_bits, _round, _run, killed_merge
from training.config.sections import SyncerConfig
from training.merge import replay
from training.merge.merger import Merger
from training.merge.syncer import ShardSyncer
from training.protocol import broadcast
from training.store import merge_records as records
from training.store.keys import PROMOTION, promoted_payload


def _files(store, version: int) -> list[str]:
    head = store.find_version(0, version)
    return sorted(k.rsplit("/", 1)[1] for k in store.list_keys(f"{head.dir}/"))


def _cold_merge(store, cfg) -> int:
    """Round 6 merged by a new merger (nothing warm): how many light versions it replayed."""
    ticks = []
    fresh = Merger(cfg, store)
    store.hit_fault = ticks.append
    _round(store, cfg, fresh, 6)
    return ticks.count("merge.cold-replay")


def test_promote_heads_writes_the_light_heads_state_beside_it_with_full_json_last():
    # k = 4, HEAD 6 light (update broadcast, no params): the promotion holds params, outer
    # state and shadow; at the fault point before the marker the three payloads are there
    # and full.json is not
    cfg, store, merger = _run(4, 6, "prom")
    seen = []
    store.hit_fault = lambda point: seen.append((point, _files(store, 6)))
    assert merger.promote_heads() == [0]
    payloads = [promoted_payload(n) for n in ("outer_state", "params", "shadow")]
    assert seen == [
        ("light.before-promotion", sorted(["manifest.json", "update.safetensors"] + payloads))
    ]
    assert PROMOTION in _files(store, 6)
    got = store.promotion(store.head(0), store.fragment_manifest(store.head(0)))
    assert sorted(got.sums) == ["outer_state", "params", "shadow"]


def test_a_cold_merger_starts_at_the_promoted_head_and_merges_the_bits_of_a_warm_one():
    # the same inputs: run A's merger stays warm; run B's HEAD 6 is promoted and a new merger
    # merges round 6 without replaying (0 replayed versions against 2 unpromoted)
    cfg_a, warm, merger_a = _run(4, 6, "warm")
    cfg_b, cold, merger_b = _run(4, 6, "cold")
    assert merger_b.promote_heads() == [0]
    _round(warm, cfg_a, merger_a, 6)
    assert _cold_merge(cold, cfg_b) == 0
    assert _params_bits(warm, cfg_a) == _params_bits(cold, cfg_b)
    got = [s.load_payload(s.head(0), "update") for s in (warm, cold)]
    assert {n: v.tobytes() for n, v in got[0].items()} == {
        n: v.tobytes() for n, v in got[1].items()
    }


def test_an_unpromoted_head_is_replayed_from_its_full_ancestor():
    cfg, store, _ = _run(4, 6, "plain")
    assert _cold_merge(store, cfg) == 2  # versions 5 and 6


def test_a_full_head_an_already_promoted_one_and_a_moved_head_are_not_promoted():
    cfg, store, merger = _run(4, 4, "full")
    assert merger.promote_heads() == []  # HEAD 4 is full
    _round(store, cfg, merger, 4)
    assert merger.promote_heads() == [0]
    assert merger.promote_heads() == []  # full.json exists: nothing written again
    other = Merger(cfg, store)
    _round(store, cfg, other, 5)  # another merger made HEAD 6: this one's warm 5 is stale
    assert merger.promote_heads() == []
    assert PROMOTION not in _files(store, 6)


@pytest.mark.parametrize("broken", ["payload", "marker"])
def test_a_promotion_that_fails_its_checks_is_passed_over_and_the_cold_start_replays(broken):
    # a flipped byte in the promoted outer state (its crc32c fails), or a marker whose params
    # checksum is not the version's: the cold start replays 5 and 6 and merges the right bits
    cfg_a, warm, merger_a = _run(4, 6, "warm")
    cfg_b, cold, merger_b = _run(4, 6, "bad")
    merger_b.promote_heads()
    head = cold.head(0)
    if broken == "payload":
        key = cold.object_key(f"{head.dir}/{promoted_payload('outer_state')}")
        data = bytearray(cold.store.read(key))
        data[-1] ^= 1
        cold.store.write(key, bytes(data))
    else:
        key = cold.object_key(f"{head.dir}/{PROMOTION}")
        record = json.loads(cold.store.read(key))
        record["crc32c"]["params"] = "00000000"
        cold.store.write(key, json.dumps(record).encode())
    _round(warm, cfg_a, merger_a, 6)
    assert _cold_merge(cold, cfg_b) == 2
    assert _params_bits(warm, cfg_a) == _params_bits(cold, cfg_b)


def test_the_promotion_parser_refuses_a_marker_for_another_version_or_a_full_one():
    cfg, store, merger = _run(4, 6, "parse")
    merger.promote_heads()
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    record = json.loads(store.store.read(store.object_key(f"{head.dir}/{PROMOTION}")))
    five = store.find_version(0, 5)
    with pytest.raises(records.BadPromotion, match="names"):
        records.parse_promotion(record, "parse", 0, 5, five.dir, manifest)
    full = store.fragment_manifest(store.find_version(0, 4))
    with pytest.raises(records.BadPromotion, match="promotes a full version"):
        records.parse_promotion(record, "parse", 0, 6, head.dir, full)
    with pytest.raises(records.BadPromotion, match="lists payloads"):
        records.parse_promotion(
            {
                **record,
                "crc32c": {"params": record["crc32c"]["params"]},
                "nbytes": {"params": record["nbytes"]["params"]},
            },
            "parse",
            0,
            6,
            head.dir,
            manifest,
        )


def test_diloco_replay_checks_a_promotion_against_the_replay():
    # a promotion whose outer state was written from other (checksummed) arrays: the replay's
    # verdict on that version names it
    cfg, store, merger = _run(4, 6, "audit")
    params, outer, shadow = merger._warm[0][1:4]
    outer = {n: v + 1.0 for n, v in outer.items()}
    store.promote_version(
        store.head(0), store.fragment_manifest(store.head(0)), params, outer, shadow
    )
    lines = []
    assert replay.run(cfg, store, 0, None, 1, True, lines.append) == 1
    assert lines[5].startswith("fragment 0 version 6 (2 applied): DIFFERS: promoted outer_state/")


def test_gc_deletes_a_collected_versions_promotion():
    # version 5 promoted, then versions up to 9 (full 8): keep_last 1 keeps 0, 8, 9; version
    # 5's payloads go, its full.json first (a marker never outlives its payloads)
    cfg, store, merger = _run(4, 5, "gc")
    merger.promote_heads()
    for r in range(5, 9):
        _round(store, cfg, merger, r)
    store.collect_garbage(store.plan_gc(keep_last=1))
    assert _files(store, 5) == ["collected.json", "manifest.json"]


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_a_syncer_promotes_before_it_returns_idle_and_when_asked_to_stop():
    cfg, store, merger = _run(4, 6, "syn")
    clock = _Clock()
    syncer = ShardSyncer(
        store, 0, "run-1", clock=clock, sleep=clock.sleep, merger_for=lambda c, f: merger
    )
    assert syncer.drain().reason == "idle"
    assert PROMOTION in _files(store, 6)
    _round(store, cfg, merger, 6)
    syncer.request_stop()  # what on_kill does on SIGTERM
    assert syncer.drain().reason == "terminated"
    assert PROMOTION in _files(store, 7)
    assert syncer.lease.read()[0].expires_at == 0.0  # released: another syncer takes it at once


def test_diloco_merge_promotes_its_light_head_on_sigterm(tmp_path):
    # `diloco merge --follow` merges version 1 (light, k = 4), then gets SIGTERM while it
    # waits: it promotes version 1 and exits 0
    cfg = _cfg(4, "term")
    url = f"file://{tmp_path}/store"
    store = new_store(cfg, url)
    theta = store.load_params()
    for i, island in enumerate(("a", "b")):
        publish_delta(store, cfg, island, 0, random_delta(theta, i), base_version=0)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "training.cli", "merge", "--store", url, "--experiment", "term"]
    proc = subprocess.Popen(
        [*cmd, "--follow", "--poll", "30"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline() == b"version 1: applied 2\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out == b"promoted the light HEADs of fragments [0]\n"
    assert PROMOTION in _files(store, 1)


def test_the_shard_operators_on_kill_asks_its_drain_to_stop():
    # Airflow calls on_kill from its SIGTERM handler: it only sets the drain's flag
    from diloco_airflow.syncer import SyncerShardOperator

    op = SyncerShardOperator(task_id="shard", store_url="memory://x", experiment="e", shard=0)
    op.on_kill()  # before a drain started: nothing to stop

    class _Drain:
        stop_requested = False

        def request_stop(self):
            self.stop_requested = True

    op._syncer = _Drain()
    op.on_kill()
    assert op._syncer.stop_requested


# -- full versions written in the background (syncer.full_in_background, the default) ---------
def test_in_the_background_a_due_version_is_light_then_promoted_and_later_ones_name_it():
    # k = 4: version 4 is published light (its update only) and promoted before version 5's
    # merge reads its arrays; versions 5 and 6 name 4 as their full ancestor
    cfg, store, _ = _run(4, 6, "bg", background=True)
    assert SyncerConfig.model_fields["full_in_background"].default is True
    four = store.find_version(0, 4)
    assert _files(store, 4) == sorted(
        ["manifest.json", "update.safetensors", PROMOTION]
        + [promoted_payload(n) for n in ("outer_state", "params", "shadow")]
    )
    for v in (5, 6):
        m = store.fragment_manifest(store.find_version(0, v))
        assert records.light_ancestor(m) == (4, four.dir)


def test_a_cold_start_from_a_background_full_version_merges_the_bits_of_the_merge_written_one():
    # the same inputs, k = 4: full versions written by the merge (A) or in the background (B);
    # a new merger on each at HEAD 6 replays 5 and 6 and merges round 6 to the same bits
    cfg_a, sync, _ = _run(4, 6, "sync")
    cfg_b, bg, _ = _run(4, 6, "bg", background=True)
    assert _cold_merge(sync, cfg_a) == 2
    assert _cold_merge(bg, cfg_b) == 2
    assert _params_bits(sync, cfg_a) == _params_bits(bg, cfg_b)
    lines = []
    assert replay.run(cfg_b, bg, 0, None, 1, False, lines.append) == 0, lines


def test_an_islands_shadow_read_whole_from_a_background_full_version_is_the_mergers():
    cfg, store, merger = _run(4, 6, "isl", background=True)
    head = store.head(0)
    shapes = {n: v.shape for n, v in merger._warm[0][1].items()}
    got = broadcast.read_full(store, head, store.fragment_manifest(head), shapes)
    assert (got.how, got.updates) == ("full", 2)  # 4's promoted shadow, the updates of 5, 6
    want = merger._warm[0][3]
    assert {n: v.tobytes() for n, v in got.tensors.items()} == {
        n: v.tobytes() for n, v in want.items()
    }


def test_gc_keeps_from_the_background_full_version_on():
    # HEAD 7 names 4 (promoted): keep_last 1 keeps 0 and 4-7, and a cold merger still merges
    cfg, store, _ = _run(4, 7, "gc", background=True)
    plan = store.plan_gc(keep_last=1)
    assert plan.protected == {0: [0, 4, 5, 6, 7]}
    store.collect_garbage(plan)
    assert PROMOTION in _files(store, 4)
    _round(store, cfg, Merger(cfg, store), 7)
    assert store.head(0).version == 8


def test_a_failed_background_write_leaves_the_older_ancestor_and_a_later_one_may_name_it():
    # version 4's background write fails: 5 and 6 name version 0. Then version 4 is promoted
    # after all (as a rerun would): version 7 names 4 while 5 and 6 still name 0, and a cold
    # start at 7 replays 5, 6, 7 from 4's promotion to the bits of a run without the failure
    cfg, store, merger = _run(4, 3, "fail", background=True)
    cfg_ref, ref, merger_ref = _run(4, 8, "ref", background=True)
    real = store.promote_version

    def broken(*a, **kw):
        raise OSError("disk full")

    store.promote_version = broken
    _round(store, cfg, merger, 3)  # version 4
    merger._promotions.wait_all()  # the write failed (logged)
    store.promote_version = real
    for r in (4, 5):
        _round(store, cfg, merger, r)
    zero = store.find_version(0, 0)
    assert all(
        records.light_ancestor(store.fragment_manifest(store.find_version(0, v))) == (0, zero.dir)
        for v in (4, 5, 6)
    )
    four = store.find_version(0, 4)
    manifest = store.fragment_manifest(four)
    state = replay.state_at(cfg, store, merger.shapes[0], four, manifest)
    assert store.promote_version(four, manifest, state.params, state.outer, state.shadow)
    merger._promotions.promoted[0] = (4, four.dir)
    _round(store, cfg, merger, 6)  # version 7
    assert records.light_ancestor(store.fragment_manifest(store.head(0))) == (4, four.dir)
    assert _cold_merge_at(store, cfg, 7) == 3  # version 8, after replaying 5, 6, 7
    assert _params_bits(store, cfg) == _params_bits(ref, cfg_ref)


def _cold_merge_at(store, cfg, r: int) -> int:
    ticks = []
    fresh = Merger(cfg, store)
    store.hit_fault = ticks.append
    _round(store, cfg, fresh, r)
    return ticks.count("merge.cold-replay")


def test_a_merge_killed_before_its_promotions_marker_leaves_a_light_version_replayed_from_0(
    tmp_path,
):
    # HEAD 3 (k = 4, background); `diloco merge` merges round 3 into version 4 (due: light,
    # promoted in the background) and is SIGKILLed between the promoted payloads and full.json.
    # Version 4 stays a plain light version: the next merge starts cold from version 0 (4
    # replayed), names 0, applies each contribution once, and `diloco replay` is bit-exact
    cfg, store, _ = killed_merge(tmp_path, "light.before-promotion@1", background=True)
    assert store.head(0).version == 4
    assert PROMOTION not in _files(store, 4)
    assert promoted_payload("outer_state") in _files(store, 4)  # orphaned payloads, unread
    assert _cold_merge_at(store, cfg, 4) == 4  # versions 1-4 replayed from version 0
    zero = store.find_version(0, 0)
    assert records.light_ancestor(store.fragment_manifest(store.head(0))) == (0, zero.dir)
    chain = store.list_fragment_versions(0)
    flat = [pg for m in chain for pg in m["applied"]]
    assert sorted(flat) == sorted(f"{i}/{s:08d}-f000" for i in "ab" for s in range(5))
    lines = []
    assert replay.run(cfg, store, 0, None, 1, False, lines.append) == 0, lines
