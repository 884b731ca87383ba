"""Tensors as bytes: safetensors (never pickle) and flat '/'-joined names."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import google_crc32c
import ml_dtypes
import numpy as np
import safetensors

from training.store import crc
from training.store.objectstore import CorruptObject
from training.store.safejson import JSONLimits, load_json, show

__all__ = [
    "BadTensors",
    "CHECKSUMS",
    "Checksum",
    "CorruptObject",
    "checksum",
    "decode_tensors",
    "encode_tensors",
    "flatten",
    "read_tensor",
    "sha256",
    "stream_tensors",
    "tensor_parts",
    "unflatten",
]

# numpy dtype <-> safetensors dtype code. The brief's set plus int16/int64/uint64/float64/bool.
_CODES: dict[np.dtype, str] = {
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.bool_): "BOOL",
}
_DTYPES: dict[str, np.dtype] = {code: dtype for dtype, code in _CODES.items()}
MAX_HEADER_BYTES = 8 * 2**20
"""Default cap of a safetensors JSON header (a 12B model's checkpoint header is ~1 MiB)."""
MAX_HEADER_DEPTH = 4  # {name: {"shape": [...]}}: 3 levels
MAX_NDIM = 16
MAX_DIM = 2**48


class BadTensors(CorruptObject):
    """Bytes that are not strict safetensors (a one-line reason)."""


def sha256(data: bytes) -> str:
    """Hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


CHECKSUMS = ("crc32c", "sha256")
"""Payload checksums a manifest may carry (docs/STORE.md "Integrity"): crc32c (what the store
writes: hardware CRC, ~10x faster than sha256, twice that again on large parts in C,
training/store/crc.py; detects corruption, truncation and any burst error, not a forgery by
someone who may write the object) and sha256 (older stores)."""


def _readonly_bytes(part: Any) -> np.ndarray:
    """A read-only uint8 view of a bytes-like object or C-contiguous array (no copy)."""
    view = np.frombuffer(part, np.uint8) if not isinstance(part, np.ndarray) else part
    view = view.reshape(-1).view(np.uint8)
    view = view.view()
    view.flags.writeable = False
    return view


class Checksum:
    """A checksum fed part by part (`update`), in order: `hexdigest` is `checksum` of the
    parts given so far. A payload read hands it the buffer's pieces as they arrive
    (`ObjectStore.read_buffer`'s `consume`)."""

    def __init__(self, algorithm: str = "crc32c"):
        if algorithm not in CHECKSUMS:
            raise ValueError(f"unknown checksum {algorithm!r}; expected one of {CHECKSUMS}")
        self.algorithm = algorithm
        self._sha = hashlib.sha256() if algorithm == "sha256" else None
        self._crc = 0

    def update(self, part: Any) -> None:
        """Add the bytes of `part` (bytes-like or a C-contiguous array), without a copy."""
        view = _readonly_bytes(part)
        if self._sha is not None:
            self._sha.update(view)
            return
        # the C crc (training/store/crc.py) on large parts, the same value as google_crc32c
        fast = crc.crc32c(self._crc, view) if view.size >= crc.MIN_BYTES else None
        self._crc = fast if fast is not None else google_crc32c.extend(self._crc, view)

    def hexdigest(self) -> str:
        """crc32c as 8 hex digits, sha256 as 64."""
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def checksum(parts: Iterable[Any], algorithm: str = "crc32c") -> str:
    """Hex checksum of the concatenation of `parts` (bytes-like objects or C-contiguous
    arrays), without joining them: crc32c as 8 hex digits, sha256 as 64."""
    digest = Checksum(algorithm)
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Names


FINITE_STEP = 1 << 20  # elements per `all_finite` chunk: a 1 MiB mask, reused


def all_finite(array: np.ndarray) -> bool:
    """Whether every element of a float array is finite, chunk by chunk into one reused 1 MiB
    mask (np.isfinite(array).all() would make a mask of the array's size: 0.5 GiB for a
    2 GiB tensor, fresh memory on every check)."""
    flat = array.reshape(-1)
    if flat.size <= FINITE_STEP:
        return bool(np.isfinite(flat).all())
    mask = np.empty(FINITE_STEP, np.bool_)
    for s in range(0, flat.size, FINITE_STEP):
        part = flat[s : s + FINITE_STEP]
        if not np.isfinite(part, out=mask[: part.size]).all():
            return False
    return True


def flatten(tree: Mapping[Any, Any]) -> dict[str, np.ndarray]:
    """Nested mappings -> {"a/b/0/c": array}. Keys may be str or int (ints become strings).

    Leaves are anything `np.asarray` accepts (numpy and jax arrays, scalars); empty sub-mappings
    vanish. A key that is empty or contains '/' raises ValueError; so do two keys that become
    the same name (1 and "1"). Convert NNX state with `nnx.to_pure_dict` first.
    """
    flat: dict[str, np.ndarray] = {}

    def visit(node: Mapping[Any, Any], path: str) -> None:
        for key, value in node.items():
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise TypeError(f"key {key!r} under {path or '<root>'!r}: must be str or int")
            part = str(key)
            if not part or "/" in part:
                raise ValueError(f"key {part!r} under {path or '<root>'!r}: empty or contains '/'")
            name = f"{path}/{part}" if path else part
            if isinstance(value, Mapping):
                visit(value, name)
            elif name in flat:
                raise ValueError(f"two keys flatten to the same name {name!r}")
            else:
                flat[name] = np.asarray(value)

    visit(tree, "")
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b/0/c": x} -> {"a": {"b": {"0": {"c": x}}}}: the inverse of `flatten` on names.

    All keys come back as strings: "0" stays "0" (a flat name does not record that it was an
    int). A name that is both a leaf and a prefix of another ("a" and "a/b") raises ValueError.
    """
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split("/")
        if not all(parts):
            raise ValueError(f"invalid tensor name {name!r}: empty segment")
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{name!r} nests under the tensor {part!r}")
            node = child
        if parts[-1] in node:
            raise ValueError(f"{name!r} is both a tensor and a prefix of other tensors")
        node[parts[-1]] = value
    return tree


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_tensors(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> bytes:
    """safetensors bytes for `tensors` (C-contiguous little-endian copies where needed).

    Supported dtypes: float32, bfloat16 (ml_dtypes), float16, float64, int8/16/32/64,
    uint8/16/32/64, bool. Others raise TypeError. `metadata` must map str to str.
    """
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("metadata must map str to str")
    specs: dict[str, safetensors.TensorSpec] = {}
    keep_alive: list[np.ndarray] = []  # serialize reads raw pointers into these arrays
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in _CODES:
            raise TypeError(f"tensor {name!r}: unsupported dtype {array.dtype}")
        if not array.flags.c_contiguous:
            array = array.copy(order="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
        keep_alive.append(array)
        specs[name] = safetensors.TensorSpec(
            dtype=array.dtype.name,
            shape=list(array.shape),
            data_ptr=array.ctypes.data,
            data_len=array.nbytes,
        )
    return bytes(safetensors.serialize(specs, metadata=dict(metadata) if metadata else None))


def tensor_parts(tensors: Mapping[str, np.ndarray]) -> list[Any]:
    """The safetensors file of `tensors` as parts: the 8-byte length and JSON header (padded
    with spaces to 8 bytes, as safetensors does), then each array's own bytes (no copy of a
    C-contiguous little-endian array). b"".join(parts) is a file `decode_tensors` and the
    safetensors library read; the tensors are laid out by decreasing item size, then name (as
    safetensors does), so every tensor's data is aligned to its item size."""
    header: dict[str, Any] = {}
    arrays = []
    offset = 0
    for name in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
    order = sorted(tensors, key=lambda n: (-np.asarray(tensors[n]).dtype.itemsize, n))
    for name in order:
        array = np.asarray(tensors[name])
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in _CODES:
            raise TypeError(f"tensor {name!r}: unsupported dtype {array.dtype}")
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        header[name] = {
            "dtype": _CODES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array.reshape(-1).view(np.uint8))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *arrays]


def stream_tensors(tensors: Mapping[str, Any]) -> Iterator[memoryview | bytes]:
    """The safetensors bytes of `tensors`, as chunks: the header, then one tensor at a time.

    Values are anything with `shape`, `dtype` and `__array__` (numpy arrays, jax arrays: the
    header is built from shapes and dtypes alone, and each tensor is converted with
    `np.asarray` only when its turn comes, so a device array crosses to the host one tensor at
    a time and the host never holds more than one). The bytes decode with `decode_tensors`
    (and the safetensors library): a JSON header padded with spaces to 8 bytes, tensors in
    the order given, no gaps. Dtypes as in `encode_tensors`.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        dtype = np.dtype(value.dtype)
        if dtype.newbyteorder("<") not in _CODES:
            raise TypeError(f"tensor {name!r}: unsupported dtype {dtype}")
        shape = [int(d) for d in value.shape]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _CODES[dtype.newbyteorder("<")],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text)) + text
    for name, value in tensors.items():
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if (list(array.shape), _CODES.get(array.dtype)) != (
            header[name]["shape"],
            header[name]["dtype"],
        ):
            raise ValueError(f"tensor {name!r} changed shape or dtype while streaming")
        if array.nbytes:
            yield memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _parse_header(data: bytes, max_header: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header and the offset where tensor data starts; BadTensors if the
    length prefix, the size cap `max_header`, the nesting depth or the JSON is wrong."""
    if len(data) < 8:
        raise BadTensors(f"not safetensors: {len(data)} bytes, shorter than the 8-byte header")
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    if length > max_header:
        raise BadTensors(f"not safetensors: header of {length} bytes is over {max_header}")
    if length > len(data) - 8:
        raise BadTensors(
            f"not safetensors (or truncated): header length {length} for {len(data)} bytes"
        )
    limits = JSONLimits(max_header, MAX_HEADER_DEPTH)
    try:
        header = load_json(bytes(data[8 : 8 + length]), limits, BadTensors)
    except BadTensors as exc:
        raise BadTensors(f"not safetensors: invalid JSON header ({exc})") from None
    return header, 8 + length


def _tensor_layout(name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry; BadTensors if inconsistent."""
    if not isinstance(info, dict):
        raise BadTensors(f"tensor {show(name)}: header entry is not an object")
    code = info.get("dtype")
    dtype = _DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise BadTensors(f"tensor {show(name)}: unsupported dtype {show(code)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(_is_count(d) and d <= MAX_DIM for d in shape)
    ):
        raise BadTensors(f"tensor {show(name)}: invalid shape {show(shape)}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise BadTensors(f"tensor {show(name)}: invalid data_offsets {show(offsets)}")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise BadTensors(f"tensor {show(name)}: size does not match shape {shape} {dtype}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def header_bound(entries: list[tuple[str, int]]) -> int:
    """An upper bound on the JSON header bytes (length prefix and padding included) of a
    safetensors file holding tensors `(name, ndim)`, with no metadata. Each entry is at most
    `"name":{"dtype":"BF16","shape":[d,...],"data_offsets":[b,e]},` with names escaped at
    worst 6 bytes a character, dims of at most 20 digits and offsets of at most 20."""
    per_entry = len('"":{"dtype":"BOOL","shape":[],"data_offsets":[,]},') + 2 * 20
    total = 2 + sum(6 * len(name) + per_entry + 21 * ndim for name, ndim in entries)
    return 8 + total + 8


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _metadata(header: dict[str, Any]) -> dict[str, str]:
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BadTensors("safetensors __metadata__ is not a str -> str map")
    return metadata


def _slice(
    data: bytes, start: int, dtype: np.dtype, shape: tuple[int, ...], begin: int, copy: bool = True
):
    """One tensor's bytes as an array: a writable copy, or (copy=False) a view into `data`."""
    count = math.prod(shape)
    array = np.frombuffer(data, dtype=dtype, count=count, offset=start + begin).reshape(shape)
    return array.copy() if copy else array


def tensor_layouts(
    data: bytes | bytearray | memoryview, size: int, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]], dict[str, str], int]:
    """({name: (dtype, shape, begin, end)}, metadata, data start) of a safetensors object of
    `size` bytes from `data`, its first bytes (the length prefix and header suffice: a reader
    checks a file's tensors before reading them); BadTensors unless the header is valid
    (`decode_tensors`' rules) and its data regions cover the `size` bytes exactly."""
    header, start = _parse_header(data, max_header_bytes)
    metadata = _metadata(header)
    layouts = {
        name: _tensor_layout(name, info) for name, info in header.items() if name != "__metadata__"
    }
    position = 0
    for name, (_, _, begin, end) in sorted(layouts.items(), key=lambda item: item[1][2:]):
        if begin != position:
            raise BadTensors(f"tensor {show(name)}: data regions overlap or leave a gap")
        position = end
    if start + position != size:
        raise BadTensors(
            f"data is {size - start} bytes but the header describes {position} (truncated?)"
        )
    return layouts, metadata, start


def decode_tensors(
    data: bytes | bytearray | memoryview,
    copy: bool = True,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) from safetensors bytes; arrays are writable copies, or with
    copy=False views into `data` (zero-copy: writable only if `data` is a bytearray).

    A strict reader of the safetensors format (a JSON header of at most `max_header_bytes`
    and depth MAX_HEADER_DEPTH, read by the store's bounded JSON reader; known dtypes; at most
    MAX_NDIM dimensions; sizes that match shapes; data regions that cover the data exactly with
    no gap or overlap). Any other input (truncated, a pickle, deep nesting, huge numbers)
    raises BadTensors, a CorruptObject with a one-line reason; nothing is ever unpickled. Each
    tensor is copied once out of `data` (or viewed, copy=False).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    layouts, metadata, start = tensor_layouts(data, len(data), max_header_bytes)
    tensors = {
        name: _slice(data, start, dtype, shape, begin, copy)
        for name, (dtype, shape, begin, _) in layouts.items()
    }
    return tensors, metadata


def read_tensor(data: bytes, name: str, max_header_bytes: int = MAX_HEADER_BYTES) -> np.ndarray:
    """One tensor from safetensors bytes, without decoding the others (reads the header and
    slices the data). KeyError if absent; BadTensors if the header is invalid."""
    header, start = _parse_header(data, max_header_bytes)
    if name == "__metadata__" or name not in header:
        raise KeyError(f"no tensor named {name!r}")
    dtype, shape, begin, end = _tensor_layout(name, header[name])
    if start + end > len(data):
        raise BadTensors(f"tensor {show(name)}: data runs past the end (truncated?)")
    return _slice(data, start, dtype, shape, begin)
