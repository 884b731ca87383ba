"""`diloco prepare` (training/data/prepare.py): text, JSON lines and Parquet into token shards,
bad input counted, resumable after a real kill, the same output from parallel workers, on a
local directory and on a fake-gcs-server bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.test_tokenizer import train_bpe
from training import cli
from training.data import corpus as data
from training.data.prepare import prepare
from training.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
JSONL = (
    b'{"text": "alpha"}\n'
    b'{"text": ""}\n'  # empty
    b"not json\n"  # bad_json
    b'{"body": "x"}\n'  # missing_field
    b'{"text": 7}\n'  # not_text
    b"\n"  # a blank line: no record
    b'{"text": "caf\\u00e9"}\n'
    b"\xff\xfe\n"  # non_utf8
    b'{"text": "omega"}\n'
)


def _source(root: Path) -> Path:
    """a.txt (one document), b.jsonl (3 good lines of 8), c.parquet (2 good rows of 3)."""
    src = root / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world")
    (src / "b.jsonl").write_bytes(JSONL)
    table = pa.table({"text": ["first row", None, "third row"]})
    pq.write_table(table, src / "c.parquet", row_group_size=2)
    return src


def _tokens(out: Path) -> np.ndarray:
    """Every shard of a prepared corpus, concatenated in index order."""
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([np.fromfile(out / s["shard"], "<u2") for s in index["shards"]])


def test_every_kind_of_input_becomes_documents_and_bad_input_is_counted(tmp_path):
    s = prepare(str(_source(tmp_path)), "byte", str(tmp_path / "out"))
    text = load_tokenizer("byte").decode(_tokens(tmp_path / "out"))
    docs = ["hello world", "alpha", "café", "omega", "first row", "third row"]
    assert text == "".join(d + "\n\n" for d in docs)
    assert s.documents == 6
    # bytes + 2 separator bytes per document: 11 + 5 + 5 (é is two) + 5 + 9 + 9 + 6 * 2
    assert s.tokens == 56
    assert s.problems == {
        "empty": 2,  # the jsonl's "" and the parquet's null
        "bad_json": 1,
        "missing_field": 1,
        "not_text": 1,
        "non_utf8": 1,
    }


def test_the_index_records_shards_documents_and_the_tokenizer(tmp_path):
    prepare(str(_source(tmp_path)), "byte", str(tmp_path / "out"))
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["tokenizer"]["sha256"] == load_tokenizer("byte").sha256
    assert [s["documents"] for s in index["shards"]] == [1, 3, 2]  # one shard per input here
    starts = np.load(tmp_path / "out" / index["shards"][1]["starts"])
    assert starts.tolist() == [0, 7, 14]  # "alpha\n\n" and "café\n\n" (é: two bytes) are 7 each


def test_a_missing_column_counts_every_row(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"body": ["a", "b", "c"]}), src / "x.parquet")
    s = prepare(str(src), "byte", str(tmp_path / "out"))
    assert (s.documents, s.problems) == (0, {"missing_column": 3})


def test_small_chunks_split_json_lines_without_losing_or_repeating_one(tmp_path):
    src = _source(tmp_path)
    whole = prepare(str(src), "byte", str(tmp_path / "whole"))
    split = prepare(str(src), "byte", str(tmp_path / "split"), chunk_bytes=10)
    assert split.units > whole.units
    assert np.array_equal(_tokens(tmp_path / "split"), _tokens(tmp_path / "whole"))
    assert split.problems == whole.problems


def test_a_file_tokenizer_writes_its_ids(tmp_path):
    train_bpe(tmp_path / "bpe.json")
    s = prepare(str(_source(tmp_path)), str(tmp_path / "bpe.json"), str(tmp_path / "out"))
    tok = load_tokenizer(str(tmp_path / "bpe.json"))
    ids = _tokens(tmp_path / "out")
    assert s.tokens == len(ids) < 56  # merges: fewer tokens than the byte tokenizer's
    assert tok.decode(ids).split("<|endoftext|>")[:2] == ["hello world", "alpha"]


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    src = _source(tmp_path)
    prepare(str(src), "byte", str(tmp_path / "out"))
    with pytest.raises(ValueError, match="other settings \\(text_field differs\\)"):
        prepare(str(src), "byte", str(tmp_path / "out"), text_field="body")


def test_a_killed_run_resumes_without_redoing_finished_shards(tmp_path):
    src = _source(tmp_path)
    env = dict(os.environ, DILOCO_FAULTS="prepare.shard-written@3", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "training.cli", "prepare", "--data", str(src)]
    argv += ["--tokenizer", "byte", "--out", str(tmp_path / "out")]
    killed = subprocess.run(argv, env=env, capture_output=True, cwd=ROOT)
    assert killed.returncode == -9  # SIGKILL: the third shard written, its record not
    assert not (tmp_path / "out" / "index.json").exists()
    first_two = [(tmp_path / "out" / f"meta/00000{i}.json").stat().st_mtime_ns for i in (0, 1)]
    again = prepare(str(src), "byte", str(tmp_path / "out"))
    assert again.skipped == 2 and again.new_tokens == 22  # the parquet's: 9 + 9 + 2 x 2
    assert [(tmp_path / "out" / f"meta/00000{i}.json").stat().st_mtime_ns for i in (0, 1)] == (
        first_two
    )
    prepare(str(src), "byte", str(tmp_path / "clean"))
    assert _index(tmp_path / "out") == _index(tmp_path / "clean")


def test_parallel_workers_write_what_one_process_writes(tmp_path):
    src = _source(tmp_path)
    prepare(str(src), "byte", str(tmp_path / "one"))
    prepare(str(src), "byte", str(tmp_path / "two"), workers=2)
    assert (tmp_path / "one" / "index.json").read_text() == (
        tmp_path / "two" / "index.json"
    ).read_text()


def test_the_command_prints_the_summary_and_its_tokens_load_as_an_array_source(tmp_path, capsys):
    src = _source(tmp_path)
    out = tmp_path / "out"
    code = cli.main(
        ["prepare", "--data", str(src), "--tokenizer", "byte", "--out", f"file://{out}"]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "6 documents, 56 tokens" in printed and "bad input: bad_json 1" in printed
    arrays = data.load_corpus(str(out / "tokens"), eval_fraction=0.0)
    assert np.array_equal(arrays.train, _tokens(out))


def test_a_source_of_token_arrays_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "t.u16.bin").write_bytes(b"\0\0")
    argv = ["prepare", "--data", str(tmp_path / "t.u16.bin"), "--tokenizer", "byte"]
    assert cli.main(argv + ["--out", str(tmp_path / "o")]) == 2
    assert "already token ids" in capsys.readouterr().err


@pytest.mark.integration
def test_shards_go_to_a_bucket(tmp_path, gcs_bucket):  # noqa: F811
    import fsspec

    src = _source(tmp_path)
    url = f"{gcs_bucket}/prepared-{tmp_path.name}"
    s = prepare(str(src), "byte", url, workers=1)
    fs = fsspec.filesystem("gs")
    index = json.loads(fs.cat_file(f"{url}/index.json"))
    local = prepare(str(src), "byte", str(tmp_path / "local"))
    assert (s.tokens, index["shards"]) == (local.tokens, _index(tmp_path / "local")["shards"])


def _index(out: Path) -> dict:
    return json.loads((out / "index.json").read_text())


@pytest.mark.integration
def test_json_lines_are_read_from_a_bucket(tmp_path, gcs_bucket):  # noqa: F811
    # gcsfs files have no readline(limit): reading b.jsonl from the bucket failed with a
    # TypeError; small chunks start units mid-file (the seek and the partial first line)
    import fsspec

    src = _source(tmp_path)
    url = f"{gcs_bucket}/raw-{tmp_path.name}"
    fsspec.filesystem("gs").put(str(src / "b.jsonl"), f"{url}/b.jsonl")
    remote = prepare(url, "byte", str(tmp_path / "remote"), chunk_bytes=10)
    local = prepare(str(src / "b.jsonl"), "byte", str(tmp_path / "local"), chunk_bytes=10)
    assert (remote.documents, remote.problems) == (3, local.problems)
    assert np.array_equal(_tokens(tmp_path / "remote"), _tokens(tmp_path / "local"))
