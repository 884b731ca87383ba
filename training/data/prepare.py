"""`diloco prepare`: text files, JSON lines and Parquet tokenized into shards of token ids.

    prepare("gs://b/raw/", "gs://b/tok/tokenizer.json", "gs://b/corpus/", workers=8)

The source is what `load_corpus` reads (a file, a glob, a directory: hidden files skipped),
on any fsspec URL. By suffix: `*.jsonl` holds one JSON object per line, its text in
`text_field`; `*.parquet` holds the text in column `text_field`; any other file is one
document of UTF-8 text. The work is cut into units of about `chunk_bytes` of input (a group of
whole text files, a line-aligned byte range of a JSON-lines file, row groups of a Parquet file),
each tokenized by one worker process into one shard. The output (any fsspec URL, a bucket too):

    plan.json                the units and the settings, written first: a rerun with other
                             settings is refused, a rerun with the same ones resumes
    tokens/NNNNNN.u16.bin    one unit's documents, each followed by the tokenizer's separator:
                             little-endian uint16 (uint32 for vocabularies over 65536 ids)
    meta/NNNNNN.starts.npy   the offset of each document in the shard (uint64)
    meta/NNNNNN.json         the unit's record (tokens, documents, input bytes, problems, the
                             shard's sha256), written after its shard: the unit is done
    index.json               written last, once every unit is done (`read_index`)

A rerun after a kill skips every unit whose record is there and whose shard has the recorded
size; a unit cut short (no record) is done again from its start. Bad input (a line or file
that is not UTF-8, a line that is not JSON, a missing field or column, a value that is not
text, an empty text) is counted per reason with a few examples, in the unit's record, the index
and the summary; it never stops the run. `tokens/` alone is also a plain token-array source
(`load_corpus`): the same tokens, read into memory. (Over 500 lines: the plan, the three
formats' readers, the worker and the resumable driver are one pipeline, read in one place.)
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import json
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from training.data.corpus import expand_source
from training.data.tokenizer import Tokenizer, load_tokenizer

FORMAT = "diloco-prepared-corpus"
VERSION = 1
INDEX = "index.json"
PLAN = "plan.json"
DEFAULT_CHUNK_BYTES = 64 << 20
BATCH_DOCS = 256  # documents tokenized together (encode_batch)
MAX_EXAMPLES = 5  # examples of bad input kept per unit
MAX_LINE_BYTES = 64 << 20
READ_BYTES = 1 << 20  # JSON lines are read in blocks of this size
MAX_RECORD_BYTES = 16 << 20  # index.json, plan.json and unit records are read up to this size
TEXT_TYPES = ("string", "large_string", "string_view")
BINARY_TYPES = ("binary", "large_binary", "binary_view")


# ---------------------------------------------------------------------------------------------
# The plan


def _kind(path: str) -> str:
    if path.endswith(".jsonl"):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith((".npy", ".bin")):
        raise ValueError(f"{path}: already token ids (use it as data.source as it is)")
    return "text"


def plan_units(
    fs: fsspec.AbstractFileSystem, files: list[str], chunk_bytes: int
) -> list[dict[str, Any]]:
    """The units of work over `files` (sorted), each about `chunk_bytes` of input."""
    sizes = {p: int(fs.size(p)) for p in files}
    units: list[dict[str, Any]] = []
    pending: list[str] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            units.append({"kind": "text", "paths": pending, "bytes": pending_bytes})
        pending, pending_bytes = [], 0

    for path in files:
        kind = _kind(path)
        if kind == "text":
            pending.append(path)
            pending_bytes += sizes[path]
            if pending_bytes >= chunk_bytes:
                flush()
            continue
        flush()
        if kind == "jsonl":
            size = sizes[path]
            for start in range(0, max(size, 1), chunk_bytes):
                end = min(size, start + chunk_bytes)
                units.append(
                    {
                        "kind": "jsonl",
                        "path": path,
                        "start": start,
                        "end": end,
                        "bytes": end - start,
                    }
                )
        else:
            units.extend(_parquet_units(fs, path, chunk_bytes))
    flush()
    return [{"index": i, **u} for i, u in enumerate(units)]


def _parquet_units(fs, path: str, chunk_bytes: int) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError on a bad footer
        raise ValueError(f"{path}: not a Parquet file: {str(exc).splitlines()[0]}") from None
    units, first, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= chunk_bytes or g == meta.num_row_groups - 1:
            units.append({"kind": "parquet", "path": path, "groups": [first, g + 1], "bytes": size})
            first, size = g + 1, 0
    return units or [{"kind": "parquet", "path": path, "groups": [0, 0], "bytes": 0}]


# ---------------------------------------------------------------------------------------------
# Reading one unit's documents


@dataclass
class Problems:
    """Bad input of one unit: counts per reason and the first few examples."""

    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, where: str, n: int = 1) -> None:
        self.counts[reason] += n
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}")


def _text(value: Any, where: str, problems: Problems) -> str | None:
    """A document's text, or None (counted in `problems`) when it is not usable."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            problems.add("non_utf8", where)
            return None
    if value is None or value == "":
        problems.add("empty", where)
        return None
    if not isinstance(value, str):
        problems.add("not_text", where)
        return None
    return value


def _text_docs(fs, unit: dict, problems: Problems) -> Iterator[str]:
    for path in unit["paths"]:
        with fs.open(path, "rb") as f:
            raw = f.read()
        text = _text(raw, path, problems)
        if text is not None:
            yield text


class _Raw(io.RawIOBase):
    """An fsspec file as a raw stream, for `io.BufferedReader`: the buffered files of gcsfs and
    other fsspec filesystems have no `readline(limit)`, which bounds a line's memory."""

    def __init__(self, f):
        self.f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()


def _lines(f, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line that starts in [start, end) of an open binary file."""
    f = io.BufferedReader(_Raw(f), buffer_size=READ_BYTES)
    if start > 0:
        f.seek(start - 1)
        f.readline()  # the rest of the line that started before `start` (another unit's)
    else:
        f.seek(0)
    while (at := f.tell()) < end:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:  # skip the rest of an over-long line
            while line and not line.endswith(b"\n"):
                line = f.readline(MAX_LINE_BYTES)
            yield at, b"\xff"  # counted as not UTF-8: nothing of it is used
            continue
        yield at, line


def _jsonl_docs(fs, unit: dict, text_field: str, problems: Problems) -> Iterator[str]:
    path = unit["path"]
    with fs.open(path, "rb") as f:
        for at, raw in _lines(f, unit["start"], unit["end"]):
            where = f"{path}@{at}"
            if not raw.strip():
                continue  # a blank line is no record
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                problems.add("non_utf8", where)
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                problems.add("bad_json", where)
                continue
            if not isinstance(obj, dict) or text_field not in obj:
                problems.add("missing_field", where)
                continue
            text = _text(obj[text_field], where, problems)
            if text is not None:
                yield text


def _parquet_docs(fs, unit: dict, text_field: str, problems: Problems) -> Iterator[str]:
    import pyarrow.parquet as pq

    path = unit["path"]
    first, last = unit["groups"]
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        rows = sum(pf.metadata.row_group(g).num_rows for g in range(first, last))
        schema = pf.schema_arrow
        if text_field not in schema.names:
            problems.add("missing_column", f"{path} (no column {text_field!r})", rows)
            return
        kind = str(schema.field(text_field).type)
        if kind not in TEXT_TYPES + BINARY_TYPES:
            problems.add("not_text", f"{path} (column {text_field!r} is {kind})", rows)
            return
        row = sum(pf.metadata.row_group(g).num_rows for g in range(first))
        for batch in pf.iter_batches(row_groups=range(first, last), columns=[text_field]):
            for value in batch.column(0).to_pylist():
                text = _text(value, f"{path}#row{row}", problems)
                row += 1
                if text is not None:
                    yield text


def unit_documents(fs, unit: dict, text_field: str, problems: Problems) -> Iterator[str]:
    """The texts of `unit`'s documents, in order; bad input goes to `problems`."""
    if unit["kind"] == "text":
        return _text_docs(fs, unit, problems)
    if unit["kind"] == "jsonl":
        return _jsonl_docs(fs, unit, text_field, problems)
    return _parquet_docs(fs, unit, text_field, problems)


# ---------------------------------------------------------------------------------------------
# One unit: its shard, then its record


def shard_name(index: int, dtype: np.dtype) -> str:
    return f"tokens/{index:06d}.u{dtype.itemsize * 8}.bin"


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_unit(
    src_fs, out_fs, out_root: str, unit: dict, tok: Tokenizer, text_field: str, faults=None
) -> dict[str, Any]:
    """Tokenize `unit` into its shard and starts, then write its record; returns the record."""
    dtype = tok.dtype.newbyteorder("<")
    name = shard_name(unit["index"], dtype)
    problems = Problems()
    sep = np.asarray(tok.separator, dtype=dtype)
    starts: list[int] = []
    tokens = 0
    digest = hashlib.sha256()
    with out_fs.open(f"{out_root}/{name}", "wb") as out:
        docs = unit_documents(src_fs, unit, text_field, problems)
        for batch in _batches(docs, BATCH_DOCS):
            pieces = []
            for ids in tok.encode_arrays(batch):
                starts.append(tokens)
                pieces += [ids.astype(dtype, copy=False), sep]
                tokens += len(ids) + len(sep)
            chunk = np.concatenate(pieces).tobytes()
            digest.update(chunk)
            out.write(chunk)
    buf = io.BytesIO()
    np.save(buf, np.asarray(starts, dtype="<u8"), allow_pickle=False)
    starts_name = f"meta/{unit['index']:06d}.starts.npy"
    out_fs.pipe_file(f"{out_root}/{starts_name}", buf.getvalue())
    if faults is not None:
        faults.hit("prepare.shard-written")
    record = {
        "unit": unit["index"],
        "shard": name,
        "starts": starts_name,
        "tokens": tokens,
        "documents": len(starts),
        "bytes_in": unit["bytes"],
        "sha256": digest.hexdigest(),
        "problems": dict(problems.counts),
        "examples": problems.examples,
    }
    out_fs.pipe_file(f"{out_root}/meta/{unit['index']:06d}.json", json.dumps(record).encode())
    return record


_worker: dict[str, Any] = {}


def _init_worker(spec: str, sha256: str, threads: bool) -> None:
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(spec)
    if tok.sha256 != sha256:
        raise RuntimeError(f"tokenizer {spec!r} changed while preparing")
    _worker["tok"] = tok


def _run_unit(src_fs, out_fs, out_root: str, unit: dict, text_field: str) -> dict:
    return prepare_unit(src_fs, out_fs, out_root, unit, _worker["tok"], text_field)


# ---------------------------------------------------------------------------------------------
# The whole run


def _read_json(fs, path: str) -> dict | None:
    """A JSON object at `path`, or None when it is missing, too large or not one."""
    try:
        with fs.open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _done(out_fs, out_root: str, unit: dict, itemsize: int) -> dict | None:
    """The unit's record when the unit is done: the record parses, names the unit and its
    shard has the recorded size; else None (the unit is done again)."""
    rec = _read_json(out_fs, f"{out_root}/meta/{unit['index']:06d}.json")
    if rec is None or rec.get("unit") != unit["index"] or not isinstance(rec.get("tokens"), int):
        return None
    try:
        size = out_fs.size(f"{out_root}/{rec['shard']}")
    except (FileNotFoundError, KeyError, TypeError):
        return None
    return rec if size == rec["tokens"] * itemsize else None


@dataclass
class Summary:
    """What a `prepare` run did (`line()`: the CLI's final summary)."""

    units: int = 0
    skipped: int = 0  # units done by an earlier run
    documents: int = 0
    tokens: int = 0
    bytes_in: int = 0
    new_tokens: int = 0  # tokens this run wrote
    seconds: float = 0.0
    problems: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        bad = ", ".join(f"{k} {v}" for k, v in sorted(self.problems.items())) or "none"
        return (
            f"{self.documents} documents, {self.tokens} tokens from {self.bytes_in} bytes in "
            f"{self.units} shards ({self.skipped} done before); {self.tokens_per_s:,.0f} "
            f"tokens/s; bad input: {bad}"
        )


def prepare(
    source: str,
    tokenizer: str,
    out: str,
    workers: int = 1,
    text_field: str = "text",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[dict, Summary], None] | None = None,
    faults=None,
) -> Summary:
    """Tokenize `source` into a prepared corpus at `out` (module docstring); resumable.

    `workers` processes tokenize units in parallel (1: in this process). `progress(record,
    summary)` is called after each unit. `faults`: an object with `hit(point)` (a FaultPlan):
    `prepare.shard-written` (in this process, `workers` 1), `prepare.unit-done`. ValueError
    (one line) for a source, tokenizer or output that cannot be used."""
    if workers < 1 or chunk_bytes < 1:
        raise ValueError(f"workers and chunk_bytes must be positive: {workers}, {chunk_bytes}")
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    src_fs, files, _ = expand_source(source)
    units = plan_units(src_fs, files, chunk_bytes)
    out_fs, out_root = fsspec.core.url_to_fs(out)
    out_root = out_root.rstrip("/")
    settings = {
        "format": FORMAT,
        "version": VERSION,
        "source": source,
        "tokenizer": tok.identity(),
        "text_field": text_field,
        "chunk_bytes": chunk_bytes,
        "dtype": tok.dtype.name,
        "units": units,
    }
    _write_plan(out_fs, out_root, settings)
    itemsize = tok.dtype.itemsize
    records: dict[int, dict] = {}
    summary = Summary(units=len(units))
    for unit in units:
        rec = _done(out_fs, out_root, unit, itemsize)
        if rec is not None:
            records[unit["index"]] = rec
            summary.skipped += 1
    todo = [u for u in units if u["index"] not in records]

    def finished(rec: dict, new: bool) -> None:
        records[rec["unit"]] = rec
        if new:
            summary.new_tokens += rec["tokens"]
        if faults is not None:
            faults.hit("prepare.unit-done")
        if progress is not None:
            progress(rec, summary)

    if workers == 1 or len(todo) <= 1:
        for unit in todo:
            finished(prepare_unit(src_fs, out_fs, out_root, unit, tok, text_field, faults), True)
    else:
        ctx = multiprocessing.get_context("spawn")
        init = (tokenizer, tok.sha256, False)
        with cf.ProcessPoolExecutor(workers, ctx, _init_worker, init) as pool:
            futures = [
                pool.submit(_run_unit, src_fs, out_fs, out_root, u, text_field) for u in todo
            ]
            for fut in cf.as_completed(futures):
                finished(fut.result(), True)
    ordered = [records[u["index"]] for u in units]
    for rec in ordered:
        summary.documents += rec["documents"]
        summary.tokens += rec["tokens"]
        summary.bytes_in += rec["bytes_in"]
        for reason, n in rec["problems"].items():
            summary.problems[reason] = summary.problems.get(reason, 0) + n
        summary.examples += rec["examples"][: max(0, 20 - len(summary.examples))]
    index = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tok.identity(),
        "separator": list(tok.separator),
        "dtype": tok.dtype.name,
        "shards": [
            {k: r[k] for k in ("shard", "starts", "tokens", "documents", "sha256")} for r in ordered
        ],
        "documents": summary.documents,
        "tokens": summary.tokens,
        "bytes_in": summary.bytes_in,
        "problems": summary.problems,
        "examples": summary.examples,
    }
    out_fs.pipe_file(f"{out_root}/{INDEX}", json.dumps(index, indent=1).encode())
    summary.seconds = time.perf_counter() - t0
    return summary


def _write_plan(out_fs, out_root: str, settings: dict) -> None:
    """Write plan.json, or check that the one there has the same settings (a resume)."""
    path = f"{out_root}/{PLAN}"
    if out_fs.exists(path):
        old = _read_json(out_fs, path)
        if old != json.loads(json.dumps(settings)):
            diff = "unreadable" if old is None else _first_difference(old, settings)
            raise ValueError(
                f"{out_root} holds a preparation with other settings ({diff}); use another --out"
            )
        return
    out_fs.makedirs(f"{out_root}/tokens", exist_ok=True)
    out_fs.makedirs(f"{out_root}/meta", exist_ok=True)
    out_fs.pipe_file(path, json.dumps(settings).encode())


def _first_difference(old: dict, new: dict) -> str:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != json.loads(json.dumps(new.get(key))):
            return f"{key} differs"
    return "same"
