"""Streaming a prepared corpus (training/data/stream.py): the same batches as the in-memory path,
resumption from the cursor, bounded bytes held, ranged reads from a fake-gcs-server bucket."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import numpy as np
import pytest

from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.test_tokenizer import train_bpe
from training.data import corpus as data
from training.data.batches import BatchLoader, eval_batches, shard_tokens
from training.data.prepare import prepare
from training.data.stream import LazyTokens, StreamingLoader, open_prepared
from training.data.tokenizer import load_tokenizer


def _prepared(root: Path, docs: int, name: str = "out", chunk: int = 2000) -> Path:
    """`docs` text files of ~70 bytes, prepared with the byte tokenizer into ~2 kB shards."""
    src = root / f"src-{name}"
    src.mkdir()
    for i in range(docs):
        (src / f"d{i:04d}.txt").write_text(f"document {i}: " + "the quick brown fox " * 3)
    out = root / name
    prepare(str(src), "byte", str(out), chunk_bytes=chunk)
    return out


def _batches(loader, n: int) -> list[np.ndarray]:
    return [np.concatenate(loader.next_batch(), axis=1) for _ in range(n)]


def test_streamed_batches_equal_the_in_memory_batches_token_for_token(tmp_path):
    out = _prepared(tmp_path, 120)
    mem = data.load_corpus(str(out / "tokens") + "/", eval_fraction=0.1)
    lazy = open_prepared(str(out), eval_fraction=0.1)
    assert len(json.loads((out / "index.json").read_text())["shards"]) > 2  # several shards
    assert (len(lazy.train), len(lazy.eval), lazy.fingerprint) == (
        len(mem.train),
        len(mem.eval),
        mem.fingerprint,
    )
    a = BatchLoader(shard_tokens(mem.train, 1, 2), 4, 16, seed=3)
    b = StreamingLoader(shard_tokens(lazy.train, 1, 2), 4, 16, seed=3)
    # 3 epochs' worth, so epoch roll-over and read-ahead across it are covered
    n = 3 * a.batches_per_epoch + 1
    assert all(np.array_equal(x, y) for x, y in zip(_batches(a, n), _batches(b, n), strict=True))
    assert b.state() == a.state()
    ev_mem = eval_batches(mem.eval, 2, 16, 4)
    ev_lazy = eval_batches(lazy.eval, 2, 16, 4)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(ev_mem, ev_lazy, strict=True))
    b.close()


def test_a_loader_built_from_the_cursor_continues_with_the_next_batch(tmp_path):
    lazy = open_prepared(str(_prepared(tmp_path, 60)), eval_fraction=0.05)
    first = StreamingLoader(lazy.train, 2, 8, seed=1)
    _batches(first, 5)
    cursor = json.loads(json.dumps(first.state()))
    expected = _batches(first, 3)
    resumed = StreamingLoader(lazy.train, 2, 8, seed=1, cursor=cursor)
    assert all(np.array_equal(x, y) for x, y in zip(expected, _batches(resumed, 3), strict=True))
    first.close()
    resumed.close()


def test_bytes_held_are_bounded_by_read_ahead_not_by_corpus_size(tmp_path):
    peaks = []
    for docs, name in ((40, "small"), (400, "large")):
        lazy = open_prepared(str(_prepared(tmp_path, docs, name)), eval_fraction=0.05)
        loader = StreamingLoader(lazy.train, 4, 16, seed=0, read_ahead=2)
        _batches(loader, 30)
        loader.close()
        peaks.append(loader.peak_bytes_held)
    # (read_ahead 2 + the batch handed out) x 4 rows x 17 tokens x 4 bytes (int32) = 816
    assert peaks == [816, 816]


def test_a_missing_index_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="no index.json"):
        open_prepared(str(tmp_path))


@pytest.mark.integration
def test_ranged_reads_from_a_bucket_give_the_local_batches(tmp_path, gcs_bucket):  # noqa: F811
    src = tmp_path / "src"
    src.mkdir()
    for i in range(60):
        (src / f"d{i:03d}.txt").write_text(f"doc {i} " + "lorem ipsum dolor " * 3)
    url = f"{gcs_bucket}/stream-{tmp_path.name}"
    prepare(str(src), "byte", url, chunk_bytes=1500)
    prepare(str(src), "byte", str(tmp_path / "local"), chunk_bytes=1500)
    remote = open_prepared(url, eval_fraction=0.1)
    local = open_prepared(str(tmp_path / "local"), eval_fraction=0.1)
    a = StreamingLoader(local.train, 3, 12, seed=2)
    b = StreamingLoader(remote.train, 3, 12, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(_batches(a, 6), _batches(b, 6), strict=True))
    a.close()
    b.close()
    # ranged reads only: (6 batches + 2 read ahead) x 3 rows x 13 tokens x 2 bytes (uint16)
    assert remote.train.bytes_read == 8 * 3 * 13 * 2


def test_load_corpus_streams_a_prepared_directory_and_checks_its_tokenizer(tmp_path):
    out = _prepared(tmp_path, 30)
    streamed = data.load_corpus(str(out), eval_fraction=0.05, vocab_size=256)
    assert isinstance(streamed.train, LazyTokens)
    assert streamed.fingerprint == data.load_corpus(str(out / "tokens") + "/", 0.05).fingerprint
    with pytest.raises(ValueError, match="vocab_size 100"):
        data.load_corpus(str(out), vocab_size=100)  # byte tokenizer: 256 ids
    train_bpe(tmp_path / "bpe.json")
    other = load_tokenizer(str(tmp_path / "bpe.json"))
    with pytest.raises(ValueError, match="prepare it again"):
        data.load_corpus(str(out), tokenizer=other)


def test_an_island_on_a_prepared_corpus_streams_and_resumes_from_its_checkpoint(tmp_path):
    from tests.helpers import new_store, small_config
    from training.island.process import Island

    cfg = small_config(data={"source": str(_prepared(tmp_path, 200))}, islands=("a",))
    store = new_store(cfg)
    fresh = Island(cfg, "a", store)
    fresh.start()
    for _ in range(3):
        fresh.step()
    fresh.checkpoint(wait=True)
    resumed = Island(cfg, "a", store)
    resumed.start()
    assert isinstance(fresh.state.loader, StreamingLoader)
    assert resumed.state.loader.state() == fresh.state.loader.state()
    a, b = fresh.state.loader.next_batch(), resumed.state.loader.next_batch()
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
