"""Island overhead benchmark: the production island's step against a bare jitted loop.

Per (preset, P) row, in one process: an `Island(background=True)` over a file:// store in a
temporary directory, and a bare loop of the same `InnerLoop.step` on the same batches (made
before timing, from a loader with the island's seed), run in interleaved blocks of H steps
(bare, island, bare, island, ...), each block ended by waiting for the device. Between blocks
(untimed) a merger merges what the island published, so the island adopts inside its blocks.
`overhead` = median island block / median bare block - 1. The island's main-thread time is
broken down by wrapping its methods: checkpoint (snapshot and hand-off), publish (encode
dispatch and hand-off), adopt, data (the next batch); `cpu_ratio` is process CPU time over the
island's blocks against the bare blocks (background threads included: on this 2-core machine
they compete with the step, on an accelerator host they use idle host cores).

Checkpoint policy: every P publish rounds (once per H steps), or as `--every-rounds` says.
Rows for 1b and 12b are computed at 1 s per step and 200 MB/s to the store: bytes per
checkpoint and per publish against the interval they must hide behind.

Model and batch (defaults: the preset's compute dtype rule, 16 x 64 tokens a step) are flags, so
that the same rows can be measured at an accelerator's sizes (devtools/device_check.sh): each row
names its resolved compute dtype, sequence length, batch size and device.

    diloco bench island --json runs/bench_island.json [--presets tiny small] [--fragments 1 4 24]
        [--compute-dtype bfloat16] [--seq-len 1024] [--batch-size 16] [--gc-keep 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

COMPUTED = ("1b", "12b")
STEP_S, STORE_BPS = 1.0, 200e6


def _cfg(
    preset: str,
    P: int,
    H: int,
    every_rounds: int | None,
    compute_dtype: str = "auto",
    seq_len: int = 64,
    batch_size: int = 16,
    data_source: str | None = None,
):
    from training.config.experiment import parse_config

    data = {"seq_len": seq_len, "batch_size": batch_size}
    if data_source is not None:
        data["source"] = data_source

    return parse_config(
        {
            "name": "bench-island",
            "model": {"preset": preset, "compute_dtype": compute_dtype},
            "data": data,
            "inner": {"H": H, "tau": 1},
            "fragments": {"count": P, "strategy": "tensors"},
            "codec": "int8",
            "islands": [{"name": "a"}],
            "outer": {"method": "decoupled"},
            "checkpoint": {"every_rounds": P if every_rounds is None else every_rounds},
            "token_budget": 10**12,
        }
    )


class _Timer:
    """Wraps methods of an object, adding their wall time to `seconds[label]`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, obj, method: str, label: str) -> None:
        fn = getattr(obj, method)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, method, timed)


def measure(
    preset: str,
    P: int,
    H: int,
    repeats: int,
    every_rounds: int | None,
    compute_dtype: str = "auto",
    seq_len: int = 64,
    batch_size: int = 16,
    gc_keep: int | None = None,
    data_source: str | None = None,
) -> dict:
    """One row; `gc_keep` N: after each (untimed) merge, the store's garbage collection keeps
    the newest N versions per fragment (and version 0), so that a large model's versions and
    checkpoints do not fill the disk; None: nothing is collected."""
    import jax

    from training.data.batches import BatchLoader
    from training.island.process import Island
    from training.merge import replay
    from training.merge.merger import Merger, initial_version
    from training.model.definition import compute_dtype as resolved_dtype
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    cfg = _cfg(preset, P, H, every_rounds, compute_dtype, seq_len, batch_size, data_source)
    with tempfile.TemporaryDirectory(prefix="bench-island-") as tmp:
        store = ExperimentStore(open_store(f"file://{tmp}/store"), cfg.name)
        store.write_config(json.loads(cfg.to_json()))
        initial_version(cfg, store)
        merger = Merger(cfg, store)
        island = Island(cfg, "a", store, background=True)
        island.start()
        loop = island.loop
        timer = _Timer()
        for method, label in (("checkpoint", "checkpoint"), ("publish", "publish")):
            timer.wrap(island, method, label)
        timer.wrap(island.adopter, "apply", "adopt")  # the island-thread part of an adopt
        timer.wrap(island.state.loader, "next_batch", "data")
        bare_loader = BatchLoader(
            island.shard,
            cfg.data.batch_size,
            cfg.data.seq_len,
            seed=cfg.seed * 1000 + cfg.shard_of("a"),
        )
        params = loop.put_params(store.load_params(None, replay.params_of(cfg, store)))
        opt = loop.init_opt_state(params)

        def island_block() -> None:
            for _ in range(H):
                island.step()
            jax.block_until_ready(island.params)

        def bare_block() -> None:
            nonlocal params, opt
            batches = [bare_loader.next_batch() for _ in range(H)]
            t = time.perf_counter()
            for x, y in batches:
                params, opt, _ = loop.step(params, opt, x, y)
            jax.block_until_ready(params)
            return time.perf_counter() - t

        def merge() -> None:  # untimed
            merger.merge_all()
            if gc_keep is not None:
                store.collect_garbage(store.plan_gc(keep_last=gc_keep))

        for _ in range(3):  # warm-up: compiles, two publishes and an adopt per fragment
            island_block()
            bare_block()
            island.drain_background()
            merge()
        timer.seconds.clear()
        times: dict[str, list[float]] = {"bare": [], "island": []}
        cpu: dict[str, float] = {"bare": 0.0, "island": 0.0}
        for _ in range(repeats):
            c = time.process_time()
            times["bare"].append(bare_block())
            cpu["bare"] += time.process_time() - c
            c, t = time.process_time(), time.perf_counter()
            island_block()
            times["island"].append(time.perf_counter() - t)
            cpu["island"] += time.process_time() - c
            # untimed: the I/O thread finishes its uploads, the merger merges them, and the
            # island adopts in its next block
            island.drain_background()
            merge()
        island.close_background()
        state_bytes = sum(
            int(x.size) * x.dtype.itemsize
            for x in jax.tree_util.tree_leaves((island.state.params, island.state.opt_state))
        )
    bare = statistics.median(times["bare"]) / H
    isl = statistics.median(times["island"]) / H
    steps = repeats * H
    return dict(
        preset=preset,
        fragments=P,
        H=H,
        compute_dtype=str(resolved_dtype(cfg.model)),
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        device=f"{jax.default_backend()}: {jax.devices()[0].device_kind}",
        every_rounds=cfg.checkpoint.every_rounds,
        repeats=repeats,
        bare_step_s=bare,
        island_step_s=isl,
        overhead=isl / bare - 1,
        overhead_spread=[
            min(times["island"]) / max(times["bare"]) - 1,
            max(times["island"]) / min(times["bare"]) - 1,
        ],
        cpu_ratio=cpu["island"] / cpu["bare"] - 1,
        breakdown_per_step_s={k: v / steps for k, v in sorted(timer.seconds.items())},
        breakdown_share={k: v / steps / bare for k, v in sorted(timer.seconds.items())},
        state_bytes=state_bytes,
    )


def computed(preset: str, P: int, H: int = 32) -> dict:
    """Checkpoint and publish cost at STEP_S per step and STORE_BPS, int8 with error feedback,
    checkpoint = params + AdamW m, v + residual (fp32); anchors named, not stored."""
    from training.config.experiment import ModelConfig

    n = ModelConfig(preset=preset).param_count()
    ckpt_bytes = 16 * n
    ckpt_s = ckpt_bytes / STORE_BPS
    publish_s = n / P * (1 + 4 / 256) / STORE_BPS  # one fragment: int8 codes + scales
    round_s = H / P * STEP_S  # time between two publish rounds
    return dict(
        preset=preset,
        fragments=P,
        H=H,
        computed=True,
        params=n,
        checkpoint_bytes=ckpt_bytes,
        checkpoint_write_s=ckpt_s,
        min_every_rounds_hidden=max(1, -int(-ckpt_s // round_s)),
        publish_s=publish_s,
        publish_interval_s=round_s,
        publish_hidden=publish_s <= round_s,
        publish_share=publish_s / round_s,
        checkpoint_share_every_P_rounds=ckpt_s / (H * STEP_S),
        host_memory_before_bytes=40 * n,  # five copies as one bytes object, plus arrays
        host_memory_now_bytes="one tensor (the largest: vocab x d_model fp32)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench island")
    ap.add_argument("--json", required=True)
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--fragments", nargs="+", type=int, default=[1, 4, 24])
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every-rounds", type=int, default=None, help="default: P")
    ap.add_argument(
        "--compute-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="model.compute_dtype (auto: bfloat16 on an accelerator, float32 on the CPU)",
    )
    ap.add_argument("--seq-len", type=int, default=64, help="data.seq_len")
    ap.add_argument("--batch-size", type=int, default=16, help="data.batch_size")
    ap.add_argument(
        "--gc-keep",
        type=int,
        default=None,
        metavar="N",
        help="after each untimed merge, garbage-collect all but the newest N versions per "
        "fragment (large models on a small disk); default: keep everything",
    )
    ap.add_argument(
        "--data-source",
        default=None,
        help="data.source (default: the built-in corpus); a `diloco prepare` directory streams",
    )
    args = ap.parse_args(argv)
    if args.gc_keep is not None and args.gc_keep < 1:
        ap.error(f"--gc-keep must be >= 1, got {args.gc_keep}")
    from training.config.experiment import ModelConfig
    from training.model import definition as model

    rows: list[dict] = []
    out = dict(
        rows=rows,
        machine=f"{platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}",
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        step_s=STEP_S,
        store_bytes_per_s=STORE_BPS,
    )
    for preset in COMPUTED:
        for P in args.fragments:
            rows.append(computed(preset, P, args.H))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        tensors = len(model.abstract_params(ModelConfig(preset=preset)))
        for P in args.fragments:
            P_used = min(P, tensors)
            row = measure(
                preset,
                P_used,
                args.H,
                args.repeats,
                args.every_rounds,
                args.compute_dtype,
                args.seq_len,
                args.batch_size,
                args.gc_keep,
                args.data_source,
            )
            row["fragments_asked"] = P
            rows.append(row)
            print(
                f"{preset:6s} P={P_used:2d}: bare {row['bare_step_s'] * 1e3:7.2f} ms, island "
                f"{row['island_step_s'] * 1e3:7.2f} ms, overhead {row['overhead']:+.2%} "
                f"(spread {row['overhead_spread'][0]:+.1%}..{row['overhead_spread'][1]:+.1%}), "
                f"cpu {row['cpu_ratio']:+.2%}",
                flush=True,
            )
            path.write_text(json.dumps(out, indent=2))  # after every row: a cut run keeps them
    path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
