"""Claims of steps and tokens are bounded by what an island can have done; weights are capped.

Numbers are derived by hand from training/protocol/claims.py's rules. The experiment: H = 32, batch 16 x
seq 64 = 1024 tokens per step, tau = 2, 1000 steps/s at most, 5 s of clock skew.
"""

from __future__ import annotations

import pytest

from training.protocol.claims import (
    Beat,
    Claim,
    Limits,
    Round,
    cap_weights,
    check_claim,
    history,
    remember,
    version_times,
)
from training.store.merge_records import LastClaim, MergeState

L = Limits(H=32, tokens_per_step=1024, tau=2, max_steps_per_s=1000.0, clock_skew_s=5.0)
NOW = 10_000.0


def claim(seq=0, steps=32, tokens=32 * 1024, base=3, at=NOW - 1, island_step=None, fragment=0):
    return Claim("a", fragment, seq, base, steps, tokens, at, island_step)


def test_an_honest_claim_passes():
    assert check_claim(claim(), L, NOW, base_time=NOW - 10) is None


def test_the_first_interval_of_a_staggered_fragment_may_hold_up_to_2h_steps():
    assert check_claim(claim(steps=64, tokens=64 * 1024), L, NOW) is None


def test_more_steps_than_2h_is_refused():
    reason = check_claim(claim(steps=65, tokens=65), L, NOW)
    assert reason == "claims 65 steps since its last publish of fragment 0; at most 2 x H = 64"


def test_the_issue_case_2_to_the_40_steps_is_refused():
    reason = check_claim(claim(steps=2**40, tokens=2**40 * 1024), L, NOW)
    assert reason.startswith(f"claims {2**40} steps")


def test_more_tokens_than_steps_times_batch_is_refused():
    reason = check_claim(claim(steps=4, tokens=4 * 1024 + 1), L, NOW)
    assert reason == "tokens 4097 exceed 4 steps x 1024 tokens per step"


def test_a_claim_from_the_future_is_refused():
    assert check_claim(claim(at=NOW + 5), L, NOW) is None  # within the skew
    assert check_claim(claim(at=NOW + 60), L, NOW) == "published_at is 60 s in the future"


def test_steps_since_the_base_version_are_bounded_by_the_time_since_it_was_published():
    # base published 0.5 s ago: n claims may hold tau x n + 1000 x (0.5 + 5) steps together
    many = [claim(seq=i, steps=32) for i in range(171)]
    # 172 claims: 172 x 32 = 5504 <= 2 x 172 + 5500 = 5844
    assert check_claim(claim(seq=171), L, NOW, base_time=NOW - 0.5, earlier=many) is None
    many += [claim(seq=i, steps=32) for i in range(171, 200)]
    # 201 claims: 201 x 32 = 6432 > 2 x 201 + 5500 = 5902
    reason = check_claim(claim(seq=200), L, NOW, base_time=NOW - 0.5, earlier=many)
    assert reason == (
        "claims 6432 steps in 201 contribution(s) on base version 3, published 0.5 s ago: "
        "over 5902 at 1000 steps/s"
    )


def test_earlier_claims_on_older_bases_do_not_count_against_a_newer_base():
    older = [claim(seq=i, steps=32, base=1) for i in range(500)]
    assert check_claim(claim(seq=500, base=3), L, NOW, base_time=NOW - 0.5, earlier=older) is None


def test_the_base_rule_is_skipped_when_the_merger_clock_is_another_clock():
    """A virtual-clock bench (now = 12 s) with a base published at unix time: no judgement."""
    assert check_claim(claim(at=1.0), L, 12.0, base_time=1.7e9) is None


def test_island_step_may_not_grow_faster_than_the_rate_on_the_island_clock():
    prev = claim(seq=4, island_step=1000, at=NOW - 10)
    ok = claim(seq=5, island_step=1000 + 15_000, at=NOW)  # 15000 <= 1000 x (10 + 5)
    assert check_claim(ok, L, NOW, previous=prev) is None
    bad = claim(seq=5, island_step=1000 + 15_001, at=NOW)
    reason = check_claim(bad, L, NOW, previous=prev)
    assert reason == "island_step went from 1000 to 16001 in 10 s (seq 4 -> 5): over 1000 steps/s"


def test_steps_published_again_after_a_restart_are_refused():
    # rule 7: seq 4 held steps 969..1000; a restart from an older checkpoint publishing steps
    # 9..40 (32 steps ending at 40) counts steps already counted for this fragment
    prev = claim(seq=4, island_step=1000, at=NOW - 10)
    reason = check_claim(claim(seq=5, island_step=40, at=NOW), L, NOW, previous=prev)
    assert reason == (
        "steps 9..40 overlap steps up to 1000 already counted for this fragment (seq 4): "
        "counted once"
    )


def test_the_issue_36_double_count_is_refused():
    # island-2 published f001 at island_step 31 (2 steps: 30..31, seq 30), was killed before
    # its checkpoint, resumed from step 29 and published steps 30..31 of f001 again as seq 31
    prev = claim(seq=30, steps=2, tokens=256, island_step=31, at=NOW - 10, fragment=1)
    again = claim(seq=31, steps=2, tokens=256, island_step=31, at=NOW, fragment=1)
    assert "overlap steps up to 31" in check_claim(again, L, NOW, previous=prev)


def test_the_next_range_starting_right_after_the_last_passes():
    # seq 4 held steps 969..1000; seq 5 holds 1001..1032: adjacent, not overlapping
    prev = claim(seq=4, island_step=1000, at=NOW - 10)
    assert check_claim(claim(seq=5, island_step=1032, at=NOW), L, NOW, previous=prev) is None
    # one step earlier (1000..1031) overlaps by one
    assert check_claim(claim(seq=5, island_step=1031, at=NOW), L, NOW, previous=prev)


def test_more_steps_than_the_island_ever_did_is_refused():
    reason = check_claim(claim(steps=32, island_step=31), L, NOW)
    assert reason == "claims 32 steps but its island_step is 31"


def test_island_step_is_bounded_by_the_last_heartbeat():
    beat = Beat(step=500, time=NOW - 2)
    assert check_claim(claim(island_step=7500, at=NOW), L, NOW, heartbeat=beat) is None
    reason = check_claim(claim(island_step=7501, at=NOW), L, NOW, heartbeat=beat)
    assert (
        reason
        == "island_step 7501 is over 7500: its heartbeat said step 500 2 s before it published"
    )


def test_a_heartbeat_newer_than_the_claim_does_not_bound_it():
    beat = Beat(step=10, time=NOW)  # e.g. written after a restart from an older checkpoint
    assert check_claim(claim(island_step=900, at=NOW - 1), L, NOW, heartbeat=beat) is None


def test_a_round_judges_each_claim_against_the_ones_accepted_before_it():
    """As the merger's admission does (admit.check_manifest, in (island, seq) order): a
    claim that passes is accepted into the round, a refused one is not."""
    # base 3 published 0.01 s ago: bound 2 x n + 1000 x 5.01 = 5010 + 2n steps
    round_, rejected = Round(L, NOW, {3: NOW - 0.01}, {}, {}), []
    for c in [claim(seq=i, steps=64, tokens=64) for i in range(100)]:  # 64 n <= 5010 + 2 n
        if round_.check(c) is None:
            round_.accept(c)
        else:
            rejected.append(c.seq)
    # 62 n <= 5010 holds up to n = 80: claims 0..79 pass, then each later one is over
    assert rejected == list(range(80, 100))


def test_a_round_bounds_a_claim_by_the_islands_previous_one():
    prev = claim(seq=4, island_step=1000, at=NOW - 10)
    round_ = Round(L, NOW, {}, {"a": prev}, {})
    reason = round_.check(claim(seq=5, island_step=1000 + 15_001, at=NOW))
    assert reason == "island_step went from 1000 to 16001 in 10 s (seq 4 -> 5): over 1000 steps/s"


# -- the history a fragment's merge state keeps ------------------------------------------------

STATE = MergeState(
    steps=2,
    seen=2,
    version_times={"3": NOW - 20, "4": 9990},
    last_claim={"a": LastClaim(7, 400, NOW - 30)},
)


def test_history_reads_version_times_and_last_claims_of_a_merge_state():
    times, previous = history(STATE)
    assert times == {3: NOW - 20, 4: 9990.0}
    assert previous == {"a": Claim("a", 0, 7, 0, 1, 1, NOW - 30, 400)}


def test_remember_returns_the_newer_claim_and_leaves_its_input_alone():
    before = dict(STATE.last_claim)
    got = remember(STATE.last_claim, claim(seq=8, island_step=432, at=NOW))
    assert got == {"a": LastClaim(8, 432, NOW)}
    assert STATE.last_claim == before


def test_remember_keeps_a_later_claim_and_one_without_a_step_or_time_changes_nothing():
    assert remember(STATE.last_claim, claim(seq=6, island_step=500)) == STATE.last_claim
    assert remember(STATE.last_claim, claim(seq=9, island_step=None)) == STATE.last_claim
    assert remember({}, claim(seq=9, island_step=None)) == {}


def test_version_times_adds_the_new_version_and_keeps_the_newest():
    assert version_times(STATE, 5, NOW, keep=2) == {"5": NOW, "4": 9990}
    assert STATE.version_times == {"3": NOW - 20, "4": 9990}


@pytest.mark.parametrize(
    ("weights", "capped"),
    [
        ([1.0], [1.0]),
        ([1e12, 100.0], [800.0, 100.0]),  # hostile share 800 / 900 = 89% = k / (k + 1)
        ([1.0, 2.0, 8.0], [1.0, 2.0, 8.0]),  # honest heterogeneity within 8x: untouched
        ([100.0, 1.0, 1.0, 1.0], [8.0, 1.0, 1.0, 1.0]),
        ([0.0, 5.0], [0.0, 5.0]),  # the other's median is 0: nothing to cap against
    ],
)
def test_a_weight_is_capped_at_8_times_the_median_of_the_others(weights, capped):
    assert cap_weights(weights) == capped
