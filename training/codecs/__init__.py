"""Pseudo-gradient codecs: the host definition (numpy), its chunked kernels and their C twin, and
the 2-bit layout; bit-identical to each other (the island's jitted encoder: training/island/encode.py)."""
