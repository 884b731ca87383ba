"""A model out of the store and back: the export directory `diloco export` writes and
`diloco sample --from DIR` reads.

The directory: `model.safetensors` (the whole model, tensors named by their Flax paths),
`config.json` (family, preset, sizes, the full model section, the tokenizer's identity, what
was exported) and, for a file tokenizer (Hugging Face `tokenizer.json`, SentencePiece `.model`),
that file beside them (its name in `config.json` as `tokenizer.file`), so the directory
is enough to encode and decode. `load_export` trusts nothing in it: bounded reads, a strict
model section, every tensor's name, shape and dtype checked against the model the section
describes, finite values, and the tokenizer file checked against its recorded sha256.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np

from training.config.experiment import ConfigError, ModelConfig
from training.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from training.store import safejson
from training.store.tensors import MAX_HEADER_BYTES

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def write_export(
    out: Path, cfg, params: dict[str, np.ndarray], tok: Tokenizer, what: dict[str, Any]
) -> dict[str, Any]:
    """Write `params` of experiment `cfg` (an ExperimentConfig) to `out`; `what`: the
    export's provenance (experiment, snapshot) recorded in config.json. Returns config.json."""
    from safetensors.numpy import save

    out.mkdir(parents=True, exist_ok=True)
    (out / WEIGHTS).write_bytes(save({k: np.ascontiguousarray(v) for k, v in params.items()}))
    identity = tok.identity()
    if tok.data is not None:  # the tokenizer travels with the model
        (out / tok.name).write_bytes(tok.data)
        identity["file"] = tok.name
    config = {
        "family": cfg.model.family,
        "preset": cfg.model.preset,
        "dims": cfg.model.dims(),
        "tokenizer": identity,
        "model": cfg.model.model_dump(mode="json"),
        **what,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def check_out(out: Path, overwrite: bool) -> None:
    """ConfigError (one line) when `out` holds anything and `overwrite` is not given: another
    model's files would stay beside this one's (its tokenizer.json beside a byte model)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(
            f"--out {out}: exists and is not empty (another model's files would stay beside "
            "this one's): choose a new directory, or --overwrite to replace it whole"
        )


def export_to(
    out: Path,
    cfg,
    params: dict[str, np.ndarray],
    tok: Tokenizer,
    what: dict[str, Any],
    fmt: str,
    store_url: str,
    snapshot,
    record: dict[str, Any] | None,
) -> None:
    """`params` of `snapshot` (None: HEADs that were empty) exported to `out` in format `fmt`
    ("safetensors", "orbax": also an Orbax tree in out/orbax, "hf": transformers' layout),
    with export.json: experiment, store, snapshot, versions, dirs, tokens, eval loss (of BEST's
    or FINAL's `record`), tokenizer, format. Written beside `out`, then swapped in: a failed
    export leaves `out` as it was, and a replaced one keeps none of its files."""
    provenance = {
        "experiment": what["experiment"],
        "store": store_url,
        "snapshot": what["snapshot"],
        "versions": list(snapshot.versions) if snapshot else None,
        "dirs": list(snapshot.dirs) if snapshot else None,
        "tokens_merged": snapshot.tokens_merged if snapshot else None,
        "eval_loss": record.get("loss") if record else None,
        "tokenizer": tok.identity(),
        "format": fmt,
    }
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if fmt == "hf":  # transformers' layout only (training/model/export_hf.py)
            from training.model.export_hf import write_hf

            write_hf(tmp, cfg, params, tok, what)
        else:
            write_export(tmp, cfg, params, tok, what)
        if fmt == "orbax":  # a flat {flax path: array} tree that orbax restores as such
            import orbax.checkpoint as ocp

            with ocp.StandardCheckpointer() as ckpt:
                ckpt.save((tmp / "orbax").absolute(), params)
        (tmp / "export.json").write_text(json.dumps(provenance, indent=1) + "\n")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _regular(path: Path) -> int:
    """The size of `path`, a regular file (ConfigError otherwise: a FIFO or a device would
    block or never end a read)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file")
    return st.st_size


def _read_config(root: Path) -> dict[str, Any]:
    path = root / CONFIG
    if path.exists() or path.is_symlink():
        _regular(path)
    try:
        with open(path, "rb") as f:
            data = f.read(safejson.CONFIG.max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{root}: not an export directory ({CONFIG}: {exc.strerror})") from None
    try:
        config = safejson.load_json(data, safejson.CONFIG)  # bounded, strict, an object
    except safejson.BadJSON as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(config.get("model"), dict):
        raise ConfigError(f"{path}: no model section")
    return config


def _tokenizer(root: Path, identity: Any) -> Tokenizer:
    if not isinstance(identity, dict):
        raise ConfigError(f"{root / CONFIG}: no tokenizer section")
    if identity.get("kind") == "byte":
        return ByteTokenizer()
    name = identity.get("file")
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise ConfigError(f"{root / CONFIG}: the tokenizer file is not named")
    _regular(root / name)
    try:
        tok = load_tokenizer(str(root / name))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if tok.sha256 != identity.get("sha256"):
        raise ConfigError(f"{root / name}: sha256 differs from the one {CONFIG} records")
    return tok


def check_model(mcfg: ModelConfig, shapes: dict[str, Any], where: str) -> None:
    """ConfigError (one line, naming `where`) unless the sizes of the model section `mcfg` are
    bounded (`ModelConfig.bounded_dims`, checked before anything is built from it) and
    `shapes` ({name: (shape, dtype)}) are exactly its parameters: the same names, each float32
    of the shape the section describes. What an export's config.json claims, held to the
    tensors it ships with (`load_export`, `diloco export`, `diloco sample`)."""
    from training.model import definition as model

    try:
        mcfg.bounded_dims()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    want = model.abstract_params(mcfg)
    if sorted(shapes) != sorted(want):
        missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
        raise ConfigError(f"{where}: tensors missing {missing[:3]}, unexpected {extra[:3]}")
    for name, spec in want.items():
        shape, dtype = shapes[name]
        if tuple(shape) != tuple(spec.shape) or np.dtype(dtype) != np.float32:
            raise ConfigError(f"{where}: {name} is {np.dtype(dtype)}{list(shape)}")


def _weights_header(path: Path, size: int) -> dict[str, Any]:
    """{name: (shape, dtype)} of the safetensors file `path` of `size` bytes, from its header
    alone (read bounded: MAX_HEADER_BYTES), once its tensors' data regions cover the file
    exactly (`tensor_layouts`): an extra tensor is refused here, before any tensor is read."""
    from training.store.tensors import BadTensors, tensor_layouts

    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= length <= MAX_HEADER_BYTES or 8 + length > size:
            raise ConfigError(f"{path}: not a safetensors file of a model this size")
        data = head + f.read(length)
    try:
        layouts = tensor_layouts(data, size)[0]
    except BadTensors as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return {name: (shape, dtype) for name, (dtype, shape, _, _) in layouts.items()}


def load_export(root: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """(model section, parameters, tokenizer) of an export directory; ConfigError (one line)
    for anything that does not fit the model its config.json describes. Nothing is built or
    read whole before the section's sizes are bounded and held to the weights' file size and
    safetensors header (`check_model`)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    root = Path(root)
    config = _read_config(root)
    try:
        mcfg = ModelConfig.model_validate(config["model"])
    except ValueError as exc:
        first = str(exc).strip().splitlines()
        raise ConfigError(f"{root / CONFIG}: bad model section: {first[-1][:200]}") from None
    # the sizes the config claims, against the weights' file before anything is built or read:
    # float32 parameters plus a safetensors header of at most MAX_HEADER_BYTES
    try:
        count = mcfg.param_count()
    except ConfigError as exc:
        raise ConfigError(f"{root / CONFIG}: {exc}") from None
    size = _regular(root / WEIGHTS)
    with open(root / WEIGHTS, "rb") as f:
        head = f.read(8)
    header = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 <= header <= MAX_HEADER_BYTES:
        raise ConfigError(f"{root / WEIGHTS}: not a safetensors file of a model this size")
    exact = mcfg.factory is None  # a factory model's count is its own (abstract_params)
    if exact and size != 8 + header + 4 * count:
        raise ConfigError(
            f"{root / WEIGHTS}: {size - 8 - header:,} bytes of tensors, but {CONFIG} describes "
            f"{count:,} float32 parameters ({4 * count:,} bytes)"
        )
    # every model (a factory's too): bounded sizes, then the header's tensors against them
    try:
        mcfg.bounded_dims()
    except ConfigError as exc:
        raise ConfigError(f"{root / CONFIG}: {exc}") from None
    shapes = _weights_header(root / WEIGHTS, size)
    check_model(mcfg, shapes, str(root / WEIGHTS))
    tok = _tokenizer(root, config.get("tokenizer"))
    if tok.vocab_size > mcfg.dims()["vocab_size"]:
        raise ConfigError(f"{root}: tokenizer vocabulary {tok.vocab_size} > the model's")
    try:
        params = load_file(root / WEIGHTS)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{root / WEIGHTS}: {str(exc).splitlines()[0][:200]}") from None
    # the file read is the one checked (not one swapped in since): names, shapes, dtypes again
    if {n: (v.shape, v.dtype) for n, v in params.items()} != shapes:
        raise ConfigError(f"{root / WEIGHTS}: changed while it was read")
    for name, got in params.items():
        if not np.isfinite(got).all():
            raise ConfigError(f"{root / WEIGHTS}: {name} has non-finite values")
    return mcfg, params, tok
