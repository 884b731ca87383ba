"""The virtual-clock harness's merge latency: each publish wakes the merger `merge_latency`
virtual seconds later (a syncer's poll and merge time), not before the island's next step."""

from tests.helpers import small_config
from training.bench.sim import run_islands


def test_the_first_merge_happens_the_latency_after_the_first_publish():
    # one island at speed 1 (1 virtual s a step), H = 2: the first publish is at t = 2, so with
    # a latency of 3 s the first merge is at t = 5, not at t = 2
    cfg = small_config(
        islands=("a",), inner={"H": 2}, outer={"method": "nesterov"}, token_budget=4 * 4 * 32
    )
    out = run_islands(cfg, eval_dt=1e9, trace_every=1, merge_latency=3.0)
    merges = [m for m in out["trace"] if m["kind"] == "merge"]
    assert merges[0]["t"] == 5.0
    assert merges[0]["contributions"][0]["island_step"] == 2
