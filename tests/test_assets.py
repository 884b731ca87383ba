"""Asset events (plugins/diloco_airflow/assets.py): the watcher's pure rule, its poll loop on a
real local store, the payloads a consumer reads, the export's idempotence. The events on a real
Airflow (the watcher in the triggerer, finalize's outlet, the example DAG run they trigger) are
checked in tests/test_installed.py."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from diloco_airflow import assets, exports

from tests.helpers import new_store, small_config

URL = "file:///s"


def _rec(loss: float, dirs: list[str], tokens: int = 100) -> dict:
    return {
        "loss": loss,
        "versions": [int(d[1:]) for d in dirs],
        "dirs": dirs,
        "tokens_merged": tokens,
    }


def test_store_uri_is_absolute_and_has_no_trailing_slash(tmp_path):
    assert assets.store_uri(f"{tmp_path}/") == f"file://{tmp_path}"
    assert assets.store_uri("gs://bucket/prefix/") == "gs://bucket/prefix"


def test_a_new_best_is_one_event_and_moves_the_cursor():
    events, cursor = assets.new_events(URL, {}, {"a": _rec(2.0, ["v1"])})
    assert [(e["event"], e["experiment"], e["loss"]) for e in events] == [("best", "a", 2.0)]
    assert cursor == {"a": assets.snapshot_id(_rec(2.0, ["v1"]))}


def test_an_unchanged_best_is_no_event():
    _, cursor = assets.new_events(URL, {}, {"a": _rec(2.0, ["v1"])})
    assert assets.new_events(URL, cursor, {"a": _rec(2.0, ["v1"])}) == ([], cursor)


def test_only_the_experiment_whose_best_moved_gets_an_event():
    _, cursor = assets.new_events(URL, {}, {"a": _rec(2.0, ["v1"]), "b": _rec(3.0, ["v4"])})
    events, _ = assets.new_events(URL, cursor, {"a": _rec(1.5, ["v2"]), "b": _rec(3.0, ["v4"])})
    assert [(e["experiment"], e["versions"]) for e in events] == [("a", [2])]


def test_a_deleted_experiment_leaves_the_cursor():
    _, cursor = assets.new_events(URL, {}, {"a": _rec(2.0, ["v1"]), "b": _rec(3.0, ["v4"])})
    assert set(assets.new_events(URL, cursor, {"a": _rec(2.0, ["v1"])})[1]) == {"a"}


def test_the_payload_names_the_experiment_url_and_stays_small():
    (event,), _ = assets.new_events("gs://b/p", {}, {"e1": _rec(2.0, ["v1"] * 64)})
    assert event["experiment_url"] == "gs://b/p/e1" and "dirs" not in event
    assert len(json.dumps(event)) < 1024  # 64 fragments: versions only, no directory names


def _ev(extra):
    return SimpleNamespace(extra=extra)


def test_payloads_of_reads_trigger_and_outlet_events_newest_last():
    best1 = assets.payload("best", URL, "a", _rec(2.0, ["v1"]))
    best2 = assets.payload("best", URL, "a", _rec(1.0, ["v2"]))
    done = assets.payload("finished", URL, "a", {**_rec(1.0, ["v2"]), "over": True})
    events = {
        "asset": [
            _ev({"from_trigger": True, "payload": best1}),
            _ev({"from_trigger": True, "payload": best2}),
            _ev(done),
            _ev({"something": "else"}),
        ]
    }
    got = assets.payloads_of(events)
    assert [(p["event"], p["loss"]) for p in got] == [("best", 1.0), ("finished", 1.0)]
    assert got[1]["over"] is True


def _collect(monkeypatch, trigger, n: int, between, timeout_s: float = 20.0) -> list[dict]:
    """The first `n` events of `trigger.run()`; `between()` runs once its first poll (the
    baseline) has returned: an event set by that poll, not a sleep."""
    polled = threading.Event()
    observe = assets.observe

    def observed(url):
        out = observe(url)
        polled.set()
        return out

    monkeypatch.setattr(assets, "observe", observed)

    async def go():
        out, gen = [], trigger.run()
        task = asyncio.ensure_future(gen.__anext__())
        assert await asyncio.to_thread(polled.wait, timeout_s), "no first poll"
        await asyncio.to_thread(between)
        while len(out) < n:
            out.append((await asyncio.wait_for(task, timeout_s)).payload)
            task = asyncio.ensure_future(gen.__anext__())
        task.cancel()
        return out

    return asyncio.run(go())


def test_the_watcher_reports_a_best_recorded_after_it_started_not_before(tmp_path, monkeypatch):
    url = tmp_path.as_uri()
    old = new_store(small_config("old"), url)
    old.offer_best(_rec(3.0, ["v0"]))  # exists before the watcher: not news
    run = new_store(small_config("run"), url)
    trigger = assets.ModelEventTrigger(store_url=url, poll_s=0.05)
    (event,) = _collect(monkeypatch, trigger, 1, lambda: run.offer_best(_rec(2.5, ["v3"])))
    assert (event["experiment"], event["loss"], event["versions"]) == ("run", 2.5, [3])


def test_an_unreadable_best_does_not_silence_the_others(tmp_path, monkeypatch):
    url = tmp_path.as_uri()
    bad, good = new_store(small_config("bad"), url), new_store(small_config("good"), url)
    trigger = assets.ModelEventTrigger(store_url=url, poll_s=0.05)

    def record():
        (tmp_path / "bad" / "snapshots").mkdir(parents=True, exist_ok=True)
        (tmp_path / "bad" / "snapshots" / "BEST.json").write_bytes(b"\x00 not json")
        good.offer_best(_rec(2.0, ["v1"]))

    (event,) = _collect(monkeypatch, trigger, 1, record)
    assert event["experiment"] == "good"
    assert bad.experiment == "bad"


def test_the_trigger_serializes_to_its_own_class_and_kwargs():
    trigger = assets.ModelEventTrigger(store_url=URL, poll_s=7)
    path, kwargs = trigger.serialize()
    assert path == "diloco_airflow.assets.ModelEventTrigger"
    assert assets.ModelEventTrigger(**kwargs).serialize() == (path, kwargs)


def test_an_exported_snapshot_is_not_exported_again(tmp_path):
    url = (tmp_path / "store").as_uri()
    estore = new_store(small_config("e"), url)
    estore.offer_best(_rec(2.0, ["v1"]))
    done = tmp_path / "out" / "e" / f"best-{assets.snapshot_id(_rec(2.0, ['v1']))}"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    got = exports.export_best(url, "e", tmp_path / "out")
    assert (got["exported"], got["out"]) == (False, str(done))


def test_an_experiment_without_best_is_refused_in_one_line(tmp_path):
    url = (tmp_path / "store").as_uri()
    new_store(small_config("e"), url)
    with pytest.raises(RuntimeError, match="no snapshots/BEST.json"):
        exports.export_best(url, "e", tmp_path / "out")
