"""training/merge/syncer.py: shards, leases, the draining loop and the eval cadence (no Airflow).

A fake clock drives every timing decision: `sleep` advances it, so nothing here waits.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.helpers import FakeClock, new_store, publish_delta, small_config
from training.merge.evaluator import Evaluator
from training.merge.merger import MergeResult
from training.merge.syncer import (
    Lease,
    ShardLease,
    ShardSyncer,
    ShardView,
    lease_action,
    shard_fragments,
)


def two_fragment_config(name="syn", **syncer):
    return small_config(
        name, fragments={"count": 2}, syncer={"shards": 2, "idle_s": 5, "poll_s": 0.5, **syncer}
    )


class ScriptedMerger:
    """merge_once() returns the scripted results, then no progress forever."""

    def __init__(self, results):
        self.results = list(results)
        self.calls = 0

    def promote_heads(self):
        self.promotions = getattr(self, "promotions", 0) + 1
        return []

    def merge_once(self):
        self.calls += 1
        return self.results.pop(0) if self.results else MergeResult()


def syncer_with(store, results, clock, owner="run-1", **kw):
    merger = ScriptedMerger(results)
    s = ShardSyncer(
        store,
        0,
        owner,
        clock=clock,
        sleep=clock.sleep,
        merger_for=lambda cfg, fragments: merger,
        **kw,
    )
    return s, merger


def fragment_delta(store, cfg, p, value=1e-3):
    from training.model.runtime import fragment_names

    params = store.load_params()
    return {n: np.full(params[n].shape, value, np.float32) for n in fragment_names(cfg)[p]}


# -- pure decisions --------------------------------------------------------------------------
def test_shards_partition_the_fragments():
    parts = [shard_fragments(24, 5, s) for s in range(5)]
    assert sorted(p for part in parts for p in part) == list(range(24))
    assert all(p % 5 == s for s, part in enumerate(parts) for p in part)


def test_a_shards_view_asks_the_store_for_its_own_pending_work():
    cfg = two_fragment_config()
    store = new_store(cfg)
    ids = [
        publish_delta(store, cfg, "a", seq, fragment_delta(store, cfg, p), fragment=p).id
        for seq, p in ((0, 0), (1, 1), (2, 0))
    ]
    assert ShardView(store, 0).pending(cfg) == [ids[0], ids[2]]
    assert ShardView(store, 1).pending(cfg) == [ids[1]]


def test_lease_action_takes_free_or_expired_renews_own_waits_for_others():
    live, dead = Lease("r1", 110.0), Lease("r1", 90.0)
    assert lease_action(None, "r2", 100.0) == "take"
    assert lease_action(dead, "r2", 100.0) == "take"
    assert lease_action(live, "r1", 100.0) == "renew"
    assert lease_action(live, "r2", 100.0) == "wait"


def test_a_lease_that_is_not_json_counts_as_free():
    store, clock = new_store(small_config()), FakeClock(1000.0)
    store.store.write(f"{store.experiment}/control/syncer/shard-0.json", b"\xff{")
    assert ShardView(store, 0).lease() is None
    assert ShardLease(store, 0, "r1", 30, clock).acquire()
    assert ShardView(store, 0).lease() == Lease("r1", 1030.0, ShardLease(store, 0, "r1", 30).holder)


# -- the lease in the store ------------------------------------------------------------------
def test_a_live_lease_keeps_a_second_owner_out_until_it_expires():
    store, clock = new_store(small_config()), FakeClock(1000.0)
    first, second = ShardLease(store, 0, "r1", 30, clock), ShardLease(store, 0, "r2", 30, clock)
    assert first.acquire() and not second.acquire()
    clock.sleep(29)
    assert not second.acquire()
    clock.sleep(2)
    assert second.acquire() and not first.acquire()


def test_a_released_lease_is_taken_at_once_and_release_spares_anothers():
    store, clock = new_store(small_config()), FakeClock(1000.0)
    first, second = ShardLease(store, 1, "r1", 30, clock), ShardLease(store, 1, "r2", 30, clock)
    assert first.acquire()
    second.release()  # not its lease: nothing changes
    assert not second.acquire()
    first.release()
    assert second.acquire()


def test_each_shard_has_its_own_lease():
    store, clock = new_store(small_config()), FakeClock(1000.0)
    assert ShardLease(store, 0, "r1", 30, clock).acquire()
    assert ShardLease(store, 1, "r2", 30, clock).acquire()


# -- the draining loop -----------------------------------------------------------------------
def test_drain_merges_back_to_back_while_work_arrives_then_returns_idle():
    cfg = two_fragment_config()
    store, clock = new_store(cfg), FakeClock(1000.0)
    progress = [MergeResult(versions={0: v}, applied=[f"a/{v:08d}-f000"]) for v in (1, 2, 3)]
    syncer, merger = syncer_with(store, progress, clock)
    out = syncer.drain()
    assert (out.reason, out.merges, out.applied) == ("idle", 3, 3)
    assert merger.calls == 4  # three merges back to back, one that found nothing
    assert clock.t - 1000.0 == pytest.approx(cfg.syncer.idle_s)
    assert max(clock.naps) <= cfg.syncer.poll_s


def test_drain_retries_at_the_end_of_a_grace_window():
    cfg = two_fragment_config()
    store, clock = new_store(cfg), FakeClock(1000.0)
    results = [
        MergeResult(waiting_until=1000.2),
        MergeResult(versions={0: 1}, applied=["a/00000000-f000"]),
    ]
    syncer, merger = syncer_with(store, results, clock)
    out = syncer.drain()
    assert clock.naps[0] == pytest.approx(0.2) and out.merges == 1


def test_drain_stands_by_while_another_runs_lease_lives():
    cfg = two_fragment_config()
    store, clock = new_store(cfg), FakeClock(1000.0)
    assert ShardLease(store, 0, "run-0", cfg.syncer.lease_s, clock).acquire()
    syncer, merger = syncer_with(store, [MergeResult(applied=["x"])], clock)
    assert syncer.drain().reason == "standby" and merger.calls == 0


def test_a_shard_merges_only_its_own_fragments():
    cfg = two_fragment_config()
    store, clock = new_store(cfg), FakeClock(1000.0)
    ids = {
        p: publish_delta(store, cfg, "a", 0, fragment_delta(store, cfg, p), fragment=p).id
        for p in (0, 1)
    }
    shard0 = ShardSyncer(store, 0, "r", clock=clock, sleep=clock.sleep)
    assert shard0.drain().reason == "idle"
    assert set(store.applied()) == {ids[0]}
    shard1 = ShardSyncer(store, 1, "r", clock=clock, sleep=clock.sleep)
    shard1.drain()
    assert set(store.applied()) == {ids[0], ids[1]}


def test_a_finished_experiment_gets_a_last_drain_and_its_lease_released():
    cfg = two_fragment_config()
    store, clock = new_store(cfg), FakeClock(1000.0)
    pg = publish_delta(store, cfg, "a", 0, fragment_delta(store, cfg, 0)).id
    for island in ("a", "b"):
        store.mark_done(island, {})
    syncer = ShardSyncer(store, 0, "r", clock=clock, sleep=clock.sleep)
    out = syncer.drain()
    assert out.reason == "finished" and set(store.applied()) == {pg}
    assert ShardView(store, 0).lease().expires_at == 0.0


def test_the_end_of_its_runs_islands_finishes_a_shard():
    cfg = two_fragment_config()
    store, clock = new_store(cfg), FakeClock(1000.0)
    store.mark_run_ended("manual__2026-01-01T00:00:00+00:00", ["a", "b"])
    syncer, _ = syncer_with(store, [], clock, run_id="manual__2026-01-01T00:00:00+00:00")
    assert syncer.drain().reason == "finished" and clock.t == 1000.0
    other, _ = syncer_with(store, [], FakeClock(1000.0), run_id="manual__other")
    assert other.drain().reason == "idle"


@pytest.mark.integration
def test_two_shards_at_once_on_gcs_apply_each_contribution_once(gcs_bucket):  # noqa: F811
    """Both shards drain concurrently (real clock) while they race for the global HEAD."""
    cfg = two_fragment_config("race2", idle_s=2.0, poll_s=0.05)
    store = new_store(cfg, f"{gcs_bucket}/syncer-{uuid.uuid4().hex[:8]}")
    committed = set()
    for seq in range(3):
        for island in ("a", "b"):
            for p in (0, 1):
                delta = fragment_delta(store, cfg, p, 1e-3 * (seq + 1))
                committed.add(publish_delta(store, cfg, island, seq, delta, fragment=p).id)
    outs = {}

    def run(shard):
        s = ShardSyncer(store, shard, "r")
        outs[shard] = s.drain()

    threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    applied = store.applied()
    assert set(applied) == committed
    chain = [
        pg
        for p in range(store.num_fragments())
        for v in store.list_fragment_versions(p)
        for pg in v.get("applied", [])
    ]
    assert len(chain) == len(set(chain)) == len(committed)
    assert outs[0].applied + outs[1].applied == len(committed)


# -- evaluation cadence ----------------------------------------------------------------------
def test_evaluator_evaluates_new_merges_at_most_every_eval_every_s_then_goes_idle():
    cfg = small_config("ev", syncer={"eval_every_s": 10, "idle_s": 30, "poll_s": 1})
    store, clock = new_store(cfg), FakeClock(100.0)
    merge = lambda: store.append_metric("merge", {"at": clock.t})  # noqa: E731
    merge()
    clock.at = [(103, merge), (105, merge), (125, merge)]
    at = []
    ev = Evaluator(
        store, clock=clock, sleep=clock.sleep, evaluate=lambda c: at.append(clock.t) or {}
    )
    out = ev.run()
    assert out.reason == "idle" and at == [100.0, 110.0, 125.0]
    assert clock.t == pytest.approx(155.0)


def test_evaluator_returns_once_the_experiment_is_finished():
    cfg = small_config("ev2")
    store, clock = new_store(cfg), FakeClock(1000.0)
    for island in ("a", "b"):
        store.mark_done(island, {})
    ev = Evaluator(store, clock=clock, sleep=clock.sleep, evaluate=lambda c: {})
    assert ev.run().reason == "finished"
