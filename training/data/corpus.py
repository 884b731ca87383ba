"""Training data sources: built-in corpus, byte tokenizer, fsspec sources -> a `Corpus`
(training/data/batches.py: the island shards and resumable batches cut from it).

Sources (`load_corpus(source)`):
- `"builtin:pydoc"`: English prose shipped with CPython, no download. The language reference topics
  (`pydoc_data.topics`) plus the docstrings of the stdlib's pure-Python modules (parsed with `ast`,
  never imported). Each topic and each module is one document.
- any fsspec URL, glob or directory of text files (`file:///x/*.txt`, `gs://b/*.txt`, `/data/corpus`,
  `memory://...`): each file is one document, tokenized with the experiment's tokenizer
  (training/data/tokenizer.py; UTF-8 bytes by default). A directory means every file below it,
  recursively, except hidden ones (a path component starting with ".").
- pre-tokenized shards: `*.npy` or raw little-endian `*.u16.bin` / `*.u32.bin` (uint16 / uint32).

Documents are joined with the tokenizer's separator (`DOC_SEPARATOR` as bytes for `byte`). Text
sources split train / eval per document by a stable hash of the document id; array sources hold out
the last `eval_fraction` of each file's tokens. A file's document id is its path relative to the
source root (the directory given, a glob's directories before its first wildcard, a single file's
folder), so the split does not depend on where the corpus lives: the same files under two
directories give the same split.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from training.data.batches import Corpus, fingerprint
from training.data.stream import is_prepared, open_prepared, read_index
from training.data.tokenizer import BYTE_VOCAB_SIZE, DOC_SEPARATOR, ByteTokenizer, Tokenizer

VOCAB_SIZE = BYTE_VOCAB_SIZE
BUILTIN_SOURCE = "builtin:pydoc"

_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "site-packages",
        "dist-packages",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "pydoc_data",
        "__pycache__",
    }
)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BIN_DTYPES = {".u16.bin": np.uint16, ".u32.bin": np.uint32}
_GLOB_CHARS = "*?["


# ---------------------------------------------------------------------------------------------
# Tokenizer


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as uint16 token ids (0..255)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(ids: Any) -> str:
    """Inverse of `encode`; invalid UTF-8 becomes U+FFFD."""
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"byte tokenizer ids must be in [0, {VOCAB_SIZE}), got max {arr.max()}")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Built-in corpus


def _stdlib_sources() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "."))
        )
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(dirpath) / filename
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _collect_docstrings(body: list[ast.stmt], out: list[str]) -> None:
    for node in body:
        if isinstance(node, _DEFS):
            doc = ast.get_docstring(node)
            if doc:
                out.append(doc)
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if children:
                _collect_docstrings(children, out)


def _module_text(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return ""
    parts: list[str] = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(doc)
    _collect_docstrings(tree.body, parts)
    return DOC_SEPARATOR.join(parts)


@functools.cache
def builtin_documents() -> tuple[tuple[str, str], ...]:
    """The `builtin:pydoc` corpus as (document id, text) pairs, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [(f"topic/{name}", topics[name].strip()) for name in sorted(topics)]
    for relpath, path in _stdlib_sources():
        text = _module_text(path).strip()
        if text:
            docs.append((f"module/{relpath}", text))
    return tuple((doc_id, text) for doc_id, text in docs if text)


# ---------------------------------------------------------------------------------------------
# Corpus loading


def _stable_unit(doc_id: str) -> float:
    """A number in [0, 1) that depends only on `doc_id`."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _join(docs: list[np.ndarray], dtype: type, separator: tuple[int, ...]) -> np.ndarray:
    if not docs:
        return np.zeros(0, dtype=dtype)
    sep = np.asarray(separator, dtype=dtype)
    pieces: list[np.ndarray] = []
    for doc in docs:
        pieces.extend((doc.astype(dtype, copy=False), sep))
    return np.concatenate(pieces)


def _split_documents(
    docs: list[tuple[str, np.ndarray]], eval_fraction: float, tok: Tokenizer
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Hash split by document id; if either side ends up empty, hold out each document's tail."""
    train = [toks for doc_id, toks in docs if _stable_unit(doc_id) >= eval_fraction]
    held = [toks for doc_id, toks in docs if _stable_unit(doc_id) < eval_fraction]
    if eval_fraction > 0 and (not train or not held):
        cuts = [len(toks) - int(round(len(toks) * eval_fraction)) for _, toks in docs]
        train = [toks[:cut] for (_, toks), cut in zip(docs, cuts, strict=True)]
        held = [toks[cut:] for (_, toks), cut in zip(docs, cuts, strict=True)]
    dtype, sep = tok.dtype, tok.separator
    return _join(train, dtype, sep), _join(held, dtype, sep), len(train), len(held)


def source_root(path: str, is_dir: bool) -> str:
    """The folder document ids are relative to, for a path without its protocol: a directory
    itself, a glob's leading components before the first one with a wildcard, else the parent."""
    parts = path.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in _GLOB_CHARS):
            return "/".join(parts[:i])
    return "/".join(parts if is_dir else parts[:-1])


def relative_id(path: str, root: str) -> str:
    """`path` relative to `root` (posix); the path itself if it is not below `root`."""
    prefix = root.rstrip("/") + "/" if root else ""
    return path[len(prefix) :] if path.startswith(prefix) else path


def _visible(path: str, root: str) -> bool:
    return not any(part.startswith(".") for part in relative_id(path, root).split("/"))


def expand_source(source: str) -> tuple[fsspec.AbstractFileSystem, list[str], str]:
    """The filesystem, the files of `source` (sorted) and the root their ids are relative to."""
    fs, _, paths = fsspec.core.get_fs_token_paths(source, mode="rb")
    stripped = fs._strip_protocol(source)
    is_dir = not any(c in stripped for c in _GLOB_CHARS) and len(paths) == 1 and fs.isdir(paths[0])
    root = source_root(stripped, is_dir)
    if is_dir:
        files = sorted(p for p in fs.find(paths[0]) if _visible(p, root))
    else:
        files = sorted(p for p in paths if not fs.isdir(p))
    if not files:
        raise ValueError(f"data source {source!r} matches no files")
    return fs, files, root


def _array_dtype(path: str, dtype: str | None) -> np.dtype:
    if dtype is not None:
        resolved = np.dtype(dtype)
    else:
        suffix = next((s for s in _BIN_DTYPES if path.endswith(s)), None)
        if suffix is None:
            raise ValueError(
                f"{path}: raw .bin shards need a dtype suffix (.u16.bin / .u32.bin) or dtype="
            )
        resolved = np.dtype(_BIN_DTYPES[suffix])
    if resolved not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(f"{path}: token arrays must be uint16 or uint32, got {resolved}")
    return resolved.newbyteorder("<")


def _load_array(fs: fsspec.AbstractFileSystem, path: str, dtype: str | None) -> np.ndarray:
    with fs.open(path, "rb") as f:
        if path.endswith(".npy"):
            arr = np.load(f, allow_pickle=False)
        else:
            raw = f.read()
            wire = _array_dtype(path, dtype)
            if len(raw) % wire.itemsize:
                raise ValueError(f"{path}: {len(raw)} bytes is not a multiple of {wire.itemsize}")
            arr = np.frombuffer(raw, dtype=wire)
    if arr.dtype.kind != "u" or arr.dtype.itemsize not in (2, 4):
        raise ValueError(f"{path}: token arrays must be uint16 or uint32, got {arr.dtype}")
    return arr.reshape(-1).astype(arr.dtype.newbyteorder("="), copy=False)


def _check_vocab(tokens: np.ndarray, path: str, vocab_size: int) -> None:
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"{path}: max token {int(tokens.max())} does not fit vocab_size {vocab_size}"
        )


def _load_arrays(
    source: str,
    fs: fsspec.AbstractFileSystem,
    files: list[str],
    eval_fraction: float,
    vocab_size: int | None,
    dtype: str | None,
) -> Corpus:
    train, held = [], []
    max_token = -1
    for path in files:
        tokens = _load_array(fs, path, dtype)
        if vocab_size is not None:
            _check_vocab(tokens, path, vocab_size)
        if tokens.size:
            max_token = max(max_token, int(tokens.max()))
        cut = len(tokens) - int(round(len(tokens) * eval_fraction))
        train.append(tokens[:cut])
        held.append(tokens[cut:])
    out_dtype = np.result_type(*(t.dtype for t in train))
    train_tokens = np.concatenate(train).astype(out_dtype, copy=False)
    eval_tokens = np.concatenate(held).astype(out_dtype, copy=False)
    return Corpus(
        train=train_tokens,
        eval=eval_tokens,
        vocab_size=vocab_size if vocab_size is not None else max_token + 1,
        source=source,
        fingerprint=fingerprint(train_tokens),
        train_documents=len(files),
        eval_documents=len(files) if eval_tokens.size else 0,
    )


def _tokenize(texts: list[tuple[str, str]], tok: Tokenizer) -> list[tuple[str, np.ndarray]]:
    """(document id, tokens) of each (document id, text)."""
    arrays = tok.encode_arrays([text for _, text in texts])
    return [(doc_id, toks) for (doc_id, _), toks in zip(texts, arrays, strict=True)]


def _read_text_files(
    fs: fsspec.AbstractFileSystem, files: list[str], root: str, tok: Tokenizer
) -> list[tuple[str, np.ndarray]]:
    """(document id relative to `root`, tokens) per file: UTF-8 bytes as they are for the byte
    tokenizer (invalid UTF-8 included), the file decoded as UTF-8 (invalid bytes become
    U+FFFD) and encoded by any other."""
    docs = []
    for path in files:
        with fs.open(path, "rb") as f:
            raw = f.read()
        if tok.kind == "byte":
            docs.append((relative_id(path, root), np.frombuffer(raw, np.uint8).astype(np.uint16)))
        else:
            text = raw.decode("utf-8", errors="replace")
            docs.extend(_tokenize([(relative_id(path, root), text)], tok))
    return docs


def _is_array_path(path: str) -> bool:
    return path.endswith((".npy", ".bin"))


def check_source(source: str) -> None:
    """That `source` can be read, before anything is made of it (`diloco init`, the Airflow
    `init` task): the built-in corpus, a prepared corpus's index.json, or files that exist.
    Reads a listing and at most an index; ValueError (one line) naming what is wrong."""
    if source == BUILTIN_SOURCE:
        return
    if source.startswith("builtin:"):
        raise ValueError(f"unknown built-in corpus {source!r}; known: {BUILTIN_SOURCE!r}")
    if is_prepared(source):
        read_index(source)
        return
    try:
        fs, files, _ = expand_source(source)
        missing = not fs.exists(files[0])
    except (OSError, ValueError) as err:
        raise ValueError(f"data source {source!r} cannot be read: {err}") from None
    if missing:
        raise ValueError(f"data source {source!r} does not exist")


def load_corpus(
    source: str = BUILTIN_SOURCE,
    eval_fraction: float = 0.05,
    vocab_size: int | None = None,
    dtype: str | None = None,
    tokenizer: Tokenizer | None = None,
) -> Corpus:
    """Load `source` and split it into train and held-out eval tokens.

    `vocab_size` is the model's vocabulary: every token must be below it. Without it, text sources
    report the tokenizer's vocabulary and array sources `max token + 1`. `dtype` ("uint16" /
    "uint32") overrides the suffix of raw `.bin` shards. `tokenizer` encodes text sources
    (default: UTF-8 bytes); token arrays are used as they are. A `diloco prepare` output
    directory (its index.json) is streamed, not loaded (training/data/stream.py).
    """
    tok = tokenizer or ByteTokenizer()
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if source == BUILTIN_SOURCE:
        docs = _tokenize(list(builtin_documents()), tok)
    elif source.startswith("builtin:"):
        raise ValueError(f"unknown built-in corpus {source!r}; known: {BUILTIN_SOURCE!r}")
    elif is_prepared(source):
        sha = tokenizer.sha256 if tokenizer is not None else None
        return open_prepared(source, eval_fraction, vocab_size, tokenizer_sha256=sha)
    else:
        fs, files, root = expand_source(source)
        kinds = {_is_array_path(p) for p in files}
        if kinds == {True, False}:
            raise ValueError(f"data source {source!r} mixes text files and token arrays")
        if kinds == {True}:
            return _load_arrays(source, fs, files, eval_fraction, vocab_size, dtype)
        docs = _read_text_files(fs, files, root, tok)
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise ValueError(
            f"text source {source!r} with tokenizer {tok.name} needs vocab_size >= {tok.vocab_size}"
        )
    train, held, n_train, n_eval = _split_documents(docs, eval_fraction, tok)
    return Corpus(
        train=train,
        eval=held,
        vocab_size=tok.vocab_size,
        source=source,
        fingerprint=fingerprint(train),
        train_documents=n_train,
        eval_documents=n_eval,
    )
