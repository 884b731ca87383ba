"""`diloco replay` (training/merge/replay.py): every version of a run with quarantines, stale
and summed contributions, a final group and a restore of BEST re-derived bit for bit; a
tampered version or contribution reported at exactly that version; a collected contribution
reported as such; the CLI on a file:// store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import FakeClock, new_store, random_delta, small_config, tamper_params
from training.codecs import host as codecs
from training.merge import replay
from training.merge.merger import Merger

ROOT = Path(__file__).resolve().parents[1]


def _cfg(method="decoupled", anchor="now"):
    return small_config(
        islands=("a", "b", "c"),
        codec="int4",
        fragments={"count": 2},
        outer={"method": method, "anchor": anchor, "max_grace_s": 5.0},
    )


def _publish(cfg, store, island, seq, fragment, base, seed, final=False, scale=1e-2, nan=False):
    params = store.load_fragment(store.find_version(fragment, base)).params
    payload, _ = codecs.encode(random_delta(params, seed, scale), cfg.codec)
    if nan:  # a block scale: the payload's structure is fine, its values are not
        name = next(n for n in sorted(payload) if payload[n].dtype == np.float32)
        payload[name] = np.array(payload[name])
        payload[name].reshape(-1)[0] = np.nan
    manifest = dict(
        base_version=base,
        steps=2 + seed % 3,
        tokens=128 * (2 + seed % 3),
        loss=1.0,
        codec=cfg.codec,
        step_time_s=1.0,
        published_at=float(seq),
        final=final,
    )
    store.publish_pseudograd(island, seq, fragment, payload, manifest)


def _merge(merger, clock):
    """Merge until nothing is left, moving the virtual clock past every grace window."""
    for _ in range(20):
        r = merger.merge_once()
        if r.waiting_until is not None and not r.versions:
            clock.t = max(clock.t, r.waiting_until) + 1.0
            continue
        if not r.versions:
            return


def _run(cfg, url=None):
    """Three islands on two fragments: summed, stale (re-anchored) and final contributions, a
    NaN payload and an impossible base quarantined, BEST restored, merges after the restore."""
    store = new_store(cfg, url)
    clock = FakeClock(100.0)
    merger = Merger(cfg, store, clock=clock)
    seq = {"a": 0, "b": 0, "c": 0}

    def pub(island, fragment, base, **kw):
        seq[island] += 1
        _publish(cfg, store, island, seq[island], fragment, base, seq[island] * 7 + fragment, **kw)

    for p in (0, 1):
        for island in "abc":
            pub(island, p, 0)
    _merge(merger, clock)
    best = store.current_snapshot()
    for p in (0, 1):
        pub("a", p, 1)
        pub("a", p, 1)  # two pending of one island: one summed vote
        pub("b", p, 0)  # stale by one version: re-anchored at the fragment now
        pub("c", p, 1, nan=True)  # quarantined while its vote is read
    pub("b", 0, 1, final=True)  # a final interval: the second group
    seq["c"] += 1
    _publish(cfg, store, "c", seq["c"], 1, 1, 5)
    _merge(merger, clock)
    for p in (0, 1):
        for island in "abc":
            pub(island, p, store.head(p).version)
    _merge(merger, clock)
    store.restore_snapshot(best, "test")
    for p in (0, 1):
        pub("a", p, store.head(p).version)
        pub("c", p, store.head(p).version - 1)
    _merge(merger, clock)
    return store


@pytest.fixture(scope="module")
def run():
    cfg = _cfg()
    return cfg, _run(cfg)


def _lines(cfg, store, **kw):
    out = []
    code = replay.run(
        cfg, store, kw.get("fragment"), kw.get("to"), 1, kw.get("keep_going", False), out.append
    )
    return code, out


def test_the_run_has_what_the_replay_must_cover(run):
    cfg, store = run
    heads = [store.head(p).version for p in (0, 1)]
    manifests = store.list_fragment_versions(0)
    assert heads[0] >= 4 and heads[1] >= 4
    assert any("restored_from" in m for m in manifests)
    assert len(store.quarantine_ids()) >= 2
    assert any(c.get("reanchored") for m in manifests for c in m.get("contributions", ()))
    assert any(c["group"] == 1 for m in manifests for c in m.get("contributions", ()))


def test_every_version_of_every_fragment_replays_to_the_same_bits(run):
    cfg, store = run
    code, lines = _lines(cfg, store)
    assert (code, lines[-1]) == (0, f"replayed {len(lines) - 1} version(s): all bit-exact"), lines


def test_a_tampered_version_is_reported_at_exactly_that_version():
    cfg = _cfg()
    store = _run(cfg)
    name, index = tamper_params(store, 1, 2)
    code, lines = _lines(cfg, store, fragment=1)
    assert (code, lines[:-1]) == (
        1,
        [
            "fragment 1 version 1 (3 applied): ok",
            f"fragment 1 version 2 (4 applied): DIFFERS: params/{name}: max abs diff 1, "
            f"first at index {index}",
        ],
    )


def test_a_restore_that_is_not_the_version_it_names_is_reported():
    cfg = _cfg()
    store = _run(cfg)
    name, index = tamper_params(store, 0, 4)  # version 4 restored version 1
    code, lines = _lines(cfg, store, fragment=0)
    assert (code, lines[-2]) == (
        1,
        f"fragment 0 version 4 (restored from v1): DIFFERS: params/{name}: max abs diff 1, "
        f"first at index {index}",
    )


def test_a_tampered_contribution_is_reported_at_the_version_that_applied_it():
    cfg = _cfg()
    store = _run(cfg)
    applied = store.list_fragment_versions(0)[2]["applied"]
    victim = applied[0]
    ref = store.pseudograd(victim)
    key = store.object_key(ref.payload_key)
    data = bytearray(store.store.read(key))
    data[-1] ^= 1
    store.store.write(key, bytes(data))
    code, lines = _lines(cfg, store, fragment=0)
    assert code == 1 and lines[-2].startswith("fragment 0 version 2 ("), lines
    assert f"DIFFERS: contribution {victim} left out of its vote now" in lines[-2]


def test_a_collected_contribution_cannot_be_replayed_and_keep_going_goes_on():
    cfg = _cfg()
    store = _run(cfg)
    store.collect_garbage(store.plan_gc(keep_last=2))  # versions 1-3 and their contributions
    victim = store.list_fragment_versions(0)[1]["applied"][0]
    code, lines = _lines(cfg, store, fragment=0, keep_going=True)
    assert (code, lines[0], len(lines)) == (
        1,
        f"fragment 0 version 1 (3 applied): CANNOT: contribution {victim} was collected",
        store.head(0).version + 1,
    ), lines


def test_the_cli_replays_a_file_store_and_exits_2_on_a_bad_fragment(tmp_path):
    cfg = _cfg(method="nesterov", anchor="base")
    _run(cfg, f"file://{tmp_path}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "plugins")]))
    base = [sys.executable, "-m", "training.cli", "replay", "--store", str(tmp_path)]
    base += ["--experiment", cfg.name]
    done = subprocess.run(base, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith("all bit-exact")
    bad = subprocess.run(
        [*base, "--fragment", "7"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (bad.returncode, bad.stderr.strip()) == (
        2,
        "diloco replay: error: fragment 7 out of range (P = 2)",
    )


@pytest.mark.slow
def test_a_chaos_run_with_kills_and_a_restore_replays_to_the_same_bits(monkeypatch):
    """The chaos benchmark's run (production Island and Merger on a virtual clock, islands
    killed and restarted from their checkpoints), then an earlier snapshot restored."""
    from tests.helpers import SMALL_MODEL
    from training.bench import chaos
    from training.store.experiment import ExperimentStore

    opened = []
    monkeypatch.setattr(
        chaos,
        "open_store",
        lambda url, _open=chaos.open_store: opened.append(_open(url)) or opened[-1],
    )
    p = chaos.BenchParams(H=4, batch_size=4, recovery_s=20.0)
    overrides = {"model": SMALL_MODEL, "data.seq_len": 32, "data.eval_batches": 1}
    overrides.update({"fragments.count": 2, "codec": "int4"})
    cfg = chaos.bench_config(True, p, tokens=4 * 24 * 4 * 32, overrides=overrides)
    out = chaos.run_one(cfg, 20.0, p)
    assert out["kills"] >= 2
    store = ExperimentStore(opened[0], cfg.name)
    snapshots = store.snapshots()
    # the snapshot's versions may be light (the default writes a full one every 8th): the
    # restore takes their params and outer state from the replay, as finalize does
    store.restore_snapshot(
        store.snapshot_of(snapshots[len(snapshots) // 2]), "test", replay.arrays_of(cfg, store)
    )
    code, lines = _lines(cfg, store)
    assert (code, lines[-1]) == (0, f"replayed {len(lines) - 1} version(s): all bit-exact"), lines


@pytest.mark.parametrize("rule", ["momentum", "age"])
def test_a_run_with_a_staleness_correction_replays_to_the_same_bits(rule):
    # outer.staleness corrects stale votes with the fragment's momentum (or its age) inside
    # apply_groups: replay runs the same code on the recorded state, so the bits must match
    cfg = small_config(
        islands=("a", "b", "c"),
        codec="int4",
        fragments={"count": 2},
        outer={"anchor": "now", "max_grace_s": 5.0, "staleness": rule},
    )
    store = _run(cfg)
    code, lines = _lines(cfg, store)
    assert (code, lines[-1]) == (0, f"replayed {len(lines) - 1} version(s): all bit-exact"), lines
