"""Goodput accounting: categories by hand-derived numbers, restarts, chip weighting, Island hooks."""

import pytest

from tests.helpers import FakeClock, new_store, small_config
from training.config.experiment import IslandConfig
from training.island.goodput import CATEGORIES, GoodputAccountant, chips_of, experiment_goodput
from training.island.process import Island
from training.views.status import collect_status, format_status


def test_categories_add_up_by_hand():
    clock = FakeClock(0.0)
    acc = GoodputAccountant(clock=clock, wall=clock, process_age=2.0)  # process began at -2
    clock.t = 1.0
    t = acc.charge("checkpoint_restore", 0.0)  # 0 -> 1: restore
    clock.t = 1.5
    t = acc.charge("data_loading", t)  # 1 -> 1.5
    clock.t = 3.5
    t = acc.step(t)  # first step: startup = (3.5 - (-2)) - (1 + 0.5) = 4.0
    for _ in range(2):  # two more steps: 0.5 s data, 1 s compute each
        clock.t += 0.5
        t = acc.charge("data_loading", t)
        clock.t += 1.0
        t = acc.step(t)
    clock.t += 0.5
    acc.charge("checkpoint_save", t)  # 6.5 -> 7.0
    clock.t = 8.0
    s = acc.state()
    assert s["elapsed_s"] == pytest.approx(10.0)
    assert s["seconds"] == pytest.approx(
        dict(
            productive=2.0,
            startup_and_compile=4.0,
            data_loading=1.5,
            checkpoint_save=0.5,
            checkpoint_restore=1.0,
            wasted_progress=0.0,
            waiting_for_global=0.0,
            infrastructure_recovery=0.0,
            other=1.0,
        )
    )
    assert sum(s["seconds"].values()) == pytest.approx(s["elapsed_s"])
    assert s["goodput"] == pytest.approx(0.2)
    assert s["steps"] == 2  # the first step of a process is startup, not productive


def test_startup_in_progress_counts_as_startup():
    clock = FakeClock(0.0)
    acc = GoodputAccountant(clock=clock, wall=clock, process_age=1.0)
    clock.t = 4.0
    s = acc.state()
    assert s["seconds"]["startup_and_compile"] == pytest.approx(5.0)
    assert s["seconds"]["other"] == pytest.approx(0.0)
    assert s["goodput"] == 0.0


def _prev(elapsed, productive, steps, wall, closed=False, **seconds):
    sec = dict.fromkeys(CATEGORIES, 0.0)
    sec.update(productive=productive, **seconds)
    sec["other"] = elapsed - sum(sec.values())
    return dict(elapsed_s=elapsed, seconds=sec, steps=steps, wall=wall, closed=closed)


def test_restart_moves_lost_steps_to_wasted_and_downtime_to_recovery():
    # previous process: checkpoint at step 24 (wall 980), last heartbeat at step 30 (wall 1000);
    # by then 20 productive steps took 40 s (2 s a step) of 100 s elapsed. It died; this process
    # started at wall 1010.
    ckpt = _prev(80.0, 32.0, 16, 980.0, startup_and_compile=10.0)
    beat = _prev(100.0, 40.0, 20, 1000.0, startup_and_compile=10.0)
    clock = FakeClock(0.0)
    wall = FakeClock(1010.0)
    acc = GoodputAccountant(clock=clock, wall=wall)
    lost = acc.resume(ckpt, 24, beat, 30)
    assert lost == 6
    clock.t, wall.t = 5.0, 1015.0  # 5 s into this process's startup
    s = acc.state()
    assert s["seconds"]["productive"] == pytest.approx(40.0 - 6 * 2.0)
    assert s["seconds"]["wasted_progress"] == pytest.approx(12.0)
    assert s["seconds"]["infrastructure_recovery"] == pytest.approx(10.0)
    assert s["seconds"]["startup_and_compile"] == pytest.approx(10.0 + 5.0)
    assert s["elapsed_s"] == pytest.approx(100.0 + 10.0 + 5.0)
    assert s["goodput"] == pytest.approx(28.0 / 115.0)
    assert (s["steps"], s["lost_steps"], s["restarts"]) == (14, 6, 1)
    assert sum(s["seconds"].values()) == pytest.approx(s["elapsed_s"])


def test_restart_after_clean_exit_counts_no_downtime():
    ckpt = _prev(50.0, 30.0, 10, 500.0, closed=True)
    acc = GoodputAccountant(clock=FakeClock(0.0), wall=FakeClock(9000.0))
    assert acc.resume(ckpt, 10, ckpt, 10) == 0
    s = acc.state()
    assert s["elapsed_s"] == pytest.approx(50.0)
    assert s["seconds"]["infrastructure_recovery"] == 0.0
    assert s["restarts"] == 0


def test_older_heartbeat_than_checkpoint_uses_the_checkpoint():
    ckpt = _prev(80.0, 40.0, 20, 990.0)
    beat = _prev(70.0, 35.0, 18, 985.0)
    acc = GoodputAccountant(clock=FakeClock(0.0), wall=FakeClock(1000.0))
    assert acc.resume(ckpt, 20, beat, 18) == 0
    s = acc.state()
    assert s["elapsed_s"] == pytest.approx(90.0)  # 80 + 10 s down since the checkpoint
    assert s["seconds"]["productive"] == pytest.approx(40.0)


def test_chips_and_chip_weighted_experiment_goodput():
    isl = [
        IslandConfig(name="a", hardware={"accelerator": "tpu-v6e-slice", "topology": "2x2"}),
        IslandConfig(name="b"),
        IslandConfig(name="c", backend="tpu_vm", hardware={"accelerator_type": "v4-8"}),
        IslandConfig(name="d", backend="tpu_vm", hardware={"accelerator_type": "v5litepod-16"}),
        IslandConfig(name="e", hardware={"chips": 3}),
    ]
    assert [chips_of(i) for i in isl] == [4, 1, 4, 16, 3]
    cfg = small_config(islands=("a", "b", "c"))
    cfg = cfg.model_copy(update={"islands": tuple(isl[:3])})
    states = {
        "a": _prev(100.0, 90.0, 10, 1.0, data_loading=10.0),
        "b": _prev(100.0, 20.0, 10, 1.0, wasted_progress=80.0),
        # c never reported: not counted
    }
    g = experiment_goodput(cfg, states)
    assert g["goodput"] == pytest.approx((4 * 90 + 1 * 20) / (4 * 100 + 1 * 100))  # 0.76
    assert g["badput"]["data_loading"] == pytest.approx(40 / 500)
    assert g["badput"]["wasted_progress"] == pytest.approx(80 / 500)
    assert (g["chips"], g["islands"]) == (5, 2)
    assert experiment_goodput(cfg, {}) is None


def test_island_reports_goodput_and_recovers_lost_steps(monkeypatch):
    cfg = small_config("gp", islands=("a", "b"))  # H = 4: publish + checkpoint every 4 steps
    store = new_store(cfg)
    clock = FakeClock(100.0)

    def ticking():  # every read of the island's clock advances it by 0.25 s
        clock.t += 0.25
        return clock.t

    isl = Island(cfg, "a", store, clock=ticking)
    isl.start()
    for _ in range(6):
        isl.step()
    isl.heartbeat(1.0, 0.0)  # at step 6; the checkpoint is at step 4
    beat = store.heartbeats()["a"]
    state = beat["goodput_state"]
    assert beat["goodput"] == pytest.approx(state["goodput"])
    assert sum(state["seconds"].values()) == pytest.approx(state["elapsed_s"])
    assert state["seconds"]["productive"] > 0 and state["steps"] == 5
    assert store.load_checkpoint("a")[1]["goodput"]["steps"] == 3

    # the process dies; a new one resumes from the checkpoint at step 4
    again = Island(cfg, "a", store, clock=ticking)
    again.start()
    assert (again.step_count, again.lost_steps) == (4, 2)
    s = again.goodput.state()
    per_step = state["seconds"]["productive"] / state["steps"]
    assert s["seconds"]["wasted_progress"] == pytest.approx(2 * per_step)
    assert s["seconds"]["infrastructure_recovery"] > 0
    assert (s["steps"], s["lost_steps"], s["restarts"]) == (3, 2, 1)

    status = collect_status(cfg, store, now=clock.t)
    assert status["goodput"]["islands"] == 1
    assert status["islands"][0]["goodput"] == pytest.approx(beat["goodput"])
    text = format_status(status)
    assert "goodput" in text and "chip-weighted" in text


def test_a_done_island_goodput_is_over_its_life_not_to_now():
    """Island a (alone, budget 8 steps of 128 tokens) trains on a clock that moves 0.25 s a
    read and marks itself done at step 8. An hour later, `diloco status` shows the goodput of
    its closing heartbeat, and a relaunch of the done island (an Airflow retry, `diloco island`
    again) returns at once: before, it resumed, trained 4 more steps past its budget and counted
    its new process's time (goodput 0.0814 -> 0.0758 on this clock)."""
    cfg = small_config("gp", islands=("a",), token_budget=8 * 128, heartbeat_s=0.001)
    store = new_store(cfg)
    clock = FakeClock(1000.0)

    def ticking():
        clock.t += 0.25
        return clock.t

    assert Island(cfg, "a", store, clock=ticking).run()["step"] == 8
    at_done = collect_status(cfg, store, now=clock.t)
    beat = store.heartbeats()["a"]
    clock.t += 3600.0
    assert Island(cfg, "a", store, clock=ticking).run()["step"] == 8  # nothing trained
    later = collect_status(cfg, store, now=clock.t)
    assert later["goodput"] == at_done["goodput"]
    assert store.heartbeats()["a"] == beat
