"""The eval curve of a short run (issue 38): the end of a run fills the curve since the last
eval to a point every 1/CURVE_POINTS of the token budget (training/model/evaluate.py
`end_of_run_models`), besides the last merges no eval saw."""

from training.model.evaluate import CURVE_POINTS, end_of_run_models
from training.store.layout import Snapshot


def test_a_short_run_whose_evaluator_saw_one_model_gets_a_point_every_eighth_of_the_budget():
    """Budget 800 tokens, 20 merges of 40 tokens (version v holds 40 v tokens); the evaluator
    saw version 0 (init) and version 4 (160 tokens), then the islands were done. Targets
    160 + 100 k: 260, 360, 460, 560, 660, 760 -> the first model at or past each: 280, 360,
    480, 560, 680, 760 tokens (versions 7, 9, 12, 14, 17, 19); the last 4 merges but the newest
    (versions 19, 18, 17, 16; 20 is the final eval's). Together, oldest first: versions 7, 9, 12,
    14, 16, 17, 18, 19: with version 0, 4 and the final eval, 11 points on the curve (2 before)."""
    assert CURVE_POINTS == 8
    history = [Snapshot((v,), ("d",), tokens_merged=40 * v) for v in range(21)]
    got = end_of_run_models(history, {(0,), (4,)}, 4, 800)
    assert [s.versions[0] for s in got] == [7, 9, 12, 14, 16, 17, 18, 19]
