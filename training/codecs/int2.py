"""The 2-bit pseudo-gradient codec ("int2"): four levels per block, four codes per byte.

Per block of `block` elements of the flattened tensor, scale = absmax / 1.5 and each element
becomes the nearest of the levels (-1.5, -0.5, 0.5, 1.5) x scale, code q in 0..3 for level
q - 1.5 (no zero level: with four levels a symmetric grid has none). Codes are packed four per
byte, element 4i + j in bits 2j..2j+1. `training/codecs/host.py` stores the packed bytes under the
tensor's name, the scales under `name.__scale` and the shape under `name.__shape`, as for int4. The arithmetic is in training/codecs/kernels.py; `pack` / `unpack`
below are the plain statement of the byte layout (tests compare the kernels against it).
"""

from __future__ import annotations

import numpy as np

HALF_RANGE = 1.5  # the outermost level, in units of the scale


def pack(codes: np.ndarray) -> np.ndarray:
    padded = np.zeros(-(-codes.size // 4) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    q = padded.reshape(-1, 4)
    return (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).astype(np.uint8)


def unpack(packed: np.ndarray, n: int) -> np.ndarray:
    if packed.size != -(-n // 4):
        raise ValueError(f"int2: {packed.size} bytes cannot hold {n} codes")
    codes = np.stack([(packed >> s) & 0x03 for s in (0, 2, 4, 6)], axis=1).reshape(-1)
    return codes[:n].astype(np.uint8)
