"""Update broadcast (outer.broadcast = "codec", training/protocol/broadcast.py): the syncer writes each
version's codec-encoded update from the previous shadow and the shadow itself; islands adopt
the shadow by applying updates, bit for bit as the syncer computed it, or read it whole."""

import logging

import numpy as np
import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.codecs import host as codecs
from training.codecs import native
from training.island.process import Island
from training.merge.merger import Merger
from training.model import inner
from training.model.runtime import fragment_names
from training.protocol import broadcast
from training.store.gc import GCPlan


def _cfg(codec="int4", mode="codec", islands=("a", "b")):
    return small_config(
        islands=islands, codec=codec, outer={"method": "nesterov", "broadcast": mode}
    )


def _shapes(store):
    return {n: v.shape for n, v in store.load_params().items()}


def _merge(cfg, store, seq, island="b"):
    """Publish a random delta of `island` (seq `seq`) and merge it: one new version."""
    params = store.load_params()
    publish_delta(store, cfg, island, seq, random_delta(params, seed=seq), store.head(0).version)
    r = Merger(cfg, store).merge_once()
    assert r.versions == {0: store.head(0).version}


def _stored_shadow(store, version=None):
    head = store.head(0) if version is None else store.find_version(0, version)
    manifest = store.fragment_manifest(head)
    return broadcast.read_full(store, head, manifest, _shapes(store)).tensors


def _shadow_at(store, version):
    head = store.find_version(0, version)
    return broadcast.Shadow(version, head.dir, _stored_shadow(store, version))


def _fetch(store, cfg, shadow):
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    return broadcast.fetch(store, head, manifest, shadow, cfg.codec, _shapes(store))


def _assert_bit_equal(a, b):
    assert sorted(a) == sorted(b)
    for n in a:
        assert np.asarray(a[n]).tobytes() == np.asarray(b[n]).tobytes(), n


def test_the_shadow_stays_within_one_step_of_quantization_error_of_theta():
    """int4, six merges: each stored S_v is S_{v-1} + decode(update_v) exactly, and S_v -
    Theta_v is no larger than one update's quantization error (it does not pile up)."""
    cfg = _cfg("int4")
    store = new_store(cfg)
    for seq in range(6):
        _merge(cfg, store, seq)
    for v in range(1, 7):
        head = store.find_version(0, v)
        manifest = store.fragment_manifest(head)
        update = store.load_payload(head, "update", manifest)
        again = broadcast.step(_stored_shadow(store, v - 1), codecs.decode(update, "int4"))
        _assert_bit_equal(again, _stored_shadow(store, v))
        theta = store.load_fragment(head).params
        for n, s in _stored_shadow(store, v).items():
            # one int4 step: half a level of the block's absmax / 7, bounded by the max diff
            bound = np.abs(theta[n] - _stored_shadow(store, v - 1)[n]).max() / 14 + 1e-7
            assert np.abs(s - theta[n]).max() <= bound * 1.001, n


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_an_island_adopting_by_updates_holds_the_syncers_shadow_bit_for_bit(codec):
    """Island a adopts after each of four merges (one update each time): its shadow, its
    parameters and its anchor are the syncer's stored S_v bit for bit, and bytes_received
    counts the update payloads' bytes, not the float32 fragment."""
    cfg = _cfg(codec)
    store = new_store(cfg)
    a = Island(cfg, "a", store)
    a.start()
    full = codecs.payload_nbytes(store.load_params())
    assert a.bytes_received == full
    for seq in range(4):
        _merge(cfg, store, seq)
        assert a.adopt([0]) == 1
        stored = _stored_shadow(store)
        _assert_bit_equal(a.state.shadows[0].tensors, stored)
        _assert_bit_equal(inner.to_host(a.params), stored)
        _assert_bit_equal(inner.to_host(a.state.anchor), stored)
    head = store.head(0)
    sizes = [
        codecs.payload_nbytes(store.load_payload(store.find_version(0, v), "update"))
        for v in range(1, head.version + 1)
    ]
    assert a.bytes_received == full + sum(sizes)
    assert max(sizes) < full / (7 if codec == "int4" else 3.5)


def test_an_island_two_versions_behind_applies_two_updates():
    cfg = _cfg("int4")
    store = new_store(cfg)
    for seq in range(3):
        _merge(cfg, store, seq)
    got = _fetch(store, cfg, _shadow_at(store, 1))
    assert (got.how, got.updates) == ("updates", 2)
    _assert_bit_equal(got.tensors, _stored_shadow(store))


def test_an_island_far_behind_reads_the_whole_shadow():
    """int8 updates are a quarter of the float32 fragment: ten versions behind, ten updates
    would cost more than one read of S_v, so the island reads S_v whole."""
    cfg = _cfg("int8")
    store = new_store(cfg)
    for seq in range(10):
        _merge(cfg, store, seq)
    got = _fetch(store, cfg, _shadow_at(store, 0))
    assert got.how == "full" and got.nbytes == codecs.payload_nbytes(store.load_params())
    _assert_bit_equal(got.tensors, _stored_shadow(store))


def _bad_version(cfg, store, transform):
    """A version (by a buggy syncer) whose update is `transform`ed, with a checksum to match
    and the right shadow: the island must refuse the update and read the shadow whole."""
    head = store.head(0)
    fv = store.load_fragment(head, outer_state=True)
    theta = {n: v + np.float32(0.01) for n, v in fv.params.items()}
    extra = {k: v for k, v in fv.manifest.items() if k in ("tokens_merged", "merge_state")}
    payloads, _ = broadcast.version_payloads(theta, _stored_shadow(store), cfg.codec, extra)
    payloads["update"] = transform(payloads["update"])
    new = store.publish_fragment(
        0, head.version + 1, theta, fv.outer_state, extra, expected=head, payloads=payloads
    )
    assert new is not None


def _first(payload):
    return next(n for n in sorted(payload) if ".__" not in n)


def _wrong_shape(payload):
    out = dict(payload)
    name = _first(payload)
    out[name + ".__shape"] = np.asarray([*payload[name + ".__shape"], 1], np.int32)
    return out


def _nan_scale(payload):
    out = dict(payload)
    scale = out[_first(payload) + ".__scale"].copy()
    scale[0] = np.nan
    out[_first(payload) + ".__scale"] = scale
    return out


@pytest.mark.parametrize(
    "transform, reason",
    [(_wrong_shape, "wrong shape"), (_nan_scale, "non-finite")],
    ids=["wrong-shape", "nan"],
)
def test_a_broken_update_is_refused_and_the_shadow_read_whole(transform, reason, caplog):
    cfg = _cfg("int4")
    store = new_store(cfg)
    _merge(cfg, store, 0)
    _bad_version(cfg, store, transform)
    with caplog.at_level(logging.WARNING, "diloco.broadcast"):
        got = _fetch(store, cfg, _shadow_at(store, 1))
    assert got.how == "full"
    assert "update of fragment 0 version 2 is refused" in caplog.text and reason in caplog.text
    _assert_bit_equal(got.tensors, _stored_shadow(store))


def test_an_update_that_fails_its_checksum_is_refused(caplog):
    cfg = _cfg("int4")
    store = new_store(cfg)
    for seq in range(2):
        _merge(cfg, store, seq)
    key = store.object_key(f"{store.head(0).dir}/update.safetensors")
    data = bytearray(store.store.read(key))
    data[-1] ^= 0xFF
    store.store.write(key, bytes(data))
    with caplog.at_level(logging.WARNING, "diloco.broadcast"):
        got = _fetch(store, cfg, _shadow_at(store, 1))
    assert got.how == "full" and "fails its crc32c checksum" in caplog.text
    _assert_bit_equal(got.tensors, _stored_shadow(store))


def test_a_garbage_collected_update_means_a_full_read():
    """GC deletes a collected version's update and shadow with its other payloads; an island
    whose path goes through it reads HEAD's shadow whole."""
    cfg = _cfg("int4")
    store = new_store(cfg)
    for seq in range(4):
        _merge(cfg, store, seq)
    directory = store.find_version(0, 2).dir
    assert store.collect_garbage(GCPlan(versions=[directory]))["versions"] == 1
    assert not [k for k in store.list_keys(f"{directory}/") if k.endswith(".safetensors")]
    got = _fetch(store, cfg, _shadow_at(store, 1))
    assert got.how == "full"
    _assert_bit_equal(got.tensors, _stored_shadow(store))


def test_fp32_broadcast_writes_no_update_and_islands_read_the_params():
    """outer.broadcast = "fp32" (today's behaviour): versions hold params and outer state
    only, and what islands adopt is exactly the params."""
    cfg = _cfg("int4", mode="fp32")
    store = new_store(cfg)
    _merge(cfg, store, 0)
    head = store.head(0)
    files = sorted(k.rsplit("/", 1)[1] for k in store.list_keys(f"{head.dir}/"))
    assert files == ["manifest.json", "outer_state.safetensors", "params.safetensors"]
    assert broadcast.CODEC_FIELD not in store.fragment_manifest(head)
    _assert_bit_equal(_stored_shadow(store), store.load_fragment(head).params)


def test_with_the_fp32_codec_islands_adopt_theta_exactly():
    """codec fp32: an update would be as large as the version, so none is written and the
    shadow is Theta itself."""
    cfg = _cfg("fp32")
    store = new_store(cfg)
    _merge(cfg, store, 0)
    head = store.head(0)
    assert broadcast.adoptable(store.fragment_manifest(head)) == "params"
    _assert_bit_equal(_stored_shadow(store), store.load_fragment(head).params)


def test_fragments_keep_their_own_shadows():
    """P = 2: each fragment's update covers its own tensors only."""
    cfg = small_config(
        codec="int4", outer={"method": "nesterov", "broadcast": "codec"}, fragments={"count": 2}
    )
    store = new_store(cfg)
    names = fragment_names(cfg)
    params = store.load_params()
    for p in range(2):
        delta = random_delta({n: params[n] for n in names[p]}, seed=p)
        publish_delta(store, cfg, "b", p, delta, fragment=p)
    Merger(cfg, store).merge_once()
    for p in range(2):
        update = store.load_payload(store.head(p), "update")
        assert sorted(n for n in update if ".__" not in n) == sorted(names[p])


def test_a_merger_holding_its_last_version_computes_the_same_shadow_as_one_reading_it():
    """The warm merger (arrays kept from its own publish) and fresh mergers (shadow read from
    the store) write the same update and shadow bit for bit."""
    cfg = _cfg("int4")
    warm_store, cold_store = new_store(cfg), new_store(cfg)
    _assert_bit_equal(warm_store.load_params(), cold_store.load_params())
    warm = Merger(cfg, warm_store)
    for seq in range(3):
        delta = random_delta(warm_store.load_params(), seed=seq)
        publish_delta(warm_store, cfg, "b", seq, delta, seq)
        publish_delta(cold_store, cfg, "b", seq, delta, seq)
        assert warm.merge_once().versions == Merger(cfg, cold_store).merge_once().versions
    _assert_bit_equal(_stored_shadow(warm_store), _stored_shadow(cold_store))


def test_an_island_refusing_an_update_still_adopts_the_version_read_whole(caplog):
    """The island's own adopt: version 2's update is broken, so it reads S_2 whole (counting
    the float32 bytes) and holds exactly the stored shadow."""
    cfg = _cfg("int4")
    store = new_store(cfg)
    a = Island(cfg, "a", store)
    a.start()
    _merge(cfg, store, 0)
    assert a.adopt([0]) == 1 and a.state.shadows[0].version == 1
    before = a.bytes_received
    _bad_version(cfg, store, _nan_scale)
    with caplog.at_level(logging.WARNING, "diloco.broadcast"):
        assert a.adopt([0]) == 1
    assert a.base_version == [2] and "refused" in caplog.text
    assert a.bytes_received - before == codecs.payload_nbytes(store.load_params())
    _assert_bit_equal(a.state.shadows[0].tensors, _stored_shadow(store))
    _assert_bit_equal(inner.to_host(a.params), _stored_shadow(store))


class _KV:
    """The coordination service's key-value store, in memory (as in tests/test_multihost.py)."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value):
        self.kv[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.kv[key]

    def key_value_delete(self, key):
        del self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_a_multi_host_follower_adopts_process_zeros_version_bit_for_bit():
    """Two processes of one island (in one test process, in lockstep): the follower takes
    version 1 by update like process 0; when it has seen version 2 but process 0 chose
    version 3, it reads the chosen version whole. Both hold the stored shadow."""
    from training.island.multihost import ProcessGroup

    cfg = small_config(
        codec="int4",
        outer={"method": "nesterov", "broadcast": "codec"},
        inner={"shard_params": False},
    )
    store = new_store(cfg)
    kv = _KV()
    leader = Island(cfg, "a", store, group=ProcessGroup(0, 2, kv))
    follower = Island(cfg, "a", store, group=ProcessGroup(1, 2, kv))
    leader.start(), follower.start()
    _merge(cfg, store, 0)
    assert leader.adopt([0]) == 1 and follower.adopt([0]) == 1
    assert follower.bytes_received == leader.bytes_received
    _assert_bit_equal(follower.state.shadows[0].tensors, _stored_shadow(store))
    _merge(cfg, store, 1)
    seen = follower.adopter.fetch(follower.state, {0: None})  # the follower's read: version 2
    _merge(cfg, store, 2)
    chosen = leader.adopter.fetch(leader.state, {0: None})  # process 0's: version 3
    leader.adopter.apply(leader.state, leader.adopter.agreed(chosen))
    follower.adopter.apply(follower.state, follower.adopter.agreed(seen))
    assert leader.base_version == follower.base_version == [3]
    _assert_bit_equal(follower.state.shadows[0].tensors, _stored_shadow(store))
    _assert_bit_equal(inner.to_host(follower.params), inner.to_host(leader.params))


def test_a_restored_version_has_no_update_and_its_shadow_is_its_params():
    """restore_snapshot writes Theta of the best version without update or shadow: islands
    read it whole (S = Theta), and the next merge's update starts from it."""
    cfg = _cfg("int4")
    store = new_store(cfg)
    _merge(cfg, store, 0)
    best = store.current_snapshot()
    _merge(cfg, store, 1)
    store.restore_snapshot(best, "test")
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    assert head.version == 3 and broadcast.CODEC_FIELD not in manifest
    got = _fetch(store, cfg, _shadow_at(store, 2))
    assert got.how == "full"
    _assert_bit_equal(got.tensors, store.load_fragment(head).params)
    _merge(cfg, store, 2)
    got = _fetch(store, cfg, broadcast.Shadow(3, head.dir, got.tensors))
    assert (got.how, got.updates) == ("updates", 1)
    _assert_bit_equal(got.tensors, _stored_shadow(store))


@pytest.mark.skipif(native.library() is None, reason="the C loops are not loaded")
def test_the_merge_encodes_the_update_in_its_outer_step(monkeypatch):
    """Every tensor of the version's update is encoded by the outer step's pass (native.c
    `outer_encode_sq`, one pass instead of two), none after it; and the update is the one the
    encode after the step gives (a version's update against the shadow it was made from)."""
    cfg = _cfg("int4")
    store = new_store(cfg)
    _merge(cfg, store, 0)
    fused: list[str] = []
    done = codecs.PendingStep.done
    monkeypatch.setattr(
        codecs.PendingStep, "done", lambda self, n: (fused.append(n), done(self, n))
    )
    before = {n: v.copy() for n, v in _stored_shadow(store).items()}
    _merge(cfg, store, 1)
    assert sorted(fused) == sorted(_shapes(store))
    theta = store.load_params()
    want = codecs.encode_step(theta, before, "int4")
    _assert_bit_equal(store.load_payload(store.head(0), "update"), want)
