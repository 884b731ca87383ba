"""file:// payloads of DIRECT_MIN_BYTES and more are written with O_DIRECT through page-aligned
stretches (training/store/direct_io.py): the object holds exactly the parts'
bytes whatever their sizes and the stretches' boundaries, and a file system that refuses direct
I/O gets the same object written buffered."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from training.store import direct_io
from training.store.local import LocalStore

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


@pytest.fixture
def small_stretches(monkeypatch):
    """Direct from 1 MiB in stretches of 64 KiB, and whether each write went direct."""
    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(direct_io, "DIRECT_STRETCH", 64 << 10)
    went: list[bool] = []
    direct = LocalStore._write_temp_direct

    def spy(path, parts):
        got = direct(path, parts)
        went.append(got is not None)
        return got

    monkeypatch.setattr(LocalStore, "_write_temp_direct", staticmethod(spy))
    return went


def _parts() -> list:
    # 1 MiB + 77 bytes in parts of odd sizes: stretches of 64 KiB end mid-part, the last one
    # is padded to 4 KiB and cut back
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, (1 << 20) - 3, dtype=np.uint8)
    return [b"\x07" * 13, memoryview(big), rng.integers(0, 256, 67, dtype=np.uint8)]


def test_a_direct_write_holds_exactly_the_parts(tmp_path, small_stretches):
    store = LocalStore(tmp_path)
    store.write_parts("a/big.bin", _parts())
    assert small_stretches == [True]
    assert bytes(store.read_buffer("a/big.bin")) == b"".join(bytes(p) for p in _parts())


def test_a_payload_under_the_threshold_is_written_buffered(tmp_path, small_stretches):
    LocalStore(tmp_path).write_parts("a/small.bin", [b"x" * 1000])
    assert small_stretches == []


def test_a_file_system_refusing_direct_io_gets_the_same_object_buffered(
    tmp_path, small_stretches, monkeypatch
):
    # as tmpfs before Linux 6.6 and some FUSE file systems: open with O_DIRECT is EINVAL
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    store = LocalStore(tmp_path)
    store.write_parts("a/big.bin", _parts())
    assert small_stretches == [False]
    assert bytes(store.read_buffer("a/big.bin")) == b"".join(bytes(p) for p in _parts())
    assert sorted(os.listdir(tmp_path / "a")) == [".big.bin.gen", "big.bin"]
