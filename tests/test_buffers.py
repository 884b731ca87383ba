"""The merger's reused read buffers (training/store/buffers.py)."""

from __future__ import annotations

import numpy as np

from training.store.buffers import BufferPool


def test_a_released_pool_hands_out_the_smallest_free_buffer_that_fits():
    pool = BufferPool()
    a, b, c = pool.take(100), pool.take(300), pool.take(200)  # three arrays of 100, 300, 200
    for view, byte in ((a, 1), (b, 2), (c, 3)):
        np.frombuffer(view, np.uint8)[:] = byte
    pool.release_all()
    # 150 bytes: the 200-byte array (the smallest that holds it), then 250: the 300-byte one
    assert bytes(pool.take(150))[:1] == b"\x03" and bytes(pool.take(250))[:1] == b"\x02"
    assert len(pool.take(50)) == 50 and pool.nbytes == 600  # the 100-byte one: nothing new


def test_buffers_of_other_sizes_never_compare_element_wise():
    # the demo's P = 4 fragments read payloads of different sizes: taking one must not compare
    # the free arrays with `==` (numpy's element-wise compare of unequal shapes raises)
    pool = BufferPool()
    for n in (116841, 108681, 101885):
        pool.take(n)
    pool.release_all()
    assert [len(pool.take(n)) for n in (101885, 116841, 108681)] == [101885, 116841, 108681]
