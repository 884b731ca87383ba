import json
import uuid

import fsspec
import numpy as np
import pytest

from training.data import corpus as data
from training.data.batches import BatchLoader, eval_batches, shard_tokens


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus(data.BUILTIN_SOURCE)


@pytest.fixture
def memdir():
    root = f"memory://test-data-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _write(url: str, payload: bytes) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(payload)


def test_tokenizer_roundtrip():
    text = "Hello, wörld — ünïcode ✓\n"
    ids = data.encode(text)
    assert ids.dtype == np.uint16
    assert len(ids) == len(text.encode("utf-8"))
    assert int(ids.max()) < data.VOCAB_SIZE
    assert data.decode(ids) == text
    assert data.decode(ids[:-2]).endswith("\ufffd")  # truncated multi-byte character
    with pytest.raises(ValueError):
        data.decode([300])


def test_builtin_corpus_is_english_and_deterministic(corpus):
    data.builtin_documents.cache_clear()
    docs = data.builtin_documents()
    assert len(docs) > 300
    ids = [doc_id for doc_id, _ in docs]
    assert len(set(ids)) == len(ids)
    assert any(i.startswith("topic/") for i in ids) and any(i.startswith("module/") for i in ids)
    assert not any("/test/" in i or "idlelib" in i or "tkinter" in i for i in ids)
    assert 1_000_000 < len(corpus.train) + len(corpus.eval) < 20_000_000
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint16
    text = data.decode(corpus.train[:200_000])
    assert text.count(" the ") > 500
    again = data.load_corpus(data.BUILTIN_SOURCE)
    assert again.fingerprint == corpus.fingerprint
    assert np.array_equal(again.eval, corpus.eval)


def test_eval_split_is_held_out_by_document(corpus):
    assert corpus.eval_documents > 0 and corpus.train_documents > 10 * corpus.eval_documents
    frac = len(corpus.eval) / (len(corpus.train) + len(corpus.eval))
    assert 0.01 < frac < 0.15
    eval_ids = [d for d, _ in data.builtin_documents() if data._stable_unit(d) < 0.05]
    assert len(eval_ids) == corpus.eval_documents
    # a held-out document's text never appears in train
    held_text = dict(data.builtin_documents())[eval_ids[0]]
    probe = data.encode(held_text[:400]).tobytes()
    assert corpus.train.tobytes().find(probe) == -1
    assert corpus.eval.tobytes().find(probe) >= 0
    no_eval = data.load_corpus(data.BUILTIN_SOURCE, eval_fraction=0.0)
    assert len(no_eval.eval) == 0
    assert len(no_eval.train) == len(corpus.train) + len(corpus.eval)


def test_unknown_builtin_and_bad_fraction():
    with pytest.raises(ValueError, match="unknown built-in"):
        data.load_corpus("builtin:nope")
    with pytest.raises(ValueError, match="eval_fraction"):
        data.load_corpus(data.BUILTIN_SOURCE, eval_fraction=1.0)
    with pytest.raises(ValueError, match="vocab_size"):
        data.load_corpus(data.BUILTIN_SOURCE, vocab_size=100)


def test_text_glob_source(memdir):
    texts = {f"doc{i:02d}.txt": f"Document {i}. " * (50 + i) for i in range(40)}
    for name, text in texts.items():
        _write(f"{memdir}/{name}", text.encode())
    _write(f"{memdir}/ignored.md", b"not matched")
    c = data.load_corpus(f"{memdir}/*.txt", eval_fraction=0.2)
    assert c.vocab_size == 256
    assert c.train_documents + c.eval_documents == 40
    assert 0 < c.eval_documents < 40
    total = sum(len(t) + len(data.DOC_SEPARATOR) for t in texts.values())
    assert len(c.train) + len(c.eval) == total
    assert "not matched" not in data.decode(c.train) + data.decode(c.eval)
    assert data.load_corpus(f"{memdir}/*.txt", eval_fraction=0.2).fingerprint == c.fingerprint


def _corpus_files(root, n=40):
    for i in range(n):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(f"Document {i} says hello. " * (30 + i))


def test_directory_source_reads_every_visible_file_recursively(tmp_path):
    _corpus_files(tmp_path / "corpus")
    (tmp_path / "corpus" / ".hidden").mkdir()
    (tmp_path / "corpus" / ".hidden" / "x.txt").write_text("SECRET " * 50)
    (tmp_path / "corpus" / ".notes.txt").write_text("SECRET " * 50)
    for source in (str(tmp_path / "corpus"), f"file://{tmp_path}/corpus/"):
        c = data.load_corpus(source, eval_fraction=0.2)
        assert c.train_documents + c.eval_documents == 40
        assert "SECRET" not in data.decode(c.train) + data.decode(c.eval)


def test_split_does_not_depend_on_where_the_files_live(tmp_path):
    """The same files under two directories give the identical train / eval split."""
    _corpus_files(tmp_path / "here")
    _corpus_files(tmp_path / "somewhere" / "else" / "entirely")
    one = data.load_corpus(str(tmp_path / "here"), eval_fraction=0.2)
    two = data.load_corpus(str(tmp_path / "somewhere" / "else" / "entirely"), eval_fraction=0.2)
    glob = data.load_corpus(f"{tmp_path}/somewhere/else/entirely/*/*.txt", eval_fraction=0.2)
    assert 0 < one.eval_documents < 40
    for other in (two, glob):
        assert np.array_equal(one.train, other.train)
        assert np.array_equal(one.eval, other.eval)
        assert one.fingerprint == other.fingerprint


def test_source_root_and_relative_ids():
    assert data.source_root("/data/corpus", is_dir=True) == "/data/corpus"
    assert data.source_root("/data/corpus/", is_dir=True) == "/data/corpus"
    assert data.source_root("/data/corpus/*.txt", is_dir=False) == "/data/corpus"
    assert data.source_root("bucket/x/**/part-*.txt", is_dir=False) == "bucket/x"
    assert data.source_root("/data/one.txt", is_dir=False) == "/data"
    assert data.relative_id("/data/corpus/a/b.txt", "/data/corpus") == "a/b.txt"
    assert data.relative_id("/other/b.txt", "/data/corpus") == "/other/b.txt"


def test_single_text_file_falls_back_to_tail_split(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abcdefghij" * 100)
    c = data.load_corpus(f"file://{path}", eval_fraction=0.1)
    assert len(c.eval) == 100 + len(data.DOC_SEPARATOR)
    assert data.decode(c.train).startswith("abcdefghij")


def test_no_match_is_clear(tmp_path):
    with pytest.raises(ValueError, match="matches no files"):
        data.load_corpus(f"file://{tmp_path}/*.txt")


def test_npy_and_bin_sources(memdir):
    a = np.arange(1000, dtype=np.uint16) % 500
    b = (np.arange(2000, dtype=np.uint32) * 7) % 60000
    with fsspec.open(f"{memdir}/a.npy", "wb") as f:
        np.save(f, a)
    _write(f"{memdir}/b.u32.bin", b.astype("<u4").tobytes())
    c = data.load_corpus(f"{memdir}/*", eval_fraction=0.1, vocab_size=60000)
    assert c.vocab_size == 60000 and c.train.dtype == np.uint32
    assert np.array_equal(c.train, np.concatenate([a[:900], b[:1800]]))
    assert np.array_equal(c.eval, np.concatenate([a[900:], b[1800:]]))
    inferred = data.load_corpus(f"{memdir}/a.npy", eval_fraction=0.1)
    assert inferred.vocab_size == 500 and inferred.train.dtype == np.uint16


def test_array_source_validation(memdir):
    _write(f"{memdir}/x.u16.bin", np.array([1, 2, 70000 % 65536, 9], "<u2").tobytes())
    with pytest.raises(ValueError, match=r"x\.u16\.bin.*max token 4464.*vocab_size 1000"):
        data.load_corpus(f"{memdir}/x.u16.bin", vocab_size=1000)
    _write(f"{memdir}/raw.bin", np.arange(10, dtype="<u2").tobytes())
    with pytest.raises(ValueError, match="dtype"):
        data.load_corpus(f"{memdir}/raw.bin")
    c = data.load_corpus(f"{memdir}/raw.bin", dtype="uint16", eval_fraction=0.0)
    assert np.array_equal(c.train, np.arange(10))
    with pytest.raises(ValueError, match="uint16 or uint32"):
        data.load_corpus(f"{memdir}/raw.bin", dtype="int32")
    with fsspec.open(f"{memdir}/f.npy", "wb") as f:
        np.save(f, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="f.npy.*uint16 or uint32"):
        data.load_corpus(f"{memdir}/f.npy")
    _write(f"{memdir}/odd.u32.bin", b"\x00" * 6)
    with pytest.raises(ValueError, match="multiple"):
        data.load_corpus(f"{memdir}/odd.u32.bin")


def test_shards_are_disjoint_and_cover(corpus):
    n = 4
    shards = [shard_tokens(corpus.train, i, n) for i in range(n)]
    size = len(corpus.train) // n
    assert all(len(s) == size for s in shards)
    assert np.array_equal(np.concatenate(shards), corpus.train[: n * size])
    with pytest.raises(ValueError):
        shard_tokens(corpus.train, 4, 4)


def test_batches_shapes_and_targets():
    tokens = np.arange(10_000, dtype=np.uint32)
    loader = BatchLoader(tokens, batch_size=4, seq_len=16, seed=0)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert np.all(x[:, 0] % 16 == 0)
    assert loader.tokens_per_batch == 64


def test_epoch_visits_each_window_once():
    tokens = np.arange(16 * 40 + 1, dtype=np.uint16)
    loader = BatchLoader(tokens, batch_size=5, seq_len=16, seed=3)
    assert loader.batches_per_epoch == 8
    starts = [int(s) for _ in range(8) for s in loader.next_batch()[0][:, 0]]
    assert sorted(starts) == list(range(0, 16 * 40, 16))
    nxt = [int(s) for s in loader.next_batch()[0][:, 0]]
    assert loader.state()["epoch"] == 1
    assert nxt != starts[:5]  # new permutation each epoch


def test_resume_from_cursor_is_exact():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    ref = BatchLoader(tokens, 3, 32, seed=7)
    expected = [ref.next_batch() for _ in range(40)]  # spans several epochs
    for cut in (0, 1, 13, 17, 39):
        loader = BatchLoader(tokens, 3, 32, seed=7)
        for _ in range(cut):
            loader.next_batch()
        cursor = json.loads(json.dumps(loader.state()))
        resumed = BatchLoader(tokens, 3, 32, seed=7, cursor=cursor)
        for i in range(cut, 40):
            x, y = resumed.next_batch()
            assert np.array_equal(x, expected[i][0]) and np.array_equal(y, expected[i][1])
    assert ref.state()["tokens_seen"] == 40 * 3 * 32
    with pytest.raises(ValueError, match="seed"):
        BatchLoader(tokens, 3, 32, seed=8, cursor=ref.state())
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(tokens, 4, 32, seed=7, cursor=ref.state())


def test_seeds_differ_and_small_shard_errors():
    tokens = np.arange(4000, dtype=np.uint16)
    a = BatchLoader(tokens, 2, 8, seed=1).next_batch()[0]
    b = BatchLoader(tokens, 2, 8, seed=2).next_batch()[0]
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError, match="too small"):
        BatchLoader(np.arange(20, dtype=np.uint16), batch_size=2, seq_len=16, seed=0)


def test_eval_batches_fixed(corpus):
    batches = eval_batches(corpus.eval, 4, 64, max_batches=5)
    assert len(batches) == 5
    again = eval_batches(corpus.eval, 4, 64, max_batches=5)
    for (x1, y1), (x2, y2) in zip(batches, again, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        assert x1.shape == (4, 64) and x1.dtype == np.int32
    first_tokens = {int(x[0, 0]) for x, _ in batches}
    assert len(first_tokens) > 1
    few = eval_batches(np.arange(200, dtype=np.uint16), 2, 16, max_batches=100)
    assert len(few) == (199 // 16) // 2
    with pytest.raises(ValueError, match="too small"):
        eval_batches(np.arange(10, dtype=np.uint16), 2, 16, max_batches=1)
