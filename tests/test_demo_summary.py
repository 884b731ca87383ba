"""The demo's summary figures, from merge and eval records alone (no Airflow, no store)."""

from __future__ import annotations

from devtools.demo import percentile, summarize


def _merge(at, tokens, *contribs):
    return {
        "at": at,
        "tokens_merged": tokens,
        "contributions": [{"id": i, "published_at": p} for i, p in contribs],
    }


def test_latency_is_merge_time_minus_publish_time_per_contribution():
    merges = [_merge(10.5, 100, ("a/1", 10.0), ("b/1", 9.0)), _merge(12.0, 200, ("a/2", 11.0))]
    s = summarize(merges, [], {}, 150)
    assert s["merge_latency_p50_s"] == 1.0 and s["merge_latency_max_s"] == 1.5
    assert s["first_merge_after_first_publish_s"] == 1.5
    assert (s["merges"], s["tokens_merged"], s["applied_twice"]) == (2, 200, 0)


def test_an_id_in_two_merges_counts_as_applied_twice():
    merges = [_merge(1.0, 1, ("a/1", 0.5)), _merge(2.0, 2, ("a/1", 0.5))]
    assert summarize(merges, [], {}, 1)["applied_twice"] == 1


def test_eval_losses_in_time_order_and_island_bytes_summed():
    evals = [{"loss": 3.0, "at": 2.0}, {"loss": 5.0, "at": 1.0}, {"loss": 3.5, "at": 3.0}]
    islands = {"a": {"bytes_sent": 10, "tokens": 7}, "b": {"bytes_uploaded": 5}}
    s = summarize([], evals, islands, 1)
    assert (s["initial_eval_loss"], s["final_eval_loss"], s["best_eval_loss"]) == (5.0, 3.5, 3.0)
    assert (s["bytes_uploaded"], s["bytes_downloaded"], s["tokens_trained"]) == (15, None, 7)


def test_nearest_rank_percentile():
    assert percentile(list(range(1, 101)), 95) == 95 and percentile([], 50) is None
