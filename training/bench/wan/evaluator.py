"""Held-out loss of the global model while a WAN-bench run trains (runs in the backbone).

    python -m training.bench.wan.evaluator --store gs://wan/x --experiment E --out curve.jsonl \\
        --until-tokens N [--until-loss L] [--every 1.0]

Every `--every` seconds it evaluates the model as it is now in the store and appends
`{"t", "loss", "tokens_merged"}` to `--out` (skipping an evaluation when the merged-token count
has not moved); it exits after the first evaluation of a model with N tokens merged or more, or
(`--until-loss`) with a held-out loss of L or less. Evaluation is
`training.model.evaluate` (the fixed held-out batches of `diloco eval`). With `--merges-out FILE` it
writes, when it exits, the merger's own records of the run (`metrics/merge/`, one per merge pass,
every applied contribution with its publish and merge times, staleness and steps) as one JSON
list: what the bench summarises as the syncer's latency (runner.merge_timeline).
"""

from __future__ import annotations

import argparse
import json
import time

from training.store.experiment import ExperimentStore
from training.store.registry import open_store


def eval_now(cfg, estore) -> dict:
    """`{"loss", "tokens_merged"}` of the current global model, whichever evaluate API exists."""
    from training.model import evaluate

    if hasattr(evaluate, "evaluate_snapshot"):  # per-fragment layout
        from training.merge.replay import params_of  # light versions: params by replay

        out = evaluate.evaluate_snapshot(
            cfg, estore, record=False, params_of=params_of(cfg, estore)
        )
    else:
        out = evaluate.evaluate_version(cfg, estore)
    return {"loss": float(out["loss"]), "tokens_merged": int(out.get("tokens_merged", 0))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.bench.wan.evaluator")
    p.add_argument("--store", required=True)
    p.add_argument("--experiment", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--until-tokens", type=int, required=True)
    p.add_argument("--until-loss", type=float, default=None)
    p.add_argument("--every", type=float, default=1.0)
    p.add_argument("--merges-out", default=None, help="the merger's records, written at exit")
    args = p.parse_args(argv)
    estore = ExperimentStore(open_store(args.store), args.experiment)
    cfg = estore.config()
    try:
        return _follow(args, cfg, estore)
    finally:
        if args.merges_out:
            with open(args.merges_out, "w") as f:
                json.dump(estore.read_metrics("merge"), f)


def _follow(args, cfg, estore) -> int:
    last = None
    with open(args.out, "a") as out:
        while True:
            t = time.time()
            rec = eval_now(cfg, estore)
            if rec["tokens_merged"] != last:
                out.write(json.dumps({"t": t, **rec}) + "\n")
                out.flush()
                last = rec["tokens_merged"]
            if rec["tokens_merged"] >= args.until_tokens:
                return 0
            if args.until_loss is not None and rec["loss"] <= args.until_loss:
                return 0
            time.sleep(max(0.0, args.every - (time.time() - t)))


if __name__ == "__main__":
    raise SystemExit(main())
