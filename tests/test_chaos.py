"""Chaos mode: storage faults are retried and recorded, the monkey kills on schedule, slow and
stalled islands behave, the merge kill is armed once and recovers."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import FakeClock, new_store, small_config
from training.config.experiment import ChaosConfig, ConfigError
from training.faults.chaos import (
    ChaosStore,
    IslandChaos,
    arm_merge_kill,
    chaos_store,
    for_process,
    kill_times,
    run_monkey,
    victim_chooser,
)
from training.faults.points import FaultPlan
from training.island.process import Island
from training.merge.merger import Merger, initial_version
from training.store.experiment import ExperimentStore
from training.store.registry import open_store


def _unique(prefix: str) -> str:
    return f"memory://{prefix}-{time.time_ns()}"


# -- storage ----------------------------------------------------------------------------------


def test_chaos_store_injects_retries_and_is_deterministic():
    def run(seed):
        events, sleeps = [], []
        store = ChaosStore(
            open_store(_unique("cs")), 0.3, 0.0, seed, events.append, sleep=sleeps.append
        )
        for i in range(40):
            store.write(f"k/{i}", b"x%d" % i)
            assert store.read(f"k/{i}") == b"x%d" % i
            assert store.create(f"c/{i}", b"y")
        assert sorted(store.list("k/")) == sorted(f"k/{i}" for i in range(40))
        return store.stats, events, sleeps

    stats, events, sleeps = run(seed=3)
    assert stats["calls"] == 121
    assert 0 < stats["injected"] == len(events) == len(sleeps)  # each one backed off once
    assert 0 < stats["retried_calls"] <= stats["injected"]
    assert all(e["event"] == "storage_error" and "at" in e for e in events)
    assert run(seed=3)[0] == stats  # same seed, same faults


def test_injected_errors_never_exhaust_the_retries():
    store = ChaosStore(open_store(_unique("cs")), 0.999, 0.0, 0, sleep=lambda s: None)
    store.write("a", b"1")  # 4 injected failures, then the 5th attempt goes through
    assert store.read("a") == b"1"
    assert store.stats["injected"] == 8


def test_latency_is_injected():
    slept = []
    store = ChaosStore(open_store(_unique("cs")), 0.0, 0.05, 0, sleep=slept.append)
    store.write("a", b"1")
    store.exists("a")
    assert slept == [0.05, 0.05] and store.stats["delayed_s"] == pytest.approx(0.1)


def test_experiment_completes_with_storage_errors():
    cfg = small_config("chaos-store", chaos={"storage_error_rate": 0.2, "seed": 1})
    plain = new_store(cfg)
    store = chaos_store(plain, cfg.chaos, backoff_base=0.001)
    assert isinstance(store.store, ChaosStore)
    islands = [Island(cfg, n, store) for n in ("a", "b")]
    merger = Merger(cfg, store)
    for isl in islands:
        isl.start()
    for _ in range(8):  # H = 4: two publishes per island
        for isl in islands:
            if isl.step().published:
                merger.merge_all()
    merger.merge_all()
    stats = store.store.stats
    assert stats["injected"] > 5 and stats["retried_calls"] > 0
    assert len(plain.applied()) == 4 and not plain.quarantined()
    assert plain.head(0).version >= 2
    assert [i.step_count for i in islands] == [8, 8]
    events = plain.read_metrics("chaos")
    errors = [e for e in events if e["event"] == "storage_error"]
    assert len(errors) == stats["injected"]
    assert [e["event"] for e in events].count("storage_faults") == 1


def test_chaos_store_is_off_by_default():
    cfg = small_config("chaos-off")
    store = new_store(cfg)
    assert chaos_store(store, cfg.chaos) is store


# -- islands ----------------------------------------------------------------------------------


def test_slow_island_sleeps_in_proportion_and_records_once():
    events, slept = [], []
    chaos = IslandChaos("a", events.append, slow_factor=3.0, sleep=slept.append)
    chaos.after_step(0.5)
    chaos.after_step(0.25)
    assert slept == [1.0, 0.5] and chaos.slowed_s == pytest.approx(1.5)
    assert [e["event"] for e in events] == ["slow"] and events[0]["factor"] == 3.0


def test_stall_is_due_after_stall_after_s():
    now = [0.0]
    chaos = IslandChaos("a", [].append, stall_after_s=10.0, clock=lambda: now[0])
    assert not chaos.stall_due()
    now[0] = 10.0
    assert chaos.stall_due()


def test_for_island_picks_the_configured_islands():
    cfg = small_config(
        "chaos-pick", chaos={"slow_island": "b", "slow_factor": 2.0, "stall_island": "a"}
    )
    store = new_store(cfg)
    a, b = IslandChaos.for_island(cfg, "a", store), IslandChaos.for_island(cfg, "b", store)
    assert (a.slow_factor, a.stall_after_s) == (None, 30.0)
    assert (b.slow_factor, b.stall_after_s) == (2.0, None)
    assert IslandChaos.for_island(small_config("x"), "a", store) is None


def test_stalled_island_stops_stepping_and_heartbeating_until_stopped():
    cfg = small_config("chaos-stall", chaos={"stall_island": "a", "stall_after_s": 0.0})
    store = new_store(cfg)
    isl = Island(cfg, "a", store, chaos=IslandChaos.for_island(cfg, "a", store))
    seen_during_stall = []

    def nap(seconds: float) -> None:  # the stall's wait: look at the store, then "SIGTERM"
        seen_during_stall.append(dict(store.heartbeats()))
        if len(seen_during_stall) == 3:
            isl._stop = True  # what the SIGTERM handler does

    isl.chaos.sleep = nap
    isl.run()
    assert seen_during_stall == [{}, {}, {}]  # silent while stalled, until stopped
    assert isl.step_count == 0
    events = store.read_metrics("chaos")
    assert [(e["event"], e["island"]) for e in events] == [("stall", "a")]
    # a restarted process does not stall again
    assert IslandChaos.for_island(cfg, "a", store) is None


def test_an_island_built_without_chaos_runs_no_chaos_code(monkeypatch):
    # the config names island a for a slow-down and a stall, but chaos is the entry point's
    # to hand over: an island built without it never calls into training/faults/chaos.py
    cfg = small_config(
        "chaos-none", chaos={"slow_island": "a", "slow_factor": 3.0, "stall_island": "a"}
    )
    store = new_store(cfg)

    def touched(*_, **__):
        raise AssertionError("chaos code ran")

    for method in ("for_island", "after_step", "stall_due", "stall"):
        monkeypatch.setattr(IslandChaos, method, touched)
    isl = Island(cfg, "a", store)
    assert isl.run(max_steps=2)["step"] == 2


# -- kills ------------------------------------------------------------------------------------


class _VirtualStop(threading.Event):
    """A stop event whose wait advances a fake clock instead of sleeping."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def wait(self, timeout=None):
        self.clock.t += timeout or 0.0
        return self.is_set()


def test_monkey_kills_at_the_seeded_times_the_seeded_victims():
    chaos = ChaosConfig(kill_mtbi_s=0.25, max_kills=4, seed=11)
    clock = FakeClock(0.0)
    procs: dict[str, subprocess.Popen] = {}
    killed: list[subprocess.Popen] = []
    kill_at: list[float] = []

    def pids():
        for name in ("x", "y", "z"):  # a runner: keep three processes alive
            p = procs.get(name)
            if p is None or p.poll() is not None:
                if p is not None:
                    killed.append(p)
                procs[name] = subprocess.Popen(
                    [sys.executable, "-c", "import time; time.sleep(60)"]
                )
        return {n: p.pid for n, p in procs.items()}

    def kill(pid: int, sig: int) -> None:  # a real SIGKILL, at a virtual time
        kill_at.append(clock.t)
        os.kill(pid, sig)
        next(p for p in procs.values() if p.pid == pid).wait()

    pids()
    events = []
    try:
        kills = run_monkey(
            pids, chaos, events.append, stop=_VirtualStop(clock), clock=clock, kill=kill
        )
        pids()  # the runner notices the last victim
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    due = kill_times(0.25, 11)
    assert kill_at == pytest.approx([next(due) for _ in range(4)])
    assert len(kills) == 4 and events == kills
    choose = victim_chooser(11)
    assert [k["island"] for k in kills] == [choose(["x", "y", "z"]) for _ in range(4)]
    assert len(killed) == 4 and all(p.returncode == -9 for p in killed)
    assert all(k["event"] == "kill" and "at" in k for k in kills)


def test_monkey_stops_on_request_and_without_mtbi():
    assert run_monkey(lambda: {"x": 1}, ChaosConfig(), [].append) == []
    stop = threading.Event()
    stop.set()
    assert run_monkey(lambda: {"x": 1}, ChaosConfig(kill_mtbi_s=5.0), [].append, stop=stop) == []


# -- merge ------------------------------------------------------------------------------------


def test_merge_kill_is_armed_once_and_validated():
    cfg = small_config("chaos-merge", chaos={"kill_merge_at": "global.before-cas@2"})
    store = new_store(cfg)
    plan = FaultPlan({"island.step": 3})
    armed = arm_merge_kill(cfg, store, plan)
    assert armed.plan == {"island.step": 3, "global.before-cas": 2}
    assert plan.plan == {"island.step": 3}  # a new plan: the entry point's is left as it was
    assert arm_merge_kill(cfg, store, plan) is plan  # already armed once in this experiment
    assert arm_merge_kill(cfg, store, None) is None
    [event] = store.read_metrics("chaos")
    assert (event["event"], event["point"], event["nth"]) == ("merge_kill", "global.before-cas", 2)
    with pytest.raises(ConfigError):
        small_config("x", chaos={"kill_merge_at": "island.step"})
    with pytest.raises(ConfigError):
        small_config("x", chaos={"stall_island": "nope"})


def test_a_merge_process_store_carries_the_armed_plan_through_the_chaos_wrap():
    cfg = small_config(
        "chaos-plan",
        chaos={"kill_merge_at": "ledger.partial", "storage_latency_s": 0.001},
    )
    plan = FaultPlan({"merge.after-read": 5})
    store = new_store(cfg).with_faults(plan)
    merge_store = for_process(cfg, store, "merge")
    assert isinstance(merge_store.store, ChaosStore)  # storage faults: the store is wrapped
    assert merge_store.faults.plan == {"merge.after-read": 5, "ledger.partial": 1}
    assert store.faults is plan and plan.plan == {"merge.after-read": 5}
    island_store = for_process(cfg, store, "island")  # an island's store: the plan as it was
    assert island_store.faults is plan


_MERGE_SCRIPT = """
import sys
from training.faults.chaos import for_process
from training.config.experiment import parse_config
from training.merge.merger import Merger
from training.store.experiment import ExperimentStore
from training.store.registry import open_store
store = ExperimentStore(open_store(sys.argv[1]), "chaos-mk")
cfg = parse_config(store.read_config())
Merger(cfg, for_process(cfg, store, "merge")).merge_all()
"""


@pytest.mark.integration
def test_merge_process_is_killed_at_the_point_and_the_next_one_recovers(tmp_path):
    # no grace floor: each one-shot merge process applies a's publish at once (b never comes)
    cfg = small_config(
        "chaos-mk", chaos={"kill_merge_at": "global.after-cas"}, outer={"grace_min_steps": 0.0}
    )
    url = f"file://{tmp_path}/store"
    store = ExperimentStore(open_store(url), cfg.name)
    store.write_config(json.loads(cfg.to_json()))
    initial_version(cfg, store)
    isl = Island(cfg, "a", store)
    isl.start()
    for _ in range(4):
        isl.step()
    env = dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_FAULTS="")
    cmd = [sys.executable, "-c", _MERGE_SCRIPT, url]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr[-2000:]
    assert store.head(0).version == 1 and not store.applied()  # swapped, ledger not written
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert store.applied() == {"a/00000000-f000": 1}  # repaired, applied exactly once
    assert [e["event"] for e in store.read_metrics("chaos")] == ["merge_kill"]
