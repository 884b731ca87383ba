"""`diloco bench syncer`: the syncer under load (issue 28 item 6).

Synthetic islands (no training) publish real int4 contributions, with their manifests and
heartbeats, at a set total rate to a store (`file://` on local disk, `gs://` on a fake-gcs-server
started here), while S production syncer shards (`training.merge.syncer.ShardSyncer`, one
process each, as on Airflow) merge them. Per (store, islands N, shards S) the rate doubles from
`--rate0` (at least the rate whose round is half of `--max-trial-s`) until a trial fails; the
row is the highest rate that passed.

A trial at rate r: island i publishes fragment p once a round, round = N x P / r seconds, the
contributions spread evenly over the round (island-major: the N islands' fragment-0
contributions, then fragment 1, ...), each based on its fragment's HEAD when published, for
`max(--trial-s, 2 rounds)` seconds (at most `--max-trial-s`). Then every island is marked done
and the shards drain and exit. It passes when every contribution was applied, none twice (the
versions' `applied` lists), and the p95 of publish-to-applied (the version's `merged_at` minus
the contribution's `published_at`) is under one round, and the publisher threads really offered
the rate (within 10%: above some rate this machine's cores cannot publish faster, and a trial
that did not offer its load says nothing about the syncer).

The payloads are encoded once per fragment (four variants) and re-published: the bench loads
the syncer, not the encoder. Everything runs on this machine's cores: the publisher threads, the
shard processes and fake-gcs-server share them, so the rates are this machine's, and S > cores
cannot scale.

The 12b columns are derived, not measured: the bytes a shard's merges moved per CPU second at
the row's highest rate (contributions read + versions written, from the run's manifests, over
the shard processes' CPU time after their imports) divided into what one fragment merge moves at
12B with P = 24: its 4 int4 contributions in, and out either a full version (params, momentum,
shadow, update in fp32: the store layout of today, docs/STORE.md) or one int4 update (layout 3,
issue 28). The paper's profile (M = 4 islands, a fragment of each island per ~1 s inner step)
needs about one fragment merge a second: the shards it needs are that many seconds, rounded up.

    diloco bench syncer --json runs/bench_syncer.json [--stores file gcs] [--islands 8 32 128]
        [--shards 1 2 4] [--preset tiny] [--fragments 4] [--rate0 4] [--trial-s 15]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from training.bench import merge as merge_bench

VARIANTS = 4  # encoded payloads per fragment, re-published in turn
PUBLISH_THREADS = 8
PROFILE_12B = dict(params=12e9, fragments=24, islands=4, merges_per_s=1.0)


def _cfg(preset: str, P: int, N: int, S: int, sets: dict | None = None):
    from training.config.experiment import with_overrides

    cfg = merge_bench._cfg(preset, P, N, "int4")
    return with_overrides(
        cfg,
        {
            "name": "bench-syncer",
            "syncer.shards": S,
            "syncer.poll_s": 0.2,
            "syncer.idle_s": 3600.0,
            "outer.grace_min_steps": 0.0,
            "outer.max_staleness": 1000,
            "tensorboard.enabled": False,
            **(sets or {}),
        },
    )


def _payloads(cfg, P: int) -> list[list[tuple[dict, int]]]:
    """Per fragment, VARIANTS int4 payloads of random deltas and their bytes."""
    from training.codecs import host as codecs

    rng = np.random.default_rng(0)
    out = []
    for shapes in merge_bench._fragment_shapes(cfg):
        variants = []
        for _ in range(VARIANTS):
            delta = {n: rng.normal(0, 1e-3, s).astype(np.float32) for n, s in shapes.items()}
            payload, _ = codecs.encode(delta, "int4")
            variants.append((payload, codecs.payload_nbytes(payload)))
        out.append(variants)
    return out


def schedule(N: int, P: int, rate: float, duration: float) -> list[tuple[float, int, int, int]]:
    """(time, island, fragment, seq) of every contribution of a trial, in time order: one every
    1/rate seconds, island-major within a fragment, fragments in turn; an island's seq counts
    its contributions."""
    out, seqs = [], [0] * N
    j = 0
    while j / rate < duration:
        i, p = j % N, (j // N) % P
        out.append((j / rate, i, p, seqs[i]))
        seqs[i] += 1
        j += 1
    return out


def shard_worker(url: str, experiment: str, shard: int) -> int:
    """One shard's syncer until the experiment is finished (every island done)."""
    from training.merge.syncer import ShardSyncer
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    estore = ExperimentStore(open_store(url), experiment)
    syncer = ShardSyncer(estore, shard, f"bench-{shard}-{os.getpid()}")
    cpu = time.process_time()  # after the imports: what the merging costs
    while syncer.drain().reason != "finished":
        time.sleep(0.2)
    print(json.dumps({"cpu_s": time.process_time() - cpu}), flush=True)
    return 0


def trial(url: str, preset: str, P: int, N: int, S: int, rate: float, a) -> dict:
    """One trial (module docstring); returns its numbers and `passed`."""
    from training.merge.merger import initial_version
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    cfg = _cfg(preset, P, N, S, getattr(a, "sets", None))
    store = ExperimentStore(open_store(url), cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    initial_version(cfg, store)
    payloads = _payloads(cfg, P)
    islands = [i.name for i in cfg.islands]
    round_s = N * P / rate
    duration = min(a.max_trial_s, max(a.trial_s, 2 * round_s))
    plan = schedule(N, P, rate, duration)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    shards = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "training.bench.syncer",
                "--shard-worker",
                url,
                cfg.name,
                str(s),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for s in range(S)
    ]
    late = []  # seconds each publish started after its scheduled time
    lock = threading.Lock()

    def publish(t0: float, item) -> None:
        at, i, p, seq = item
        wait = t0 + at - time.time()
        if wait > 0:
            time.sleep(wait)
        payload, _ = payloads[p][seq % VARIANTS]
        head = store.head(p)
        manifest = dict(
            base_version=head.version,
            steps=24,
            tokens=24 * 1024,
            codec="int4",
            step_time_s=1.0,
            published_at=time.time(),
            loss=1.0,
        )
        store.publish_pseudograd(islands[i], seq, p, payload, manifest)
        with lock:
            late.append(manifest["published_at"] - (t0 + at))

    try:
        t0 = time.time() + 1.0
        for name in islands:
            store.write_heartbeat(name, {"step": 0, "time": t0})
        with ThreadPoolExecutor(PUBLISH_THREADS) as pool:
            list(pool.map(lambda item: publish(t0, item), plan))
        published_until = time.time()
        for name in islands:
            store.mark_done(name, {"step": 0})
        cpu_s = 0.0
        for proc in shards:
            try:
                out, err = proc.communicate(timeout=max(120.0, 4 * duration))
            except subprocess.TimeoutExpired:
                proc.kill()
                raise RuntimeError("a shard did not finish its last drain") from None
            if proc.returncode:
                tail = err.decode(errors="replace")[-2000:]
                raise RuntimeError(f"a shard failed ({proc.returncode}): {tail}")
            cpu_s += json.loads(out.decode().strip().splitlines()[-1])["cpu_s"]
    finally:
        for proc in shards:
            if proc.poll() is None:
                proc.kill()
    out = _measure(store, P, plan, payloads, round_s, rate, duration, late, published_until - t0)
    out["shard_cpu_s"] = cpu_s
    sizes = [sum(math.prod(s) for s in f.values()) for f in merge_bench._fragment_shapes(cfg)]
    out["fragment_params"] = sum(sizes) / len(sizes)  # the mean fragment's, for derive_12b
    out["full_every"] = cfg.syncer.full_every
    return out


def _measure(store, P, plan, payloads, round_s, rate, duration, late, publish_s) -> dict:
    """The trial's numbers from the versions' manifests (the truth)."""
    from training.store.experiment import HeadPointer

    applied: dict[str, int] = {}
    twice = []
    latencies = []
    version_bytes = 0
    versions = 0
    read_bytes = 0
    for p in range(P):
        chain = store.list_fragment_versions(p)
        dirs = [m["parent_dir"] for m in chain[1:]] + [store.head(p).dir]
        for m, directory in list(zip(chain, dirs, strict=True))[1:]:
            versions += 1
            version_bytes += sum(int(v) for v in m.get("nbytes", {}).values())
            if m.get("full") is False:  # a full version written in the background: its bytes
                promoted = store.promotion(HeadPointer(p, m["version"], directory, 0), m)
                version_bytes += sum(n for _, n in promoted.sums.values()) if promoted else 0
            for pg in m["applied"]:
                if pg in applied:
                    twice.append(pg)
                applied[pg] = m["version"]
            for c in m.get("contributions", []):
                latencies.append(float(m["merged_at"]) - float(c["published_at"]))
                read_bytes += payloads[p][0][1]
    p50, p95 = (float(np.percentile(latencies, q)) for q in (50, 95)) if latencies else (0, 0)
    offered = len(plan) / publish_s if publish_s > 0 else 0.0
    # the load was really offered (the publisher threads kept the rate within 10%), all of it
    # applied once, and within a round
    ok = len(applied) == len(plan) and not twice and p95 < round_s and offered >= 0.9 * rate
    return dict(
        rate=rate,
        round_s=round_s,
        trial_s=duration,
        contributions=len(plan),
        applied=len(applied),
        applied_twice=len(twice),
        versions=versions,
        contributions_per_version=len(applied) / versions if versions else 0.0,
        p50_s=p50,
        p95_s=p95,
        publish_late_p95_s=float(np.percentile(late, 95)) if late else 0.0,
        publish_s=publish_s,
        offered_rate=offered,
        read_bytes=read_bytes,
        version_bytes=version_bytes,
        passed=ok,
    )


def search(backend: str, N: int, S: int, a, url_for, drop=lambda url: None) -> dict:
    """Double the rate from a.rate0 until a trial fails: the highest passing one is the row.
    Each trial's store is dropped after it (`drop(url)`: a file:// trial writes gigabytes)."""
    # start where a round is at most half the longest trial (two rounds fit in it)
    best, trials, rate = None, [], max(a.rate0, N * a.fragments / (a.max_trial_s / 2))
    while rate <= a.max_rate:
        url = url_for()
        try:
            t = trial(url, a.preset, a.fragments, N, S, rate, a)
        finally:
            drop(url)
        trials.append(t)
        print(_line(backend, N, S, t), flush=True)
        if not t["passed"]:
            break
        best = t
        rate *= 2
    return dict(store=backend, islands=N, shards=S, best=best, trials=trials)


def _line(backend: str, N: int, S: int, t: dict) -> str:
    verdict = "ok" if t["passed"] else "MISS"
    return (
        f"  {backend:4} N={N:<4d} S={S} rate {t['rate']:7.1f}/s round {t['round_s']:6.1f} s: "
        f"applied {t['applied']}/{t['contributions']} in {t['versions']} versions, "
        f"p50 {t['p50_s']:.2f} s p95 {t['p95_s']:.2f} s, twice {t['applied_twice']}, "
        f"offered {t['contributions'] / t['publish_s']:.1f}/s {verdict}"
    )


def derive_12b(row: dict) -> dict | None:
    """Seconds one shard would take per fragment merge at 12B, P = 24, from the bytes its
    merges moved per CPU second in this row's highest passing trial (contributions read +
    versions written, over the shard processes' CPU time: a shard is CPU-bound on local
    stores), for the store layout of today (a full version per merge), for layout 3 (only
    what must cross the wire: the contributions in, one int4 update out) and, when the trial
    ran with syncer.full_every = k > 1, for light versions (the update every merge, params,
    momentum and shadow every k-th); and `by_cpu`: the shard's CPU seconds per version scaled
    by fragment size (12B's over the trial's). The paper's profile needs about one fragment
    merge a second, so its shards are that many seconds, rounded up."""
    best = row.get("best")
    if not best or not best.get("shard_cpu_s"):
        return None
    per_cpu_s = (best["read_bytes"] + best["version_bytes"]) / best["shard_cpu_s"]
    frag = PROFILE_12B["params"] / PROFILE_12B["fragments"]
    k = PROFILE_12B["islands"]  # contributions per fragment merge (one per island and round)
    contributions = k * frag * 0.5  # int4
    layouts = {
        "today": contributions + 4 * frag * 4,  # params, momentum, shadow, update as fp32
        "layout3": contributions + frag * 0.5,  # one int4 update out
    }
    full_every = best.get("full_every", 1)
    if full_every > 1:  # light versions: the update every merge, a full version every k-th
        layouts["light"] = contributions + frag * 0.5 + 3 * frag * 4 / full_every
    out = {"bytes_per_cpu_s": per_cpu_s}
    if best.get("versions") and best.get("fragment_params"):
        # the shard's CPU per version, scaled by fragment size: an upper bound (a version's
        # fixed costs, its manifest, HEAD and ledger, do not grow with the fragment)
        seconds = best["shard_cpu_s"] / best["versions"] * frag / best["fragment_params"]
        out["by_cpu"] = dict(
            seconds_per_fragment_merge=seconds,
            shards_for_profile=math.ceil(seconds * PROFILE_12B["merges_per_s"]),
        )
    for name, nbytes in layouts.items():
        seconds = nbytes / per_cpu_s
        out[name] = dict(
            bytes_per_fragment_merge=nbytes,
            seconds_per_fragment_merge=seconds,
            shards_for_profile=math.ceil(seconds * PROFILE_12B["merges_per_s"]),
        )
    return out


def format_table(rows: list[dict]) -> str:
    out = [
        "| store | islands | shards | highest rate passed /s | round s | contributions / version "
        "| p50 / p95 s | first miss /s | 12B shards for the paper's profile: today / layout 3 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["best"]
        miss = next((t for t in r["trials"] if not t["passed"]), None)
        d = r.get("derived_12b")
        best = (
            f"{b['rate']:.0f} ({b['contributions'] / b['publish_s']:.0f} offered) | "
            f"{b['round_s']:.1f} | {b['contributions_per_version']:.1f} | "
            f"{b['p50_s']:.2f} / {b['p95_s']:.2f}"
            if b
            else "none | - | - | -"
        )
        first_miss = (
            "-"
            if miss is None
            else f"{miss['rate']:.0f} ({miss['contributions'] / miss['publish_s']:.0f} offered, "
            f"p95 {miss['p95_s']:.2f})"
        )
        shards = (
            "-"
            if d is None
            else f"{d['today']['shards_for_profile']} / {d['layout3']['shards_for_profile']}"
            + (f" (light: {d['light']['shards_for_profile']})" if "light" in d else "")
            + (f" (by CPU: {d['by_cpu']['shards_for_profile']})" if "by_cpu" in d else "")
        )
        out.append(
            f"| {r['store']} | {r['islands']} | {r['shards']} | {best} | {first_miss} | {shards} |"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--shard-worker"]:
        return shard_worker(argv[1], argv[2], int(argv[3]))
    ap = argparse.ArgumentParser(prog="diloco bench syncer", description=__doc__.split("\n")[0])
    ap.add_argument("--stores", nargs="+", default=["file", "gcs"], choices=("file", "gcs"))
    ap.add_argument("--islands", nargs="+", type=int, default=[8, 32, 128])
    ap.add_argument("--shards", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--rate0", type=float, default=4.0, help="first rate, contributions/s")
    ap.add_argument("--max-rate", type=float, default=512.0)
    ap.add_argument("--trial-s", type=float, default=15.0)
    ap.add_argument("--max-trial-s", type=float, default=60.0)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every trial, e.g. syncer.full_every=8",
    )
    a = ap.parse_args(argv)
    from training.config import experiment as config

    try:
        a.sets = config.parse_sets(a.set)
    except config.ConfigError as err:
        ap.error(str(err))
    if max(a.shards) > a.fragments:
        ap.error(f"--shards {max(a.shards)} > --fragments {a.fragments}: a shard would idle")
    rows = []
    for backend in a.stores:
        server, local = None, None
        if backend == "gcs":
            from training.bench.fetch import _start_server

            server = _start_server()  # sets STORAGE_EMULATOR_HOST (the shards inherit it)
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
            root = "gs://bench"
        else:
            local = tempfile.mkdtemp(prefix="bench-syncer-")
            root = "file://" + local

        def url_for(root: str = root) -> str:
            return f"{root}/syncer-{uuid.uuid4().hex[:8]}"

        def drop(url: str, local: str | None = local) -> None:
            if local is not None:
                shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)

        try:
            for N in a.islands:
                for S in a.shards:
                    row = search(backend, N, S, a, url_for, drop)
                    row["derived_12b"] = derive_12b(row)
                    rows.append(row)
                    if a.json_out:
                        _write(a, rows)
        finally:
            if server is not None:
                server.stop()
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)
    print(format_table(rows))
    if a.json_out:
        _write(a, rows)
    return 0


def _write(a, rows: list[dict]) -> None:
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in vars(a).items() if k != "json_out"}
    Path(a.json_out).write_text(json.dumps({"params": params, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
