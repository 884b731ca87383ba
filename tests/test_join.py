"""Islands join a running experiment (config.json by compare-and-swap) and leave it (stop)."""

from __future__ import annotations

import json
import threading

import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from tests.helpers import new_store, publish_delta, random_delta, small_config, small_dag_params
from training.config.experiment import ConfigError, join_islands, parse_config
from training.merge.merger import Merger
from training.store.experiment import ExperimentStore
from training.usecases.create import add_islands


def _cfg(num_shards=None, islands=("a", "b"), **sections):
    data = {"num_shards": num_shards} if num_shards else {}
    return small_config("join", islands=islands, data=data, **sections)


def _dict(cfg) -> dict:
    return json.loads(cfg.to_json())


# ------------------------------------------------------------------ the rule (training.config.experiment)
def test_join_takes_the_lowest_free_shard_and_keeps_everything_else():
    existing = _dict(_cfg(num_shards=4))
    joined = join_islands(existing, [{"name": "c"}, {"name": "d", "speed": 2.0}])
    assert {k: v for k, v in joined.items() if k != "islands"} == {
        k: v for k, v in existing.items() if k != "islands"
    }
    assert joined["islands"][:2] == existing["islands"]  # positions (default shards) unchanged
    cfg = parse_config(joined)
    assert [cfg.shard_of(n) for n in "abcd"] == [0, 1, 2, 3]
    assert cfg.island("d").speed == 2.0 and cfg.num_shards == 4


def test_join_with_an_explicit_free_shard():
    existing = _dict(_cfg(num_shards=5))
    cfg = parse_config(join_islands(existing, [{"name": "c", "shard": 4}, {"name": "d"}]))
    assert cfg.shard_of("c") == 4 and cfg.shard_of("d") == 2


@pytest.mark.parametrize(
    "num_shards, islands, error",
    [
        (None, [{"name": "c"}], "data.num_shards is unset"),
        (2, [{"name": "c"}], "no free data shard"),
        (3, [{"name": "c"}, {"name": "d"}], "no free data shard for 'd'"),
        (4, [{"name": "c", "shard": 1}], "shard 1 is taken"),
        (4, [{"name": "c", "shard": 4}], "shard 4 >= data.num_shards 4"),
        (4, [{"name": "c"}, {"name": "c"}], "listed twice"),
        (
            4,
            [{"name": "a", "speed": 3.0}],
            "island 'a' is in experiment 'join' with another 'speed'",
        ),
        (4, [{"name": "Bad"}], "invalid island"),
        (4, [{"name": "c", "backend": "mainframe"}], "invalid island"),
    ],
)
def test_join_refusals_are_one_line(num_shards, islands, error):
    with pytest.raises(ConfigError, match=error) as err:
        join_islands(_dict(_cfg(num_shards=num_shards)), islands)
    assert "\n" not in str(err.value)


def test_asking_again_for_known_islands_is_a_no_op():
    existing = _dict(_cfg(num_shards=4))
    once = join_islands(existing, [{"name": "c"}])
    assert join_islands(once, [{"name": "c"}, {"name": "a"}]) is once  # shard unset: any
    assert join_islands(once, [{"name": "c", "shard": 2}]) is once
    with pytest.raises(ConfigError, match="another 'shard'"):
        join_islands(once, [{"name": "c", "shard": 3}])


# ------------------------------------------------------------------ the store
@pytest.fixture(params=BACKENDS)
def estore(request, tmp_path) -> ExperimentStore:
    store = ExperimentStore(open_backend(request.param, request, tmp_path), "join")
    store.write_config(_dict(_cfg(num_shards=6)))
    return store


def test_add_islands_updates_config_by_compare_and_swap(estore):
    before = estore.read_config()
    after = add_islands(estore, [{"name": "c"}])
    assert estore.read_config() == after
    assert [i["name"] for i in after["islands"]] == ["a", "b", "c"]
    assert after["islands"][2]["shard"] == 2
    assert add_islands(estore, [{"name": "c"}]) == after  # repeat: no-op
    with pytest.raises(ConfigError):
        add_islands(estore, [{"name": "c", "backend": "gke"}])
    assert {k: v for k, v in after.items() if k != "islands"} == {
        k: v for k, v in before.items() if k != "islands"
    }
    # write_config stays create-only: the joined config is not "the same content" any more
    from training.store.experiment import ExperimentExists

    with pytest.raises(ExperimentExists):
        estore.write_config(before)


def test_racing_joins_all_land(estore):
    errors = []

    def join(name):
        try:
            add_islands(estore, [{"name": name}])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(n,)) for n in ("c", "d", "e", "f")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    cfg = parse_config(estore.read_config())
    assert sorted(i.name for i in cfg.islands) == list("abcdef")
    assert sorted(cfg.shard_of(i.name) for i in cfg.islands) == list(range(6))
    with pytest.raises(ConfigError, match="no free data shard"):
        add_islands(estore, [{"name": "g"}])


def test_stopped_islands_lists_stop_markers(estore):
    assert estore.stopped_islands() == set()
    estore.request_stop("b")
    estore.request_stop(None)  # the experiment-wide marker is not an island
    assert estore.stopped_islands() == {"b"}
    estore.clear_stop("b")
    assert estore.stopped_islands() == set()


# ------------------------------------------------------------------ the merger takes them in
def test_sync_merge_waits_for_a_joined_island_and_lets_a_departed_one_go():
    cfg = _cfg(num_shards=4, outer={"method": "sync"})
    store = new_store(cfg)
    theta = store.load_params()
    joined = parse_config(add_islands(store, [{"name": "c"}]))
    for island, seed in (("a", 1), ("b", 2)):
        publish_delta(store, cfg, island, 0, random_delta(theta, seed))
    merger = Merger(joined, store)  # a merge task reads the config afresh: it knows c
    assert all(r.version is None for r in merger.merge_all())  # sync waits for c
    publish_delta(store, cfg, "c", 0, random_delta(theta, 3))
    assert merger.merge_all()[0].applied == [
        "a/00000000-f000",
        "b/00000000-f000",
        "c/00000000-f000",
    ]

    # c leaves: `diloco stop --island c`; the island then exits and marks itself done
    store.request_stop("c")
    store.mark_done("c", {"step": 4})
    for island, seed in (("a", 4), ("b", 5)):
        publish_delta(store, cfg, island, 1, random_delta(theta, seed), base_version=1)
    assert merger.merge_all()[0].applied == ["a/00000001-f000", "b/00000001-f000"]


def test_sync_merge_lets_a_stopped_dead_island_go():
    cfg = _cfg(num_shards=4, outer={"method": "sync"})
    store = new_store(cfg)
    theta = store.load_params()
    store.request_stop("b")  # b is dead: nothing will write its done marker
    publish_delta(store, cfg, "a", 0, random_delta(theta, 1))
    assert Merger(cfg, store).merge_all()[0].applied == ["a/00000000-f000"]


def test_a_joined_island_trains_and_its_pseudograds_are_merged():
    from training.island.process import Island

    cfg = _cfg(num_shards=3, outer={"method": "nesterov"})
    store = new_store(cfg)
    joined = parse_config(add_islands(store, [{"name": "c"}]))
    info = Island(joined, "c", store).run(max_steps=8)  # H = 4: two publishes
    assert info["publishes"] == 2
    assert [r.id for r in store.list_pseudograds("c")] == ["c/00000000-f000", "c/00000001-f000"]
    Merger(joined, store).merge_all()
    assert set(store.applied()) == {"c/00000000-f000", "c/00000001-f000"}


# ------------------------------------------------------------------ the DAG's init task
@pytest.fixture
def init(monkeypatch):
    from diloco_airflow import experiment_setup

    registered = []
    monkeypatch.setattr(
        experiment_setup,
        "register_experiment",
        lambda url, name, entries: registered.append(entries),
    )
    return experiment_setup.init_experiment, registered


def _params(store_url, islands, **overrides):
    return small_dag_params("dagjoin", store_url, islands, overrides)


def test_init_task_creates_then_joins(tmp_path, init):
    init_experiment, registered = init
    url = f"file://{tmp_path}/store"
    first = init_experiment(_params(url, ["a", "b"]))
    assert [e["name"] for e in first["local"]] == ["a", "b"]
    # trigger again with the same name and a new island: only that island runs in this run
    second = init_experiment(_params(url, ["c"]))
    assert [e["name"] for e in second["local"]] == ["c"]
    from diloco_airflow.store import open_experiment

    cfg = parse_config(open_experiment(url, "dagjoin").read_config())
    assert [i.name for i in cfg.islands] == ["a", "b", "c"] and cfg.shard_of("c") == 2
    assert open_experiment(url, "dagjoin").head(0).version == 0  # no second version 0
    # the same trigger again (a retry, a schedule): nothing changes
    before = open_experiment(url, "dagjoin").read_config()
    again = init_experiment(_params(url, ["c"]))["local"]
    assert [(e["name"], e["spec"]["command"]) for e in again] == [
        (e["name"], e["spec"]["command"]) for e in second["local"]
    ]
    assert open_experiment(url, "dagjoin").read_config() == before
    assert len(registered) == 3


def test_init_task_refuses_other_settings_and_taken_shards(tmp_path, init):
    init_experiment, _ = init
    url = f"file://{tmp_path}/store"
    init_experiment(_params(url, ["a", "b"]))
    with pytest.raises(ConfigError, match="different 'inner'"):
        p = _params(url, ["c"])
        p["H"] = 8
        init_experiment(p)
    with pytest.raises(ConfigError, match="shard 0 is taken"):
        init_experiment(_params(url, ["a", "b"]) | {"islands": [{"name": "c", "shard": 0}]})
