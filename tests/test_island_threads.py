"""An island's uploads and its adoption reads run on separate threads (training/island/process.py)."""

import threading

from tests.helpers import new_store, small_config
from training.island.process import Island
from training.merge.merger import Merger


class _GatedPublish:
    """The island's store, with every pseudo-gradient upload held until `gate` is set (a slow
    uplink); everything else goes straight to the store."""

    def __init__(self, store, gate: threading.Event):
        self._store, self._gate = store, gate

    def publish_pseudograd(self, *args, **kwargs):
        assert self._gate.wait(60), "the test never released the upload"
        return self._store.publish_pseudograd(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_stuck_upload_does_not_hold_back_the_adoption_of_a_new_version():
    cfg = small_config(islands=("a", "b"), outer={"method": "nesterov"}, inner={"H": 16, "tau": 1})
    store = new_store(cfg)
    gate = threading.Event()
    a = Island(cfg, "a", _GatedPublish(store, gate), background=True)
    a.start()
    try:
        for _ in range(cfg.inner.H):  # a publishes seq 0 at step 16: its upload is held
            a.step()
        b = Island(cfg, "b", store)
        b.start()
        for _ in range(cfg.inner.H):
            b.step()
        assert Merger(cfg, store).merge_once().version == 1  # b's contribution alone
        # steps 17..31: a looks for the merge of its publish every step until step 16 + H/2 =
        # 24, then for any newer version every H/4 = 4 steps (whether a read lands within its
        # step or the next shifts that by a step: adopted by step 30 either way); its next
        # publish (step 32, which would wait for the held upload) is not reached
        for _ in range(cfg.inner.H - 1):
            a.step()
            a.fetch_io.drain()
        assert a.base_version == [1]
        assert not a.publisher.uploads[0].done()  # the upload of seq 0 is still held
    finally:
        gate.set()
        a.drain_background()
        a.close_background()
    assert [r.seq for r in store.list_pseudograds("a")] == [0]
