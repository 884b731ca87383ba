"""The merge at the real size: one fragment of a large model merged by the project's `Merger`,
measured, not derived (`diloco bench merge --at-size 12b:24`).

Per K (contributions per merge), a child process gets a store on local disk holding version 0
of the model's largest fragment only (random params; a 12b fragment at P = 24 is 524.3M
parameters) and times, each with its stages (training/merge/timing.py) and its peak RSS above
the process's baseline:
- `cold`: the first merge, the fragment read back from its full version 0;
- `warm`: the best of `--repeats` next merges (the state resident: the draining syncer);
- `promoted`: after the merger promoted its HEAD and was let go, a new merger's first merge
  (the state read from the promotion: a syncer task restarted on the same worker).
New contributions are published between merges, untimed (two encoded deltas, reused).

Each warm stage's floor is the bytes it reads and writes at this machine's memcpy speed
(measured in the same run, bytes read + written per second), for the default method
(decoupled, Nesterov momentum, the broadcast update): read 2 K b (payloads into memory), norms
K b, fold K b (the votes folded chunk by chunk into a scratch for the averaging step's norm:
the codes read, no accumulator written), outer 24 N + (K + 1) b (params, momentum and shadow
read and written, the codes read again and folded in L1, the update written: one pass,
native.c `fold_outer_encode_sq`), encode 0 (what that pass left: the payload's entries),
write 4 N + 2 b (the params' checksum of a light version, the update's checksum and write);
b one payload's bytes, N the fragment's parameters. Where a merge holds more than
combine.FOLD_BYTES of payloads (K = 16 int4 contributions of this fragment) the votes are
folded into an accumulator as they come instead: fold K b + 4 N, outer 28 N + b. `bytes_moved` (K payloads in, params and momentum in and
out, as the other merge rows count it) and the warm `seconds` make these rows a merge rate for
`diloco bench wan --merge-json`. The syncer sizing divides the paper's round (island steps of
1.85 s, H = 24, M = 4 islands, P = 24) by the measured merge times.

    diloco bench merge --at-size 12b:24 --ks 1 4 16 --codec int4 --json runs/merge_12b.json
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

PAPER = dict(step_s=1.85, H=24, M=4)  # the paper's profile (shared/ALGORITHM.md)
STAGE_ORDER = ("state", "read", "norms", "fold", "outer", "encode", "write")


def _cfg(preset: str, P: int, K: int, codec: str, threads: int):
    from training.config.experiment import parse_config

    return parse_config(
        {
            "name": "bench-merge-size",
            "model": {"preset": preset},
            "fragments": {"count": P, "strategy": "tensors"},
            "codec": codec,
            "outer": {"method": "decoupled", "quorum": 1, "max_grace_s": 0.0},
            "islands": [{"name": f"island-{m}"} for m in range(K)],
            "syncer": {"threads": threads},
            "token_budget": 10**15,
        }
    )


def _largest(cfg) -> tuple[int, dict]:
    from training.model.runtime import fragment_shapes

    frags = fragment_shapes(cfg)
    p = max(range(len(frags)), key=lambda i: sum(math.prod(s) for s in frags[i].values()))
    return p, frags[p]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_merge(merger) -> dict:
    """One `merger.merge_once()`: its seconds, contributions applied, stages, and peak RSS
    above the baseline before it (sampled every 2 ms: ru_maxrss would include start-up)."""
    baseline = rss_bytes()
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    result = merger.merge_once()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return dict(
        seconds=seconds,
        applied=len(result.applied),
        stages=dict(result.stages),
        peak_rss_bytes=max(0, max(peak[0], rss_bytes()) - baseline),
    )


def measure(preset: str, P: int, K: int, codec: str, repeats: int, threads: int, root: str):
    """The child: cold, warm (best of `repeats`) and promoted merges of K contributions."""
    import gc

    from training.codecs import host as codecs
    from training.merge import outer
    from training.merge.merger import Merger
    from training.store import merge_records as records
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    cfg = _cfg(preset, P, K, codec, threads)
    p, shapes = _largest(cfg)
    store = ExperimentStore(open_store(f"file://{root}"), cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    rng = np.random.default_rng(0)
    params = {
        n: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for n, s in shapes.items()
    }
    state = outer.init_state(cfg.outer, shapes)
    ms = records.MergeState(state.steps, state.seen, version_times={"0": time.time()})
    extra = dict(tokens_merged=0, merge_state=ms.to_json())
    store.publish_fragment(p, 0, params, outer.state_tensors(state), extra)
    del params, state
    payloads = []
    for seed in (1, 2):
        g = np.random.default_rng(seed)
        delta = {
            n: g.standard_normal(s, dtype=np.float32) * np.float32(1e-3) for n, s in shapes.items()
        }
        payloads.append(codecs.encode(delta, codec)[0])
        del delta
    payload_bytes = codecs.payload_nbytes(payloads[0])

    def publish(seq: int, base: int) -> None:
        for m in range(K):
            manifest = dict(
                base_version=base,
                steps=PAPER["H"],
                tokens=PAPER["H"] * cfg.data.seq_len * cfg.data.batch_size,
                codec=codec,
                step_time_s=PAPER["step_s"],
                published_at=time.time(),
                loss=1.0,
            )
            store.publish_pseudograd(f"island-{m}", seq, p, payloads[m % 2], manifest)

    def merge(merger, seq: int) -> dict:
        publish(seq, seq)
        got = timed_merge(merger)
        if got["applied"] != K:
            raise RuntimeError(f"a merge applied {got['applied']} of {K} contributions")
        return got

    merger = Merger(cfg, store, fragments=[p])
    out = dict(fragment=p, elems=sum(math.prod(s) for s in shapes.values()))
    out["payload_bytes"] = payload_bytes
    out["cold"] = merge(merger, 0)
    warm = [merge(merger, 1 + r) for r in range(repeats)]
    out["warm"] = min(warm, key=lambda w: w["seconds"])
    out["warm"]["peak_rss_bytes"] = max(w["peak_rss_bytes"] for w in warm)
    merger.promote_heads()
    del merger
    gc.collect()
    out["promoted"] = merge(Merger(cfg, store, fragments=[p]), 1 + repeats)
    # the process's peak (setup included: the state written, two payloads encoded)
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def floors(N: int, K: int, b: int, rate: float) -> dict[str, float]:
    """Each warm stage's bytes read + written at `rate` (see the module docstring)."""
    from training.merge.combine import FOLD_BYTES

    one_pass = K * b <= FOLD_BYTES  # else the votes are folded into an accumulator
    moved = dict(
        read=2 * K * b,
        norms=K * b,
        fold=K * b if one_pass else K * b + 4 * N,
        outer=24 * N + (K + 1) * b if one_pass else 28 * N + b,
        encode=0,
        write=4 * N + 2 * b,
    )
    return {k: v / rate for k, v in moved.items()}


def memcpy_rate(nbytes: int = 2**30, repeats: int = 3) -> float:
    """Bytes read + written per second by numpy copies between two touched buffers."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    dst.fill(0)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def sizing(warm: dict[int, float], P: int) -> list[dict]:
    """Shards for the paper's profile from the measured warm merge times per K: a round of
    H island steps brings each fragment M contributions; merged K at a time that is M / K
    merges per fragment per round, P fragments."""
    round_s = PAPER["H"] * PAPER["step_s"]
    rows = []
    for K, seconds in sorted(warm.items()):
        if PAPER["M"] < K:
            continue
        per_round = P * math.ceil(PAPER["M"] / K) * seconds
        rows.append(
            dict(
                K=K,
                merge_s=seconds,
                busy_s_per_round=per_round,
                round_s=round_s,
                shards=max(1, math.ceil(per_round / round_s)),
            )
        )
    return rows


def run(preset: str, P: int, ks: list[int], codec: str, repeats: int, threads: int) -> dict:
    rate = memcpy_rate()
    rows = []
    for K in ks:
        with tempfile.TemporaryDirectory(prefix="bench-merge-size-") as tmp:
            cmd = [
                sys.executable,
                "-m",
                "training.bench.merge_size",
                "--child",
                preset,
                str(P),
                str(K),
                codec,
                str(repeats),
                str(threads),
                f"{tmp}/store",
            ]
            done = subprocess.run(
                cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu")
            )
            if done.returncode != 0:
                raise RuntimeError(f"merge at size K={K} failed: {done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
        N, b = got["elems"], got["payload_bytes"]
        state_bytes = 3 * 4 * N  # params, momentum, broadcast shadow
        floor = floors(N, K, b, rate)
        for kind in ("cold", "warm", "promoted"):
            m = got[kind]
            rows.append(
                dict(
                    preset=preset,
                    fragments=P,
                    contributions=K,
                    codec=codec,
                    threads=threads,
                    kind=kind,
                    measured=True,
                    seconds=m["seconds"],
                    stages=m["stages"],
                    floors=floor if kind == "warm" else None,
                    floor_s=sum(floor.values()) if kind == "warm" else None,
                    peak_rss_bytes=m["peak_rss_bytes"],
                    state_bytes=state_bytes,
                    elems=N,
                    payload_bytes=b,
                    bytes_moved=K * b + 2 * 8 * N,
                    fragment_bytes=8 * N,
                    memcpy_bytes_per_s=rate,
                    max_rss_bytes=got["max_rss_bytes"],
                )
            )
        print(format_rows([r for r in rows if r["contributions"] == K]), flush=True)
    warm = {r["contributions"]: r["seconds"] for r in rows if r["kind"] == "warm"}
    return dict(rows=rows, sizing=sizing(warm, P), memcpy_bytes_per_s=rate)


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        stages = " ".join(f"{k} {r['stages'].get(k, 0.0):.2f}" for k in STAGE_ORDER)
        floor = (
            f" = {r['seconds'] / r['floor_s']:.1f}x floor {r['floor_s']:.2f} s"
            if r["floor_s"]
            else ""
        )
        lines.append(
            f"{r['preset']} P={r['fragments']} K={r['contributions']:<2d} {r['kind']:8s} "
            f"{r['seconds']:6.2f} s{floor}; peak {r['peak_rss_bytes'] / r['state_bytes']:.2f}x "
            f"state ({r['state_bytes'] / 2**30:.2f} GiB); {stages}"
        )
    return "\n".join(lines)


def format_table(out: dict) -> str:
    head = "| K | merge | seconds | x floor | " + " | ".join(STAGE_ORDER) + " | max RSS / state |"
    lines = [head, "|" + "---|" * (len(STAGE_ORDER) + 5)]
    for r in out["rows"]:
        x = f"{r['seconds'] / r['floor_s']:.1f}" if r["floor_s"] else ""
        stages = " | ".join(f"{r['stages'].get(k, 0.0):.2f}" for k in STAGE_ORDER)
        rss = f"{r['max_rss_bytes'] / r['state_bytes']:.2f}" if r["kind"] == "cold" else ""
        lines.append(
            f"| {r['contributions']} | {r['kind']} | {r['seconds']:.2f} | {x} | {stages} | {rss} |"
        )
        if r["kind"] == "warm":
            floor = " | ".join(f"{r['floors'].get(k, 0.0):.2f}" for k in STAGE_ORDER)
            lines.append(f"| {r['contributions']} | floor | {r['floor_s']:.2f} | 1.0 | {floor} | |")
    for s in out["sizing"]:
        lines.append(
            f"\nK = {s['K']}: {s['merge_s']:.2f} s per merge, {s['busy_s_per_round']:.1f} s "
            f"of merging per {s['round_s']:.1f} s round -> {s['shards']} shard(s)"
        )
    return "\n".join(lines)


def child(argv: list[str]) -> int:
    preset, P, K, codec, repeats, threads, root = argv
    out = measure(preset, int(P), int(K), codec, int(repeats), int(threads), root)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    sys.exit("run as `diloco bench merge --at-size PRESET:P`")
