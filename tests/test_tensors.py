"""safetensors encoding, flat names, and refusal of anything that is not safetensors."""

from __future__ import annotations

import hashlib
import pickle

import ml_dtypes
import numpy as np
import pytest

from training.store import tensors
from training.store.tensors import (
    CorruptObject,
    checksum,
    decode_tensors,
    encode_tensors,
    flatten,
    read_tensor,
    sha256,
    tensor_parts,
    unflatten,
)

DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    np.int8,
    np.uint8,
    np.int32,
    np.uint32,
    np.uint16,
    np.int64,
    np.float64,
    np.bool_,
]

UNPICKLED: list[str] = []


def _record_unpickling(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class _Trap:
    """Unpickling this object calls _record_unpickling: proof that pickle ran."""

    def __reduce__(self):
        return _record_unpickling, ("unpickled",)


def _sample(dtype) -> np.ndarray:
    return (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_keeps_dtype_shape_and_values(dtype):
    original = _sample(dtype)
    decoded, _ = decode_tensors(encode_tensors({"w": original}))
    assert decoded["w"].dtype == original.dtype and np.array_equal(decoded["w"], original)


def test_bfloat16_round_trip_is_bit_exact():
    original = np.array([1.0, -2.5, 3.140625, 1e-3, np.inf], dtype=ml_dtypes.bfloat16)
    decoded, _ = decode_tensors(encode_tensors({"b": original}))
    assert decoded["b"].view(np.uint16).tolist() == original.view(np.uint16).tolist()


def test_metadata_round_trips():
    _, metadata = decode_tensors(encode_tensors({"x": np.zeros(1)}, {"codec": "int8"}))
    assert metadata == {"codec": "int8"}


def test_non_contiguous_input_is_encoded_as_its_values():
    transposed = np.arange(12, dtype=np.float32).reshape(3, 4).T
    decoded, _ = decode_tensors(encode_tensors({"t": transposed}))
    assert np.array_equal(decoded["t"], transposed)


def test_scalar_and_empty_tensors_round_trip():
    decoded, _ = decode_tensors(
        encode_tensors({"s": np.float32(2.5), "e": np.zeros((0, 3), np.int32)})
    )
    assert decoded["s"].shape == () and decoded["s"] == 2.5 and decoded["e"].shape == (0, 3)


def test_decoded_arrays_are_writable():
    decoded, _ = decode_tensors(encode_tensors({"w": np.zeros(3, np.float32)}))
    decoded["w"] += 1
    assert decoded["w"].tolist() == [1.0, 1.0, 1.0]


def test_unsupported_dtype_is_refused():
    with pytest.raises(TypeError):
        encode_tensors({"c": np.zeros(2, np.complex64)})


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1])
def test_truncated_bytes_raise_corrupt_object(cut):
    data = encode_tensors({"w": np.arange(10, dtype=np.float32)})
    with pytest.raises(CorruptObject):
        decode_tensors(data[:cut])


def test_garbage_bytes_raise_corrupt_object():
    with pytest.raises(CorruptObject):
        decode_tensors(b"this is not a tensor file at all")


def test_pickle_payload_raises_corrupt_object_without_unpickling():
    payload = pickle.dumps({"w": _Trap()})
    assert pickle.loads(payload)  # the trap works: loading it runs our function
    UNPICKLED.clear()
    with pytest.raises(CorruptObject):
        decode_tensors(payload)
    assert UNPICKLED == []


def test_read_tensor_returns_one_tensor():
    data = encode_tensors({"a": np.arange(3, dtype=np.int32), "b": np.ones((2, 2), np.float16)})
    assert np.array_equal(read_tensor(data, "b"), np.ones((2, 2), np.float16))


def test_read_tensor_of_unknown_name_raises_key_error():
    with pytest.raises(KeyError):
        read_tensor(encode_tensors({"a": np.zeros(1)}), "b")


def test_flatten_joins_nested_keys_with_slashes_and_stringifies_ints():
    flat = flatten({"blocks": {0: {"attn": {"kernel": np.ones(2)}}}, "embed": np.zeros(1)})
    assert sorted(flat) == ["blocks/0/attn/kernel", "embed"]


def test_unflatten_keeps_digit_keys_as_strings():
    tree = unflatten({"blocks/0/kernel": np.ones(1)})
    assert list(tree["blocks"]) == ["0"]


def test_flatten_rejects_keys_containing_a_slash():
    with pytest.raises(ValueError):
        flatten({"a/b": np.ones(1)})


def test_sha256_is_the_hex_digest():
    assert sha256(b"abc") == hashlib.sha256(b"abc").hexdigest()


def test_tensor_parts_join_to_a_file_both_readers_accept():
    import safetensors

    tensors = {
        "b": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a": np.array(1.5, ml_dtypes.bfloat16),
        "c": np.zeros((3, 1), np.int8),
        "t": np.arange(6, dtype=np.int32).reshape(2, 3).T,  # not C-contiguous
    }
    data = b"".join(memoryview(p).cast("B") for p in tensor_parts(tensors))
    decoded, _ = decode_tensors(data)
    assert all(v.ctypes.data % v.dtype.itemsize == 0 for v in decoded.values())  # aligned
    loaded = dict(safetensors.deserialize(data))  # name -> {dtype, shape, data}
    for name, value in tensors.items():
        assert np.array_equal(decoded[name], value) and decoded[name].dtype == value.dtype
        raw = np.frombuffer(bytes(loaded[name]["data"]), value.dtype)
        assert np.array_equal(raw.reshape(loaded[name]["shape"]), value)


@pytest.mark.parametrize("algorithm", ["crc32c", "sha256"])
def test_checksum_of_parts_is_the_checksum_of_their_concatenation(algorithm):
    parts = tensor_parts({"w": np.arange(1000, dtype=np.float32), "s": np.ones(3, np.int8)})
    joined = b"".join(memoryview(p).cast("B") for p in parts)
    assert checksum(parts, algorithm) == checksum([joined], algorithm)
    assert checksum([bytearray(joined)], algorithm) == checksum([joined], algorithm)
    assert checksum([b"123456789"], "crc32c") == "e3069283"  # the CRC-32C check value
    assert checksum([joined], "sha256") == sha256(joined)


@pytest.mark.parametrize("at", [None, 0, tensors.FINITE_STEP - 1, tensors.FINITE_STEP, -1])
def test_all_finite_finds_a_nan_in_any_chunk(at):
    # three chunks and 5 elements: a NaN in the first or last element of a chunk, or none
    x = np.ones(3 * tensors.FINITE_STEP + 5, np.float32)
    if at is not None:
        x[at] = np.nan
    assert tensors.all_finite(x) is (at is None)
