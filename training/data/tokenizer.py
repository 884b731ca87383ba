"""Tokenizers: what `data.tokenizer` names, loaded from a file the user brings.

    load_tokenizer("byte")                         UTF-8 bytes, ids 0..255 (the default)
    load_tokenizer("gs://b/tok/tokenizer.json")    a Hugging Face `tokenizers` file
    load_tokenizer("/data/spm/en.model")           a SentencePiece model

A spec other than `byte` is a local path or any fsspec URL; its suffix says the kind (`.json`:
Hugging Face, `.model`: SentencePiece). The file is read once, at most `MAX_TOKENIZER_BYTES`,
and parsed by the library that owns the format; nothing is fetched from a hub. A file that does
not parse is a one-line ValueError.

Every tokenizer has the same small interface (`Tokenizer`): `encode(str) -> list[int]`,
`decode(list[int]) -> str`, `vocab_size`, `name`, `sha256` (the identity of the file: the sha256
of its bytes; for `byte`, of the word "byte"), `separator` (the ids placed between two
documents) and `data` (the file's bytes, for an export to write beside a model).

`bind_tokenizer(cfg)` is the rule that ties an experiment to its tokenizer (`diloco init` applies
it before anything is written): the model's `vocab_size` follows a file tokenizer when the config
does not set it, a tokenizer larger than the model is a one-line ConfigError, and the file's
sha256 is recorded as `data.tokenizer_sha256` in config.json, which every later load checks
(`tokenizer_for`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import fsspec
import numpy as np

from training.config.experiment import ExperimentConfig, with_overrides
from training.config.sections import ConfigError

BYTE = "byte"
BYTE_VOCAB_SIZE = 256
BYTE_SHA256 = hashlib.sha256(BYTE.encode()).hexdigest()
DOC_SEPARATOR = "\n\n"
MAX_TOKENIZER_BYTES = 256 << 20
# the end-of-text tokens a Hugging Face tokenizer may define, tried in this order as the
# document separator (none: the separator is the encoding of DOC_SEPARATOR)
HF_END_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
UINT16_LIMIT = 1 << 16  # ids below it fit uint16 shards; above it, shards are uint32


class Tokenizer:
    """The interface every tokenizer has; `ByteTokenizer`, `HFTokenizer`, `SPTokenizer`."""

    kind: str = ""
    name: str = ""
    sha256: str = ""
    vocab_size: int = 0
    separator: tuple[int, ...] = ()
    data: bytes | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (a tokenizer may do it in parallel threads)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Any) -> str:
        raise NotImplementedError

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """`encode_batch` as arrays of `dtype`."""
        return [np.asarray(ids, dtype=self.dtype) for ids in self.encode_batch(texts)]

    @property
    def dtype(self) -> np.dtype:
        """The narrowest shard dtype that holds every id: uint16 or uint32."""
        return np.dtype(np.uint16 if self.vocab_size <= UINT16_LIMIT else np.uint32)

    def identity(self) -> dict[str, Any]:
        """What records and exports keep of this tokenizer."""
        return {
            "kind": self.kind,
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
        }

    def __repr__(self) -> str:
        return f"<{self.kind} tokenizer {self.name} vocab={self.vocab_size} {self.sha256[:12]}>"


def _ids(ids: Any, vocab_size: int) -> list[int]:
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
    return arr.astype(np.int64).tolist()


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes; decoding replaces invalid UTF-8 with U+FFFD."""

    kind = BYTE
    name = BYTE
    sha256 = BYTE_SHA256
    vocab_size = BYTE_VOCAB_SIZE
    separator = tuple(DOC_SEPARATOR.encode())

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        return bytes(_ids(ids, self.vocab_size)).decode("utf-8", errors="replace")

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint16) for t in texts]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` file (tokenizer.json). No special tokens are added on encode
    (documents are joined with `separator`); decode keeps special tokens."""

    kind = "huggingface"

    def __init__(self, data: bytes, name: str):
        from tokenizers import Tokenizer as HF

        try:
            self._tok = HF.from_str(data.decode("utf-8"))
        except Exception as exc:  # the library raises plain Exception on a bad file
            raise ValueError(
                f"{name}: not a Hugging Face tokenizer.json: {_first_line(exc)}"
            ) from None
        self.data, self.name = data, name
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        end = next((i for t in HF_END_TOKENS if (i := self._tok.token_to_id(t)) is not None), None)
        self.separator = (end,) if end is not None else tuple(self.encode(DOC_SEPARATOR))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        return self._tok.decode(_ids(ids, self.vocab_size), skip_special_tokens=False)


class SPTokenizer(Tokenizer):
    """A SentencePiece model; documents are separated by its end-of-sentence id when it has
    one (by default it has), else by the encoding of DOC_SEPARATOR."""

    kind = "sentencepiece"

    def __init__(self, data: bytes, name: str):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except Exception as exc:  # RuntimeError, or an OSError from the C++ side
            raise ValueError(f"{name}: not a SentencePiece model: {_first_line(exc)}") from None
        self.data, self.name = data, name
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.separator = (eos,) if eos >= 0 else tuple(self.encode(DOC_SEPARATOR))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: Any) -> str:
        return self._sp.decode(_ids(ids, self.vocab_size))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def _read_bounded(spec: str) -> bytes:
    try:
        with fsspec.open(spec, "rb") as f:
            data = f.read(MAX_TOKENIZER_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"tokenizer {spec!r} not found") from None
    except OSError as exc:
        raise ValueError(f"tokenizer {spec!r}: {_first_line(exc)}") from None
    if len(data) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"tokenizer {spec!r} is larger than {MAX_TOKENIZER_BYTES} bytes")
    return data


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names: `byte`, a `*.json` (Hugging Face) or a `*.model`
    (SentencePiece) path or fsspec URL. ValueError (one line) for anything else."""
    if spec == BYTE:
        return ByteTokenizer()
    path = spec.split("?", 1)[0]
    if path.endswith(".json"):
        cls: type[HFTokenizer] | type[SPTokenizer] = HFTokenizer
    elif path.endswith(".model"):
        cls = SPTokenizer
    else:
        raise ValueError(
            f"tokenizer {spec!r}: expected 'byte', a Hugging Face tokenizer.json (*.json) or a "
            "SentencePiece model (*.model)"
        )
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return cls(_read_bounded(spec), name)


@functools.cache
def _cached(spec: str) -> Tokenizer:
    return load_tokenizer(spec)


def tokenizer_for(cfg: ExperimentConfig) -> Tokenizer:
    """The experiment's tokenizer (loaded once per process), checked against the sha256 that
    config.json records: a file changed since `init` is a one-line ConfigError."""
    tok = _cached(cfg.data.tokenizer)
    want = cfg.data.tokenizer_sha256
    if want is not None and want != tok.sha256:
        raise ConfigError(
            f"data.tokenizer {cfg.data.tokenizer!r} has sha256 {tok.sha256[:16]}..., the "
            f"experiment recorded {want[:16]}... (the file changed since init)"
        )
    return tok


def bind_tokenizer(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` tied to its tokenizer (the rule `diloco init` applies before writing config.json):
    a file tokenizer's sha256 recorded as `data.tokenizer_sha256` (or checked against it when
    the config pins one) and its vocabulary as `model.vocab_size` when the config leaves that
    unset; `byte` keeps the preset's vocabulary and records no hash (its name is its identity).
    ConfigError (one line) when the tokenizer does not load, does not match the pinned sha256,
    or is larger than the model."""
    try:
        tok = load_tokenizer(cfg.data.tokenizer)
    except ValueError as exc:
        raise ConfigError(f"data.tokenizer: {exc}") from None
    pinned = cfg.data.tokenizer_sha256
    if pinned is not None and pinned != tok.sha256:
        raise ConfigError(
            f"data.tokenizer {cfg.data.tokenizer!r} has sha256 {tok.sha256[:16]}..., "
            f"data.tokenizer_sha256 pins {pinned[:16]}..."
        )
    updates: dict[str, Any] = {}
    if tok.kind != BYTE:
        updates["data.tokenizer_sha256"] = tok.sha256
        if cfg.model.vocab_size is None:
            updates["model.vocab_size"] = tok.vocab_size
    bound = with_overrides(cfg, updates) if updates else cfg
    vocab = bound.model.dims()["vocab_size"]
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"data.tokenizer {tok.name} has {tok.vocab_size} tokens, more than the model's "
            f"vocab_size {vocab} (unset model.vocab_size to follow the tokenizer)"
        )
    return bound
