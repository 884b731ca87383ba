"""What every test shares: jax's strict rank promotion, the fake clock, small stores.

``JAX_NUMPY_RANK_PROMOTION=raise`` is set before jax is imported (and inherited by the island
and merge processes the tests start): an implicit broadcast between arrays of different ranks is
an error in tests, so a shape bug cannot hide behind broadcasting.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
if "jax" in sys.modules:  # imported by a plugin before this file: set it there too
    sys.modules["jax"].config.update("jax_numpy_rank_promotion", "raise")

from tests.helpers import FakeClock, new_store, small_config  # noqa: E402


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at t = 1000 (see `tests.helpers.FakeClock`)."""
    return FakeClock(1000.0)


@pytest.fixture
def file_url(tmp_path) -> str:
    """A file:// store URL in this test's temporary directory."""
    return f"file://{tmp_path}/store"


@pytest.fixture
def small_store():
    """A fresh memory:// store of `small_config()`, initialized at version 0."""
    return new_store(small_config())


@pytest.fixture
def numpy_only(monkeypatch):
    """run(fn, *args): fn called with the C loops unloaded (training/codecs/native.py
    `library()` None), so it takes its numpy path: the definition the C loops match."""
    from training.codecs import native

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)
            return fn(*args)

    return run


@pytest.fixture
def chunk_threads():
    """set(n): the C loops run over chunks on n threads (training/codecs/native.set_threads)
    for the rest of the test, one thread again after it."""
    from training.codecs import native

    yield native.set_threads
    native.set_threads(1)
