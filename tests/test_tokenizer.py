"""Tokenizers (training/data/tokenizer.py): byte, a Hugging Face tokenizer.json and a
SentencePiece model, each trained here by its own library, loaded back by path and by fsspec URL;
the experiment's rule (`bind_tokenizer`) and the corpus tokenized with them."""

from __future__ import annotations

import hashlib
import io

import fsspec
import numpy as np
import pytest

from tests.helpers import small_config
from training.config.experiment import ConfigError
from training.data import corpus as data
from training.data import tokenizer as tk
from training.store.experiment import ExperimentStore
from training.store.registry import open_store
from training.usecases.create import create_or_join

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Pack my box with five dozen liquor jugs; naïve café. " * 4,
    "Sphinx of black quartz, judge my vow! " * 4,
]


def train_bpe(path, vocab_size: int = 300, texts=None) -> None:
    """A byte-level BPE tokenizer.json trained by the `tokenizers` package on `texts`
    (default TEXTS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS if texts is None else texts, trainer)
    tok.save(str(path))


def train_sentencepiece(path, vocab_size: int = 48) -> None:
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20),
        model_writer=out,
        vocab_size=vocab_size,
        minloglevel=2,
    )
    path.write_bytes(out.getvalue())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    train_bpe(root / "bpe.json")
    train_sentencepiece(root / "sp.model")
    return root


def test_byte_tokenizer_is_utf8_bytes():
    tok = tk.load_tokenizer("byte")
    assert tok.encode("é!") == [0xC3, 0xA9, 0x21]
    assert tok.decode([0xC3, 0xA9, 0x21]) == "é!"
    assert (tok.vocab_size, tok.sha256) == (256, hashlib.sha256(b"byte").hexdigest())
    assert tok.separator == (10, 10)  # "\n\n", what the corpus always joined documents with


@pytest.mark.parametrize("name, kind", [("bpe.json", "huggingface"), ("sp.model", "sentencepiece")])
def test_file_tokenizer_round_trips_and_is_named_by_its_hash(files, name, kind):
    tok = tk.load_tokenizer(str(files / name))
    ids = tok.encode("The lazy fox, a quartz sphinx.")
    assert tok.kind == kind and tok.name == name
    assert tok.decode(ids) == "The lazy fox, a quartz sphinx."
    assert max(ids) < tok.vocab_size and tok.dtype == np.uint16
    assert tok.sha256 == hashlib.sha256((files / name).read_bytes()).hexdigest()


def test_a_tokenizer_loads_from_an_fsspec_url(files):
    with fsspec.open(f"memory://tok-{id(files)}/bpe.json", "wb") as f:
        f.write((files / "bpe.json").read_bytes())
    remote = tk.load_tokenizer(f"memory://tok-{id(files)}/bpe.json")
    local = tk.load_tokenizer(str(files / "bpe.json"))
    assert remote.sha256 == local.sha256
    assert remote.encode(TEXTS[1]) == local.encode(TEXTS[1])


def test_separators_are_the_end_of_text_tokens(files):
    hf = tk.load_tokenizer(str(files / "bpe.json"))
    sp = tk.load_tokenizer(str(files / "sp.model"))
    assert hf.separator == (0,)  # <|endoftext|>, the trainer's first special token
    assert sp.separator == (2,)  # SentencePiece's default eos id


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.json", b"{not json", "not a Hugging Face tokenizer.json"),
        ("bad.model", b"\x00garbage", "not a SentencePiece model"),
        ("vocab.txt", b"a\nb\n", "expected 'byte'"),
        ("missing.json", None, "not found"),
    ],
)
def test_a_bad_tokenizer_is_a_one_line_error(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        tk.load_tokenizer(str(tmp_path / name))
    assert "\n" not in str(err.value)


def test_the_model_vocabulary_follows_a_file_tokenizer(files):
    spec = str(files / "bpe.json")
    cfg = tk.bind_tokenizer(small_config(data={"tokenizer": spec}))
    tok = tk.load_tokenizer(spec)
    assert cfg.model.vocab_size == tok.vocab_size == 300
    assert cfg.data.tokenizer_sha256 == tok.sha256


def test_byte_keeps_the_presets_vocabulary_and_records_no_hash():
    cfg = tk.bind_tokenizer(small_config(model={"preset": "125m"}))
    assert cfg.model.dims()["vocab_size"] == 50304 and cfg.data.tokenizer_sha256 is None


def test_a_tokenizer_larger_than_the_model_is_refused(files):
    cfg = small_config(data={"tokenizer": str(files / "bpe.json")}, model={"vocab_size": 299})
    with pytest.raises(ConfigError, match="has 300 tokens, more than the model's vocab_size 299"):
        tk.bind_tokenizer(cfg)


def test_a_pinned_hash_that_differs_is_refused(files):
    cfg = small_config(data={"tokenizer": str(files / "bpe.json"), "tokenizer_sha256": "0" * 64})
    with pytest.raises(ConfigError, match="tokenizer_sha256 pins 0000000000000000"):
        tk.bind_tokenizer(cfg)


def test_a_file_changed_since_init_is_refused(tmp_path):
    train_bpe(tmp_path / "t.json")
    cfg = tk.bind_tokenizer(small_config(data={"tokenizer": str(tmp_path / "t.json")}))
    train_bpe(tmp_path / "t.json", vocab_size=290)  # replaced under the same name
    tk._cached.cache_clear()
    with pytest.raises(ConfigError, match="the file changed since init"):
        tk.tokenizer_for(cfg)


def test_text_sources_are_tokenized_with_the_tokenizer(files, tmp_path):
    for i, text in enumerate(TEXTS * 10):
        (tmp_path / "c" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "c" / f"{i:02d}.txt").write_text(text)
    tok = tk.load_tokenizer(str(files / "bpe.json"))
    c = data.load_corpus(str(tmp_path / "c"), eval_fraction=0.2, tokenizer=tok)
    assert c.vocab_size == 300 and c.train.dtype == np.uint16
    # BPE merges: fewer tokens than bytes (each text here is ASCII but for two characters)
    assert len(c.train) + len(c.eval) < sum(len(t.encode()) for t in TEXTS * 10)
    first_doc = c.train[: np.flatnonzero(c.train == 0)[0]]  # up to the first <|endoftext|>
    assert tok.decode(first_doc) in TEXTS
    with pytest.raises(ValueError, match="needs vocab_size >= 300"):
        data.load_corpus(str(tmp_path / "c"), vocab_size=256, tokenizer=tok)


def test_init_records_the_tokenizer_and_sizes_the_model(files, tmp_path):
    spec = str(files / "sp.model")
    cfg = small_config("tok", data={"tokenizer": spec}).model_copy(
        update={"store_url": f"file://{tmp_path}/s"}
    )
    result = create_or_join(cfg, ExperimentStore(open_store(cfg.store_url), cfg.name))
    stored = ExperimentStore(open_store(cfg.store_url), cfg.name).read_config()
    assert stored["model"]["vocab_size"] == 48 == result.config.model.vocab_size
    assert stored["data"]["tokenizer_sha256"] == tk.load_tokenizer(spec).sha256
    assert result.initial_loss is not None
