"""Clock rounds (training/protocol/rounds.py): the shared grid, the roll-over and cap rules, the clock
record in the store, and a restarted island coming back in phase."""

from __future__ import annotations

import math

import pytest

from tests.helpers import new_store, small_config
from training.island.process import Island
from training.merge.merger import Merger
from training.protocol import rounds
from training.protocol.rounds import RoundClock, clock_due

CLOCK = RoundClock(t0=100.0, period_s=10.0)


def test_boundary_after_is_the_next_grid_point_strictly_after():
    # grid 100, 110, 120, ...: from 110 exactly the next one is 120; before t0 it is t0
    assert [CLOCK.boundary_after(t) for t in (50.0, 100.0, 109.9, 110.0)] == [
        100.0,
        110.0,
        110.0,
        120.0,
    ]


def test_fragment_offsets_are_their_step_offsets_as_a_share_of_the_period():
    # H = 8, P = 4: step offsets 0, 2, 4, 6 -> 0, 2.5, 5, 7.5 s of a 10 s round
    assert rounds.offsets_s(CLOCK, 8, 4) == [0.0, 2.5, 5.0, 7.5]


def test_a_fragment_is_due_at_its_boundary():
    due, next_at = clock_due(CLOCK, 110.2, [110.0], [8], H=8, H_m=8)
    assert (due, next_at) == ([0], [120.0])


def test_a_short_interval_rolls_over_to_the_next_boundary():
    # 3 steps < H_m // 2 = 4: not published, the boundary moves on
    due, next_at = clock_due(CLOCK, 110.2, [110.0], [3], H=8, H_m=8)
    assert (due, next_at) == ([], [120.0])


def test_a_round_of_twice_h_steps_is_published_whatever_the_clock_says():
    due, next_at = clock_due(CLOCK, 111.0, [200.0], [16], H=8, H_m=8)
    assert (due, next_at) == ([0], [120.0])


def test_before_its_boundary_nothing_is_due():
    assert clock_due(CLOCK, 109.0, [110.0], [9], H=8, H_m=8) == ([], [110.0])


def test_a_step_ending_within_half_a_step_before_its_boundary_is_the_nearest_to_it():
    # step 4 s: a step ending 1.9 s before 110 is nearer 110 than the next one (2.1 s after):
    # due now, and the next boundary is 120, not 110 again
    assert clock_due(CLOCK, 108.1, [110.0], [8], H=8, H_m=8, step_s=4.0) == ([0], [120.0])
    # 2.1 s before: the next step (1.9 s after) is nearer
    assert clock_due(CLOCK, 107.9, [110.0], [8], H=8, H_m=8, step_s=4.0) == ([], [110.0])


def test_a_step_end_a_rounding_error_before_the_boundary_reaches_it():
    # the island that set the clock: its step ends fall on the boundaries, and a sum of step
    # times can land 1e-12 below one (t0 + k * period): without its step time it would be a
    # whole step late
    at = 100.0 + 3 * 10.0
    now = 100.0 + 0.1 * 300 - 1e-12
    assert clock_due(CLOCK, now, [at], [8], H=8, H_m=8) == ([], [at])
    assert clock_due(CLOCK, now, [at], [8], H=8, H_m=8, step_s=1.25) == ([0], [140.0])


def test_the_first_clock_record_stands():
    store = new_store(small_config())
    assert store.create_round_clock(5.0, 2.0) and not store.create_round_clock(7.0, 3.0)
    assert store.round_clock() == (5.0, 2.0)


@pytest.mark.parametrize(
    "record",
    [b'{"t0": 1.0, "period_s": 0}', b'{"t0": 1.0, "period_s": 1e9}', b'{"t0": -1, "period_s": 1}'],
)
def test_a_broken_clock_record_is_skipped_and_the_islands_keep_the_step_rule(record):
    store = new_store(small_config())
    store.store.write(store.object_key("control/rounds.json"), record)
    assert store.round_clock() is None and store.skipped.count == 1


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _publish_times(rule: str) -> dict[str, list[float]]:
    """Two islands, one virtual second per step, H = 4; island b is killed at t = 6 (after its
    checkpoint at step 4) and restarted at t = 9. Returns each island's publish times."""
    cfg = small_config("rounds", outer={"method": "decoupled", "rounds": rule})
    store = new_store(cfg)
    clock = _Clock()
    live = {n: Island(cfg, n, store, clock=clock) for n in ("a", "b")}
    for isl in live.values():
        isl.start()
    merger = Merger(cfg, store, clock=clock)
    times: dict[str, list[float]] = {"a": [], "b": []}
    for tick in range(1, 25):
        clock.t = float(tick)
        if tick == 6:
            del live["b"]
        restarted = tick == 9
        if restarted:
            live["b"] = Island(cfg, "b", store, clock=clock)
            live["b"].start()
        for name, isl in live.items():
            if restarted and name == "b":
                continue  # the restart takes this second
            if isl.step().published:
                times[name].append(clock.t)
        merger.merge_all()
    return times


def test_clock_rounds_bring_a_restarted_island_back_in_phase():
    # a and b publish at t = 4 (step rule); the merger sets t0 = 4, period = H x 1 s = 4 s; b
    # restarts at t = 9 and publishes its 3-step interval at the next boundary, 12, with a
    times = _publish_times("clock")
    after = {name: [t for t in ts if t > 9] for name, ts in times.items()}
    assert after["b"] == after["a"] == [12.0, 16.0, 20.0, 24.0]


def test_step_rounds_leave_a_restarted_island_out_of_phase():
    # b resumes at step 4 at t = 9: its next publishes are at steps 8, 12, ... = t 13, 17, 21
    times = _publish_times("steps")
    after = [t for t in times["b"] if t > 9]
    assert after == [13.0, 17.0, 21.0] and not set(after) & set(times["a"])


def test_the_clock_period_is_h_m_times_the_measured_step_time():
    cfg = small_config(outer={"rounds": "clock"})
    # 4 steps of which 3 timed at 0.5 s each: step_time_s 0.5, H_m = 4 -> 2 s
    assert rounds.clock_from_first(cfg, "a", 10.0, 0.5, now=11.0) == (10.0, 2.0)
    assert math.isclose(rounds.clock_from_first(cfg, "a", 12.0, 0.5, now=11.0)[0], 11.0)
