"""The store's C CRC-32C (training/store/crc.c, loaded by training/store/crc.py) gives
google_crc32c's value on every length, alignment, start value and buffer kind, and `Checksum`
(training/store/tensors.py) gives the same digest with or without it."""

import os
import shutil

import google_crc32c
import numpy as np
import pytest

from training.store import clib, crc, tensors

needs_crc = pytest.mark.skipif(
    crc.crc32c(0, b"") is None,
    reason="the C crc32c is not loaded (no C compiler, DILOCO_NATIVE=0, or built without SSE4.2)",
)
# where training/store/crc.c changes course: three chains over 3 x 8192 and 3 x 256 bytes, one
# chain for the rest (under 768 bytes)
CRC_LENGTHS = [
    *range(301),
    767,
    768,
    769,
    3 * 8192 - 1,
    3 * 8192,
    3 * 8192 + 1,
    3 * 8192 + 767,
    3 * 8192 + 768,
    2 * 3 * 8192 + 3 * 256 + 7,
    (3 << 20) + 13,
]


def _random_bytes(n: int, seed: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _google(crc_in: int, data: np.ndarray) -> int:
    return google_crc32c.extend(crc_in, data.tobytes())


@needs_crc
def test_c_crc32c_is_google_crc32c_on_every_length():
    data = _random_bytes(CRC_LENGTHS[-1])
    got = [crc.crc32c(0x1234ABCD, data[:n]) for n in CRC_LENGTHS]
    assert got == [_google(0x1234ABCD, data[:n]) for n in CRC_LENGTHS]


@needs_crc
def test_c_crc32c_is_google_crc32c_from_every_misaligned_address():
    data = _random_bytes(2 * 3 * 8192 + 1000)
    spans = [(k, n) for k in range(1, 8) for n in (5, 100, 3 * 256 + 3, 3 * 8192 + 9, 50_000)]
    got = [crc.crc32c(0, data[k : k + n]) for k, n in spans]
    assert got == [_google(0, data[k : k + n]) for k, n in spans]


@needs_crc
def test_c_crc32c_of_parts_chained_is_the_crc_of_the_whole():
    data = _random_bytes(1 << 20)
    cuts = [0, 3, 1000, 30_001, 500_001, data.size]
    chained = 0
    for s, e in zip(cuts, cuts[1:], strict=False):
        chained = crc.crc32c(chained, data[s:e])
    assert chained == _google(0, data)


@needs_crc
def test_c_crc32c_reads_read_only_buffers_and_arrays_of_any_dtype():
    data = _random_bytes(100_000)
    frozen = data.copy()
    frozen.flags.writeable = False
    parts = [data.tobytes(), bytearray(data.tobytes()), memoryview(data.tobytes()), frozen]
    parts += [data.view(np.float32).reshape(250, 100), np.frombuffer(data.tobytes(), np.int64)]
    assert [crc.crc32c(7, p) for p in parts] == [_google(7, data)] * len(parts)


def test_c_crc32c_refuses_a_strided_array():
    with pytest.raises(ValueError, match="contiguous"):
        crc.crc32c(0, _random_bytes(100)[::2])


@pytest.mark.skipif(crc.library() is None, reason="the C crc32c is not loaded")
def test_the_plain_c_crc32c_loop_is_google_crc32c():
    data = _random_bytes(3 * 8192 + 1000)
    spans = [(k, n) for k in (0, 1, 3) for n in (*range(40), 767, 768, 769, 3 * 8192 + 5)]
    got = [crc.crc32c_portable(0xFFFFFFFF, data[k : k + n]) for k, n in spans]
    assert got == [_google(0xFFFFFFFF, data[k : k + n]) for k, n in spans]


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")
def test_the_c_crc32c_built_without_march_native_is_google_crc32c(tmp_path):
    # the build a compiler that does not know -march=native makes (clib.FLAGS alone): on
    # x86-64 without SSE4.2, so crc32c_extend runs the plain C loop
    path = tmp_path / "crc.so"
    cc = os.environ.get("CC") or "cc"
    if not clib.compile_to(cc, clib.FLAGS, crc.SOURCE, path):
        pytest.fail("training/store/crc.c does not build with clib.FLAGS alone")
    lib = crc._load(path)
    data = _random_bytes(3 * 8192 + 1000)
    lengths = [0, 1, 7, 8, 9, 300, 769, 3 * 8192 + 999]
    got = [lib.crc32c_extend(3, data.ctypes.data + 1, n) for n in lengths]
    assert got == [_google(3, data[1 : 1 + n]) for n in lengths]


def test_with_diloco_native_0_no_c_crc32c_is_loaded(monkeypatch):
    monkeypatch.setenv(clib.NATIVE_ENV, "0")
    assert clib.Library(crc.SOURCE, crc._load)() is None


def test_checksum_without_the_c_crc32c_is_the_same_digest(monkeypatch):
    parts = [_random_bytes(300_000), b"x" * 10, _random_bytes(crc.MIN_BYTES, 3)]
    with_c = tensors.checksum(parts)
    monkeypatch.setattr(crc, "library", lambda: None)
    whole = b"".join(bytes(p) for p in parts)
    assert (with_c, tensors.checksum(parts)) == (f"{google_crc32c.extend(0, whole):08x}",) * 2


def test_checksum_hands_the_c_crc32c_only_parts_of_min_bytes_or_more(monkeypatch):
    sizes = []
    real = crc.crc32c

    def counted(crc_in, data):
        sizes.append(len(data))
        return real(crc_in, data)

    monkeypatch.setattr(crc, "crc32c", counted)
    tensors.checksum([_random_bytes(crc.MIN_BYTES - 1), _random_bytes(crc.MIN_BYTES)])
    assert sizes == [crc.MIN_BYTES]
