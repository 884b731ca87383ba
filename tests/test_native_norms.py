"""The squared norm of a quantized tensor from its codes (native.c `codes_sumsq`, through
training/codecs/kernels.py) gives the numpy path's bits and chunk count for int8, int4 and int2:
sizes of one element to three chunks and 77, blocks of every alignment (not on a byte, on 32 or
64 bytes, partial last blocks, int4's pad nibble), random and invalid codes, an invalid code in
the first, a middle or the last chunk (checked or not), and scales that are 0, subnormal, large
enough to overflow scale x levels, infinite or NaN."""

import numpy as np
import pytest

from training.codecs import kernels, native

PER = {"int8": 1, "int4": 2, "int2": 4}
KINDS = ["int8", "int4", "int2"]
BIG = 3 * kernels.CHUNK + 77  # three chunks and 77 elements

needs_native = pytest.mark.skipif(
    native.library() is None,
    reason="the C loops are not loaded (no C compiler, or DILOCO_NATIVE=0)",
)
pytestmark = needs_native


def _codes(kind: str, n: int, seed: int, valid: bool = True) -> np.ndarray:
    """n random codes' bytes; `valid`: no int8 -128 and no int4 nibble 0 (the pad nibble too)."""
    raw = np.random.default_rng(seed).integers(0, 256, -(-n // PER[kind]), dtype=np.uint8)
    if valid and kind == "int8":
        raw[raw == 0x80] = 0x81
    if valid and kind == "int4":
        raw[(raw & 0x0F) == 0] |= 0x01
        raw[(raw >> 4) == 0] |= 0x10
    return raw


def _scales(n: int, block: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1e-3, -(-n // block)).astype(np.float32)


def _both(numpy_only, kind, raw, scales, n, block=256, check=True):
    """((chunks done, their sums' bytes) in C, the same in numpy)."""
    args = (kind, raw, scales, n, block, kernels.chunk_step(block), check)
    out = []
    for sums, done in (kernels.codes_sumsq(*args), numpy_only(kernels.codes_sumsq, *args)):
        out.append((done, sums[:done].tobytes()))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 255, 256, 257, BIG])
def test_random_codes_give_numpys_bits(kind, n, numpy_only):
    c, want = _both(numpy_only, kind, _codes(kind, n, n), _scales(n, 256, n), n)
    assert c == want


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 257, BIG])
def test_invalid_codes_unchecked_count_as_numpy_counts_them(kind, n, numpy_only):
    # int8 -128 (16384) and int4 nibble 0 (64) among the codes, summed when not checked
    raw = _codes(kind, n, 3, valid=False)
    c, want = _both(numpy_only, kind, raw, _scales(n, 256, 3), n, check=False)
    assert c == want


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [1, 2, 3, 5, 32, 64, 96, 128, 192, 512, 4096, 4100])
def test_every_block_size_gives_numpys_bits(kind, block, numpy_only):
    # blocks not starting on a byte (int4 3, int2 2), of 32 or 64 bytes or neither, partial
    n = BIG
    c, want = _both(numpy_only, kind, _codes(kind, n, block), _scales(n, block, block), n, block)
    assert c == want


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_an_invalid_code_stops_at_its_chunk_as_in_numpy(kind, chunk, numpy_only):
    # the first, a middle, the last (77 elements) of 4 chunks: the chunks before it done
    n, step = BIG, kernels.chunk_step(256)
    raw = _codes(kind, n, chunk)
    at = min(n - 1, chunk * step + 12345) // PER[kind]
    raw[at] = 0x80 if kind == "int8" else (raw[at] & 0xF0)  # -128; nibble 0, a code of -8
    c, want = _both(numpy_only, kind, raw, _scales(n, 256, chunk), n)
    assert c == want and c[0] == chunk


@pytest.mark.parametrize("n", [1, 257, BIG])
def test_the_pad_nibble_of_an_odd_count_is_not_judged(n, numpy_only):
    raw = _codes("int4", n, 4)
    raw[-1] &= 0x0F  # the pad nibble 0
    c, want = _both(numpy_only, "int4", raw, _scales(n, 256, 4), n)
    assert c == want and c[0] == -(-n // kernels.chunk_step(256))


SPECIAL = {
    "zero": [0.0, -0.0],
    "subnormal": [1e-40, -1e-45, 1.1754942e-38],
    "huge": [1e38, -2.5e38, 3.4028235e38],  # scale x levels overflows float32 (1e38: int8, int4)
    "inf": [np.inf, -np.inf],
    "nan": [np.nan],  # one sign a tensor: numpy's adds may keep another of two NaNs
    "-nan": [-np.nan],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("special", list(SPECIAL))
def test_special_scales_give_numpys_bits(kind, special, numpy_only):
    # in the first block, the middle and the partial last one; several in one chunk
    n = BIG
    scales = _scales(n, 256, 5)
    values = np.array(SPECIAL[special], np.float32)
    rng = np.random.default_rng(6)
    at = np.concatenate([[0, scales.size - 1], rng.integers(0, scales.size, 40)])
    scales[at] = values[np.arange(at.size) % values.size]
    c, want = _both(numpy_only, kind, _codes(kind, n, 5), scales, n)
    assert c == want
