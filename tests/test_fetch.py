"""Issue 28, item 4: a merge fetches its contributions concurrently, bounded, in its order.

The merge sums in a fixed order whatever order the downloads end in, so a merge that fetches
4 at once and one that fetches them one by one publish the same bits (file:// and
fake-gcs-server); the prefetcher holds at most `concurrency` payloads ahead of the one handed
out. The time it saves is measured, not asserted: docs/BENCHMARKS.md, "Merge fetch".
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.gcs_fixture import gcs_bucket, open_backend  # noqa: F401
from tests.helpers import publish_delta, publish_payload, random_delta, small_config
from training.codecs import host as codecs
from training.merge.fetch import Prefetch
from training.merge.merger import Merger, initial_version
from training.store.experiment import ExperimentStore


def test_payloads_are_handed_out_in_order_with_at_most_k_fetched_ahead():
    loaded: set[int] = set()
    lock = threading.Lock()

    def load(i):
        with lock:
            loaded.add(i)
        return i * 10

    fetch = Prefetch([(str(i), i) for i in range(6)], load, 2)
    got = []
    for i in range(6):
        got.append(fetch.get(str(i), i))
        with lock:
            ahead = {j for j in loaded if j > i}
        assert ahead <= {i + 1, i + 2}  # never more than k = 2 past the one handed out
    assert got == [0, 10, 20, 30, 40, 50]


def test_an_error_is_raised_when_its_payload_is_asked_for():
    def load(i):
        if i == 1:
            raise ValueError("broken payload 1")
        return i

    fetch = Prefetch([(str(i), i) for i in range(3)], load, 3)
    assert fetch.get("0", 0) == 0
    with pytest.raises(ValueError, match="broken payload 1"):
        fetch.get("1", 1)
    assert fetch.get("2", 2) == 2


@pytest.mark.parametrize("backend", ["file", pytest.param("gs", marks=pytest.mark.integration)])
def test_a_merge_fetching_4_at_once_publishes_the_bits_of_one_at_a_time(backend, request, tmp_path):
    """3 islands x 3 intervals in int4 plus one corrupt payload (quarantined either way)."""
    params = {}
    for k in (1, 4):
        objects = open_backend(backend, request, tmp_path / str(k))
        cfg = small_config(
            islands=("a", "b", "c"),
            codec="int4",
            outer={"method": "nesterov"},
            syncer={"fetch_concurrency": k},
            store_url=objects.url,
        )
        store = ExperimentStore(objects, cfg.name)
        store.write_config(cfg.model_dump(mode="json"))
        initial_version(cfg, store)
        theta = store.load_params()
        for n, island in enumerate("abc"):
            for seq in range(3):
                publish_delta(store, cfg, island, seq, random_delta(theta, 10 * n + seq))
        broken, _ = codecs.encode(random_delta(theta, 99), cfg.codec)
        broken.pop(sorted(broken)[0])  # a tensor missing: refused by the merge's checks
        publish_payload(store, cfg, "c", 3, broken)
        r = Merger(cfg, store).merge_once()
        assert r.version == 1 and len(r.applied) == 9 and list(r.quarantined) == ["c/00000003-f000"]
        params[k] = store.load_params()
    assert params[1].keys() == params[4].keys()
    for name in params[1]:
        np.testing.assert_array_equal(params[1][name], params[4][name])
