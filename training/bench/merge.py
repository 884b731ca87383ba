"""Merge benchmark: one fragment merge of M contributions, against a memcpy of the same bytes.

Per (preset, P) row: a store on local disk gets version 0 and M int8 contributions to the
largest fragment (setup, in a child process); then a fresh child process times one
`Merger(fragments=[p]).merge_once()` ("cold": it reads the fragment from the store) and, after
publishing M more contributions each time, the same merger's next three merges ("warm", the
best of three: the draining syncer, which keeps the arrays of the version it published), each
with its peak RSS above the baseline before it; and a memcpy of the bytes a merge moves (M payloads in, the fragment's params and
outer state in and out) in the parent process. Peak RSS is sampled every millisecond.
`fragment_bytes` is the fragment's params + outer state (fp32). Rows for 1b and 12b are computed
from the largest measured row's throughput and peak ratio. Codec rows time each codec's encode
and decode of one 16M-element tensor (best of 5: into new arrays, as `codecs.decode`, and chunk by
chunk into one reused array, as the streaming merge) against a memcpy of its fp32 bytes between
two preallocated buffers (best of 5). `--json` is written after every measured row (a run cut
short keeps them) and whole at the end.

    diloco bench merge --json runs/bench_merge.json [--presets tiny small 125m] [--fragments 1 4 24]
    diloco bench merge --presets          # the codec rows only
    diloco bench merge ... --codec-elems 65536   # smaller codec rows (a quick check)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from training.bench import merge_size

COMPUTED = ("1b", "12b")
WARM_REPEATS = 3  # warm merges timed (the best is reported; the peak is the highest)
TARGET_WORKER_BYTES = 16 * 2**30


def _cfg(preset: str, P: int, M: int, codec: str):
    from training.config.experiment import parse_config

    return parse_config(
        {
            "name": "bench-merge",
            "model": {"preset": preset},
            "fragments": {"count": P, "strategy": "strided" if P == 1 else "tensors"},
            "codec": codec,
            "outer": {"method": "decoupled", "quorum": 1, "max_grace_s": 0.0},
            "islands": [{"name": f"island-{m}"} for m in range(M)],
            "token_budget": 10**12,
        }
    )


def _fragment_sizes(cfg) -> list[int]:
    from training.model import definition as model
    from training.model.runtime import fragment_names

    shapes = {k: v.shape for k, v in model.abstract_params(cfg.model).items()}
    return [sum(math.prod(shapes[n]) for n in names) for names in fragment_names(cfg)]


def _publish(store, cfg, p: int, M: int, codec: str, seq: int, base: int, rng) -> int:
    """M contributions (one per island) to fragment p; returns their payload bytes."""
    from training.codecs import host as codecs

    shapes = {n: s for n, s in _fragment_shapes(cfg)[p].items()}
    payload_bytes = 0
    for m in range(M):
        delta = {n: rng.normal(0, 1e-3, s).astype(np.float32) for n, s in shapes.items()}
        payload, _ = codecs.encode(delta, codec)
        payload_bytes += codecs.payload_nbytes(payload)
        manifest = dict(
            base_version=base,
            steps=24,
            tokens=24 * 1024,
            codec=codec,
            step_time_s=1.0,
            published_at=time.time(),
            loss=1.0,
        )
        store.publish_pseudograd(f"island-{m}", seq, p, payload, manifest)
        del delta, payload
    return payload_bytes


def _fragment_shapes(cfg) -> list[dict]:
    from training.model.runtime import fragment_shapes

    return fragment_shapes(cfg)


def setup(url: str, preset: str, P: int, M: int, codec: str) -> dict:
    """Version 0 and M contributions to the largest fragment; returns what the row needs."""
    from training.merge.merger import initial_version
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    cfg = _cfg(preset, P, M, codec)
    store = ExperimentStore(open_store(url), cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    initial_version(cfg, store)
    sizes = _fragment_sizes(cfg)
    p = int(np.argmax(sizes))
    payload_bytes = _publish(store, cfg, p, M, codec, 0, 0, np.random.default_rng(0))
    largest = max(math.prod(s) * 4 for s in _fragment_shapes(cfg)[p].values())
    return dict(fragment=p, fragment_elems=sizes[p], payload_bytes=payload_bytes, largest=largest)


def measure(url: str, preset: str, P: int, M: int, codec: str, fragment: int) -> dict:
    """Merges of `fragment` in this (fresh) process, each timed with its peak RSS above the
    baseline before it: `cold` reads the fragment from the store (a new merger process);
    `warm` (the best of WARM_REPEATS, the highest peak) is the same merger's next merge of M
    new contributions (the draining syncer: it keeps the arrays of the version it
    published). New contributions are published between merges, untimed."""
    from training.merge.merger import Merger
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    cfg = _cfg(preset, P, M, codec)
    store = ExperimentStore(open_store(url), cfg.name)
    merger = Merger(cfg, store, fragments=[fragment])
    out = {}
    for round_ in range(1 + WARM_REPEATS):
        kind = "cold" if round_ == 0 else "warm"
        if round_:
            _publish(store, cfg, fragment, M, codec, round_, round_, np.random.default_rng(round_))
        got = merge_size.timed_merge(merger)
        seconds, peak, applied = got["seconds"], got["peak_rss_bytes"], got["applied"]
        if applied != M:
            raise RuntimeError(f"{kind} merge applied {applied} of {M} contributions")
        best = out.get(kind, dict(seconds=math.inf, peak_rss_bytes=0))
        out[kind] = dict(
            seconds=min(best["seconds"], seconds),
            peak_rss_bytes=max(best["peak_rss_bytes"], peak),
        )
    return out


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Best of `repeats` copies of `nbytes` between two preallocated buffers (in chunks)."""
    chunk = min(nbytes, 256 * 2**20)
    src, dst = np.ones(chunk, np.uint8), np.empty(chunk, np.uint8)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(left, chunk)
            np.copyto(dst[:n], src[:n])
            left -= n
        best = min(best, time.perf_counter() - t)
    return best


def codec_rows(elems: int = 16 * 2**20, repeats: int = 5) -> list[dict]:
    """Encode (no residual) and decode of one `elems`-element float32 tensor per codec, best
    of `repeats`, against the best of `repeats` memcpys of its fp32 bytes in the same run."""
    from training.codecs import host as codecs

    x = np.random.default_rng(0).normal(size=elems).astype(np.float32)
    copy_s = memcpy_seconds(x.nbytes, repeats)
    out = np.empty_like(x)  # the merge's path: decoded chunk by chunk into reused memory
    out.fill(0)
    rows = []
    for codec in codecs.CODECS:
        enc = dec = into = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            payload, _ = codecs.encode({"x": x}, codec)
            enc = min(enc, time.perf_counter() - t)
            t = time.perf_counter()
            codecs.decode(payload, codec)
            dec = min(dec, time.perf_counter() - t)
            t = time.perf_counter()
            tensor = codecs.tensor_codes(payload, "x", codec)
            for s, e in codecs.chunk_spans(elems):
                codecs.decode_chunk(tensor, s, e, out[s:e])
            into = min(into, time.perf_counter() - t)
        rows.append(
            dict(
                codec=codec,
                elems=elems,
                encode_s=enc,
                decode_s=dec,
                decode_into_s=into,
                memcpy_s=copy_s,
                encode_vs_memcpy=copy_s / enc,
                decode_vs_memcpy=copy_s / dec,
                decode_into_vs_memcpy=copy_s / into,
            )
        )
    return rows


def run_row(preset: str, P: int, M: int, codec: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
        url = f"file://{tmp}/store"
        info = _child("setup", url, preset, P, M, codec)
        got = _child("measure", url, preset, P, M, codec, info["fragment"])
    fragment_bytes = 2 * 4 * info["fragment_elems"]  # params + momentum, fp32
    bytes_moved = info["payload_bytes"] + 2 * fragment_bytes
    copy_s = memcpy_seconds(bytes_moved)
    cold, warm = got["cold"], got["warm"]
    return dict(
        preset=preset,
        fragments=P,
        contributions=M,
        codec=codec,
        measured=True,
        seconds=cold["seconds"],
        bytes_moved=bytes_moved,
        memcpy_seconds=copy_s,
        vs_memcpy=cold["seconds"] / copy_s,
        peak_rss_bytes=cold["peak_rss_bytes"],
        fragment_bytes=fragment_bytes,
        largest_tensor_bytes=info["largest"],
        peak_vs_fragment=cold["peak_rss_bytes"] / fragment_bytes,
        warm_seconds=warm["seconds"],
        warm_vs_memcpy=warm["seconds"] / copy_s,
        warm_peak_rss_bytes=warm["peak_rss_bytes"],
    )


def computed_rows(measured: list[dict], fragments: list[int], M: int, codec: str) -> list[dict]:
    """1b / 12b rows from the largest measured row: its bytes/s and its peak / fragment ratio."""
    from training.codecs import host as codecs

    if not measured:
        return []
    ref = max(measured, key=lambda r: r["bytes_moved"])
    rate = ref["bytes_moved"] / ref["seconds"]
    warm_rate = ref["bytes_moved"] / ref.get("warm_seconds", ref["seconds"])
    per_elem = {
        "fp32": 4,
        "bf16": 2,
        "int8": 1 + 4 / codecs.DEFAULT_BLOCK,
        "int4": 0.5 + 4 / codecs.DEFAULT_BLOCK,
        "int2": 0.25 + 4 / codecs.DEFAULT_BLOCK,
    }[codec]
    rows = []
    for preset in COMPUTED:
        from training.config.experiment import ModelConfig
        from training.model import definition as model

        total = sum(
            math.prod(v.shape) for v in model.abstract_params(ModelConfig(preset=preset)).values()
        )
        for P in fragments:
            elems = total / P  # balanced over tensors: about even
            fragment_bytes = 8 * elems
            moved = M * per_elem * elems + 2 * fragment_bytes
            peak = ref["peak_vs_fragment"] * fragment_bytes
            rows.append(
                dict(
                    preset=preset,
                    fragments=P,
                    contributions=M,
                    codec=codec,
                    measured=False,
                    seconds=moved / rate,
                    warm_seconds=moved / warm_rate,
                    bytes_moved=int(moved),
                    fragment_bytes=int(fragment_bytes),
                    peak_rss_bytes=int(peak),
                    fits_16gb=peak < TARGET_WORKER_BYTES,
                    derived_from=f"{ref['preset']} P={ref['fragments']}",
                )
            )
    return rows


def _child(*args) -> dict:
    cmd = [sys.executable, "-m", "training.bench.merge", "--child", *map(str, args)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu")
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench child {args[0]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'preset':7s} {'P':>3s} {'M':>2s} {'seconds':>8s} {'x memcpy':>8s} {'warm s':>8s} "
        f"{'x memcpy':>8s} {'moved MB':>9s} {'frag MB':>8s} {'peak MB':>8s} {'peak/frag':>9s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        x = f"{r['vs_memcpy']:.1f}" if r.get("measured") else "(calc)"
        xw = f"{r['warm_vs_memcpy']:.1f}" if r.get("measured") else "(calc)"
        lines.append(
            f"{r['preset']:7s} {r['fragments']:3d} {r['contributions']:2d} {r['seconds']:8.3f} "
            f"{x:>8s} {r['warm_seconds']:8.3f} {xw:>8s} "
            f"{r['bytes_moved'] / 2**20:9.1f} {r['fragment_bytes'] / 2**20:8.1f} "
            f"{r['peak_rss_bytes'] / 2**20:8.1f} {r['peak_rss_bytes'] / r['fragment_bytes']:9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench merge", description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="*", default=["tiny", "small", "125m"])
    ap.add_argument("--fragments", nargs="+", type=int, default=[1, 4, 24])
    ap.add_argument("--contributions", type=int, default=4)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--codec-elems",
        type=int,
        default=16 * 2**20,
        help="elements of the tensor the codec rows encode and decode (default 16M)",
    )
    ap.add_argument(
        "--at-size",
        default=None,
        metavar="PRESET:P",
        help="measure the largest fragment of PRESET cut in P at its real size instead "
        "(training/bench/merge_size.py: cold, warm and promoted merges with their stages, "
        "e.g. 12b:24)",
    )
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16], help="with --at-size: K")
    ap.add_argument("--repeats", type=int, default=2, help="with --at-size: warm merges")
    ap.add_argument("--threads", type=int, default=1, help="with --at-size: syncer.threads")
    ap.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.at_size:
        return _at_size(ap, args)
    if args.codec_elems < 1:
        ap.error(f"--codec-elems must be >= 1, got {args.codec_elems}")
    if args.child:
        kind, url, preset, P, M, codec, *rest = args.child
        if kind == "setup":
            out = setup(url, preset, int(P), int(M), codec)
        else:
            out = measure(url, preset, int(P), int(M), codec, int(rest[0]))
        print(json.dumps(out))
        return 0
    rows = []
    for preset in args.presets:
        for P in args.fragments:
            try:
                _cfg(preset, P, args.contributions, args.codec)
                _fragment_sizes(_cfg(preset, P, args.contributions, args.codec))
            except ValueError as exc:
                print(f"{preset} P={P}: skipped ({str(exc).splitlines()[0]})", flush=True)
                continue
            row = run_row(preset, P, args.contributions, args.codec)
            print(
                f"{preset} P={P}: {row['seconds']:.3f} s, {row['vs_memcpy']:.1f}x memcpy "
                f"(warm {row['warm_seconds']:.3f} s, {row['warm_vs_memcpy']:.1f}x), "
                f"peak {row['peak_vs_fragment']:.2f}x fragment",
                flush=True,
            )
            rows.append(row)
            if args.json:  # after every row: a run cut short keeps the rows it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"rows": rows, "codecs": []}, indent=1))
    rows += computed_rows(
        [r for r in rows if r["measured"]], args.fragments, args.contributions, args.codec
    )
    codec_table = codec_rows(args.codec_elems)
    print(format_table(rows))
    for c in codec_table:
        print(
            f"codec {c['codec']}: encode {c['encode_vs_memcpy']:.0%} of memcpy speed, decode "
            f"{c['decode_vs_memcpy']:.0%} (into a buffer, as the merge: "
            f"{c['decode_into_vs_memcpy']:.0%})"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "codecs": codec_table}, indent=1))
    return 0


def _at_size(ap: argparse.ArgumentParser, args) -> int:
    preset, _, P = args.at_size.partition(":")
    if not P.isdigit() or int(P) < 1:
        ap.error(f"--at-size takes PRESET:P (e.g. 12b:24), got {args.at_size!r}")
    if min(args.ks) < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--ks, --repeats and --threads must be >= 1")
    try:
        _cfg(preset, int(P), 1, args.codec)
    except ValueError as exc:
        ap.error(str(exc).splitlines()[0])
    out = merge_size.run(preset, int(P), args.ks, args.codec, args.repeats, args.threads)
    print(merge_size.format_table(out))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
