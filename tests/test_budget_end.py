"""The budget near its end (issue 24 item 5): the islands' timed heartbeats add up every
island's trained tokens once the rest is near, so the islands stop within a heartbeat of the
budget and send their last interval cut short, instead of training a whole interval past it."""

from __future__ import annotations

from tests.helpers import new_store, small_config
from training.island.process import Island

PER_STEP = 4 * 32  # small_config: batch 4 x seq 32 tokens a step


def _run(heartbeats: bool, H: int = 8, budget_steps: int = 21) -> int:
    """Two islands stepping in turn, no syncer; with `heartbeats`, a timed heartbeat after
    every step (what `Island.run` does every `heartbeat_s`). Returns the tokens both trained."""
    budget = budget_steps * PER_STEP
    cfg = small_config(inner={"H": H, "tau": 0}, token_budget=budget)
    store = new_store(cfg)
    islands = [Island(cfg, n, store) for n in ("a", "b")]
    for isl in islands:
        isl.start()
    for _ in range(100):
        for isl in islands:
            if not isl.finished():
                isl.step()
                if heartbeats:
                    isl.heartbeat(None, None, budget=True)
                isl.io.drain()  # each check done before the next step
    assert all(isl.finished() for isl in islands)
    return sum(isl.tokens for isl in islands)


def test_islands_stop_at_the_budget_without_a_syncer():
    """No merger runs at all: the two islands still stop within one publish interval each of
    the token budget (heartbeats after every publish round carry their trained tokens)."""
    trained = _run(heartbeats=False, H=2, budget_steps=10)
    assert 10 * PER_STEP <= trained <= (10 + 2 * 2) * PER_STEP


def test_without_timed_checks_the_islands_run_a_whole_interval_past_the_budget():
    # the publish-round checks only: 8 + 8 = 16 steps < 21, so both train their second
    # interval: 32 steps, 11 past the budget (the behaviour before; the timed checks' baseline)
    assert _run(heartbeats=False) == 32 * PER_STEP


def test_timed_checks_stop_the_islands_within_a_step_of_the_budget():
    # after the first publish round the rest is 21 - 16 = 5 steps < 2 x 2 islands x 8: near.
    # Each step's heartbeat then adds both islands' tokens: a reaches 11 + b's 10 = 21 and
    # stops; b's next check sees 11 + 11 = 22 and stops: 22 steps, one past the budget
    assert _run(heartbeats=True) == 22 * PER_STEP
