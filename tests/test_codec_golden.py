"""Golden digests: every codec encodes, decodes and leaves residuals bit-identical to the
reference implementation (the numpy codecs of 2026-12-01, before they were vectorized).

If a digest changes, the payload format or the arithmetic changed: a merger would decode old
payloads differently. Update GOLDEN only for a deliberate format change, together with a new
payload format version that refuses the old one (docs/STORE.md); never to make a speed-up pass.
"""

import hashlib

import numpy as np
import pytest

from training import codecs


def _inputs() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(20261201)
    delta = {
        "a": rng.normal(0, 1e-3, (37, 300)).astype(np.float32),  # 11100: not a block multiple
        "b": (rng.standard_t(3, 4096) * np.repeat([1e-6, 1.0, 300.0, 0.0], 1024)).astype(
            np.float32
        ),
        "c": np.array(0.25, np.float32),
        "d": rng.normal(0, 1, 257).astype(np.float32),  # one element past a block
        "e": np.array([1.5, -1.5, 0.5, -0.5, 0.0, 1e-30, -1e-30, 3.0e38], np.float32),
    }
    residual = {k: rng.normal(0, 1e-4, v.shape).astype(np.float32) for k, v in delta.items()}
    residual.pop("c")
    return delta, residual


def _digest(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        v = np.ascontiguousarray(tensors[name])
        h.update(f"{name}:{v.dtype.str}:{v.shape};".encode())
        h.update(v.view(np.uint8).reshape(-1).tobytes())
    return h.hexdigest()[:24]


GOLDEN = {  # codec: digests of (payload, new residual, decoded)
    "fp32": ("794627a1c7da802316cc7192", "17b24699ea4c6ac6da1a2eb5", "794627a1c7da802316cc7192"),
    "bf16": ("6edbe5cb93797e862d4e4ee2", "179c8b55f6e1ce2aa0219828", "7db8c8a6a5b5957d779776cb"),
    "int8": ("d359615d6b4f1f6a8f55b4e9", "537fe5535d06abd4db1c6f54", "29cf26c55fca957bf8370eb4"),
    "int4": ("43cfeb1549054bc49fb5c4f1", "00c2eceb48661c90e7320957", "8a142733ad80f78c563ca050"),
    "int2": ("bb665ae382e2af78d6843f89", "67f9cbdeae998bb8717bfd84", "e3fb1f785579ce3c1a5bd435"),
}


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_codec_is_bit_identical_to_the_reference(codec):
    delta, residual = _inputs()
    payload, new_residual = codecs.encode(delta, codec, residual)
    decoded = codecs.decode(payload, codec)
    got = (_digest(payload), _digest(new_residual), _digest(decoded))
    assert got == GOLDEN[codec], f"{codec}: digests changed (see the module docstring): {got}"
