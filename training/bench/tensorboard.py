"""TensorBoard overhead benchmark: island tokens/s with `tensorboard.enabled` on against off.

In one process, two production islands (`Island(background=True)`, one per file:// store in a
temporary directory, same config but the switch) train in interleaved blocks (off, on, off,
on, ...), each block `--steps` steps ended by waiting for the device and draining the I/O
thread (so a block pays for its own writes). The worst case for the writer: a heartbeat after
every step (what `_run` does every `heartbeat_s`, 5 s by default) and a flush every
`--flush-s`. `overhead` = median on-block tokens/s / median off-block tokens/s - 1 (negative:
slower with TensorBoard).

    python -m training.bench.tensorboard --json runs/bench_tensorboard.json [--preset tiny]
        [--steps 40] [--repeats 5] [--flush-s 1]
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


def _island(root: Path, preset: str, enabled: bool, flush_s: float):
    from training.config.experiment import parse_config
    from training.island.process import Island
    from training.merge.merger import initial_version
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    cfg = parse_config(
        {
            "name": "bench-tb",
            "model": {"preset": preset},
            "data": {"seq_len": 64, "batch_size": 16},
            "inner": {"H": 32, "tau": 1},
            "codec": "int8",
            "islands": [{"name": "a"}],
            "outer": {"method": "decoupled"},
            "token_budget": 10**12,
            "tensorboard": {"enabled": enabled, "flush_s": flush_s},
        }
    )
    store = ExperimentStore(open_store(f"file://{root}"), cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    initial_version(cfg, store)
    island = Island(cfg, "a", store, background=True)
    island.start()
    for _ in range(3):  # compile and warm
        island.step().loss_array.block_until_ready()
    return cfg, island


def _block(island, steps: int, tokens_per_step: int) -> float:
    t = time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = island.step().loss_array
        island.heartbeat(loss, 1.0)  # a heartbeat per step: the TensorBoard writer's worst case
    loss.block_until_ready()
    island.io.drain()
    return steps * tokens_per_step / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.bench.tensorboard")
    ap.add_argument("--json", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flush-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        islands = {on: _island(Path(tmp) / str(on), args.preset, on, args.flush_s) for on in rates}
        tokens = islands[False][0].data.batch_size * islands[False][0].data.seq_len
        for _ in range(args.repeats):
            for on in (False, True):
                rates[on].append(_block(islands[on][1], args.steps, tokens))
        writer = islands[True][1].publisher.tb
        writer.flush()
        files, failures = writer.written, writer.failures
        for _, island in islands.values():
            island.close_background()
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    row = dict(
        preset=args.preset,
        steps_per_block=args.steps,
        repeats=args.repeats,
        flush_s=args.flush_s,
        tokens_per_s_off=round(off, 1),
        tokens_per_s_on=round(on, 1),
        overhead=round(on / off - 1, 4),
        blocks_off=[round(r, 1) for r in rates[False]],
        blocks_on=[round(r, 1) for r in rates[True]],
        event_files=files,
        failures=failures,
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        date=datetime.now(UTC).strftime("%Y-%m-%d"),
    )
    print("| preset | tokens/s off | tokens/s on | overhead | event files | failures |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.preset} | {off:,.0f} | {on:,.0f} | {100 * row['overhead']:+.1f}% "
        f"| {files} | {failures} |"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
