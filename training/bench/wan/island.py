"""An island of the WAN bench: `diloco island` plus a step log and (optionally) regional checkpoints.

    python -m training.bench.wan.island --store gs://wan/x --experiment E --island island-0 \\
        --step-log DIR/island-0.jsonl [--checkpoints file:///region/dir] [--max-steps N]

It runs the production `training.island.process.Island` exactly as `diloco island` does, with two
additions for the benchmark:
- a step log: one JSON line per inner step, `{"t", "step", "tokens", "published"}`, written after
  the step returns, so the time between two lines is the step with everything the island did in
  line with it (adopting a global version, publishing, checkpointing); a line `{"t", "event":
  "started"}` is written when the island has pulled its first global version;
- `--checkpoints URL`: the island's own checkpoints go to this store (a directory in the
  island's region) instead of the shared bucket across the WAN, as a deployment would keep them
  in the region; everything else (global versions, pseudo-gradients, heartbeats, control) still
  goes through the bucket. Without it, checkpoints cross the WAN like every other object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from training.faults.chaos import IslandChaos
from training.faults.points import FaultPlan
from training.island.process import Island
from training.store.experiment import ExperimentStore
from training.store.registry import open_store


class RegionalCheckpoints:
    """An ExperimentStore whose island checkpoints live in another (regional) ExperimentStore."""

    def __init__(self, shared, regional):
        self._shared = shared
        self._regional = regional

    def save_checkpoint(self, *args, **kwargs):
        return self._regional.save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        return self._regional.load_checkpoint(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._shared, name)


class LoggedIsland(Island):
    """The production island, appending one line per step to a JSON-lines file."""

    def __init__(self, *args, step_log: Path, step_pad_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._pad_s = step_pad_s
        self._log = open(step_log, "a")  # noqa: SIM115 (closed by run())

    def _write(self, record: dict) -> None:
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def start(self) -> None:
        super().start()
        self._write({"t": time.time(), "event": "started", "step": self.step_count})

    def step(self):
        result = super().step()
        if self._pad_s:  # a slower chip: the background I/O goes on meanwhile, as on a device
            time.sleep(self._pad_s)
        self._write(
            {
                "t": time.time(),
                "step": self.step_count,
                "tokens": self.tokens,
                "published": len(result.published),
            }
        )
        return result

    def run(self, max_steps=None):
        try:
            return super().run(max_steps=max_steps)
        finally:
            self._log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.bench.wan.island")
    p.add_argument("--store", required=True)
    p.add_argument("--experiment", required=True)
    p.add_argument("--island", required=True)
    p.add_argument("--step-log", required=True)
    p.add_argument("--checkpoints", default=None, help="store URL for this island's checkpoints")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--step-pad-s", type=float, default=0.0, help="idle seconds after every step")
    args = p.parse_args(argv)
    faults = FaultPlan.from_env()  # one plan: the island's step and its store's points
    estore = ExperimentStore(open_store(args.store), args.experiment, faults=faults)
    cfg = estore.config()
    if args.checkpoints:
        estore = RegionalCheckpoints(
            estore, ExperimentStore(open_store(args.checkpoints), args.experiment)
        )
    island = LoggedIsland(
        cfg,
        args.island,
        estore,
        step_log=Path(args.step_log),
        step_pad_s=args.step_pad_s,
        background=True,
        faults=faults,
        chaos=IslandChaos.for_island(cfg, args.island, estore),
    )
    print(json.dumps(island.run(max_steps=args.max_steps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
