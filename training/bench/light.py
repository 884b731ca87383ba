"""What light versions (`syncer.full_every`, docs/STORE.md "Light versions") cost and save: the
bytes a merge writes with full_every 1 and k, and a cold merger's recovery time (loading the
nearest full version and re-applying the merges since, checked) with HEAD k - 1 versions past
it. Real Merger, file:// store, two int4 islands on fragment 0, nesterov (an outer momentum).

    diloco bench light --preset small --fragments 4 --json runs/bench_light.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from training.codecs import host as codecs
from training.config.experiment import parse_config
from training.merge.merger import Merger, initial_version
from training.store.experiment import ExperimentStore
from training.store.registry import open_store


def _config(preset: str, fragments: int, k: int, background: bool = True):
    return parse_config(
        {
            "name": f"light-{k}" + ("" if background else "-sync"),
            "model": {"preset": preset},
            "islands": [{"name": "a"}, {"name": "b"}],
            "codec": "int4",
            "fragments": {"count": fragments},
            "outer": {"method": "nesterov", "rounds": "steps"},
            "token_budget": 10**12,
            "syncer": {"full_every": k, "full_every_s": 0, "full_in_background": background},
        }
    )


def _chain(preset: str, fragments: int, k: int, merges: int, root: str, background: bool = True):
    """An experiment whose fragment 0 had `merges` merges; (cfg, store, seconds per merge,
    the merger, warm)."""
    cfg = _config(preset, fragments, k, background)
    store = ExperimentStore(open_store(f"file://{root}/{cfg.name}"), cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    initial_version(cfg, store)
    merger = Merger(cfg, store)
    theta = store.load_fragment(store.head(0)).params
    rng = np.random.default_rng(0)
    started = time.monotonic()
    for r in range(merges):
        base = store.head(0).version
        for island in ("a", "b"):
            delta = {
                n: (rng.normal(size=v.shape) * 1e-3).astype(np.float32) for n, v in theta.items()
            }
            payload, _ = codecs.encode(delta, cfg.codec)
            manifest = dict(
                base_version=base, steps=4, tokens=512, loss=1.0, codec=cfg.codec,
                step_time_s=1.0, published_at=float(r),
            )  # fmt: skip
            store.publish_pseudograd(island, r, 0, payload, manifest)
        got = merger.merge_once().versions
        if got != {0: base + 1}:
            raise RuntimeError(f"merge {r}: expected version {base + 1} of fragment 0, got {got}")
    merger._promotions.wait_all()  # background full versions: their writes counted in
    return cfg, store, (time.monotonic() - started) / max(merges, 1), merger


def _written(store, merges: int) -> float:
    """Mean payload bytes of fragment 0's versions 1..merges (their manifests' nbytes, and
    their promotions': the full versions written in the background)."""
    chain = store.list_fragment_versions(0)[1:]
    if len(chain) != merges:
        raise RuntimeError(f"fragment 0 has {len(chain)} versions after {merges} merges")
    total = 0
    for m in chain:
        total += sum(m["nbytes"].values())
        head = store.find_version(0, m["version"])
        promoted = store.promotion(head, m) if m.get("full") is False else None
        total += sum(size for _, size in promoted.sums.values()) if promoted else 0
    return total / merges


def _cold_start(cfg, store, head) -> float:
    """Seconds a new merger takes to hold `head`'s arrays (replayed, or loaded)."""
    cold = Merger(cfg, store)
    started = time.monotonic()
    cold._fragment_arrays(head, store.fragment_manifest(head))
    return time.monotonic() - started


def table(out: dict) -> str:
    """The two tables: bytes per merge against k = the first, and cold-start time."""
    rows = [
        "| full_every | bytes written per merge | vs the first row | merge s |",
        "|---|---|---|---|",
    ]
    first = None
    for k, r in out["bytes"].items():
        first = first or r["bytes_per_merge"]
        rows.append(
            f"| {k} | {r['bytes_per_merge'] / 1e6:.2f} MB | {r['bytes_per_merge'] / first:.2f} "
            f"| {r['merge_s']:.3f} |"
        )
    rows += [
        "",
        "| full_every | HEAD | cold start s | cold start at a promoted HEAD s (after SIGTERM) |",
        "|---|---|---|---|",
    ]
    rows += [
        f"| {k} | {r['head']} | {r['cold_start_s']:.3f} | {r['promoted_start_s']:.3f} |"
        for k, r in out["cold"].items()
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diloco bench light", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--bytes-k", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bytes-merges", type=int, default=16)
    parser.add_argument("--cold-k", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = parser.parse_args(argv)
    out = {"preset": args.preset, "fragments": args.fragments, "bytes": {}, "cold": {}}
    with tempfile.TemporaryDirectory() as root:
        for k in args.bytes_k:
            # k > 1: full versions in the background (the default), and written by the merge
            for background in (True, False) if k > 1 else (True,):
                label = str(k) if background or k == 1 else f"{k} (written by the merge)"
                _, store, per, _ = _chain(
                    args.preset, args.fragments, k, args.bytes_merges, root, background
                )
                out["bytes"][label] = {
                    "bytes_per_merge": _written(store, args.bytes_merges),
                    "merge_s": per,
                }
                print(json.dumps({label: out["bytes"][label]}), flush=True)
        for k in args.cold_k:
            # HEAD = k - 1: the most light versions a cold start replays with full_every k;
            # then the same HEAD promoted (what a shard leaves on SIGTERM or before deferring)
            cfg, store, per, warm = _chain(
                args.preset, args.fragments, k, max(k - 1, 1), f"{root}/cold"
            )
            head = store.head(0)
            out["cold"][k] = {"head": head.version, "merge_s": per}
            out["cold"][k]["cold_start_s"] = _cold_start(cfg, store, head)
            warm.promote_heads()
            out["cold"][k]["promoted_start_s"] = _cold_start(cfg, store, head)
            print(json.dumps({k: out["cold"][k]}), flush=True)
    print(table(out))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")
    return 0
