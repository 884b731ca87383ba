"""Merger-level fuzzing: a live experiment (memory:// store, tiny model) where island "a" writes
random mutations of valid contributions and junk into every prefix it may write (docs/STORE.md,
"Threat model"), while islands "b" and "c" publish valid contributions in two rounds. Whatever
"a" wrote: no merge raises, every valid contribution is applied exactly once (in exactly one
version's `applied` list and in the ledger under that version), nothing is applied twice, the
merged token count is the sum of the applied contributions' tokens, no STOP is written, and
`diloco status` reads the experiment.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import new_store, publish_delta, random_delta, small_config
from tests.test_fuzz_records import JSON_VALUES
from training.merge.merger import Merger
from training.store.safejson import dump_json
from training.store.tensors import encode_tensors, sha256
from training.views.status import collect_status

FAST = settings(
    max_examples=6,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOW = settings(FAST, max_examples=150)
KERNEL = "blocks/0/mlp_up/kernel"
FIELDS = ["experiment", "island", "seq", "fragment", "payload", "nbytes", "sha256"]
FIELDS += ["created_at", "base_version", "steps", "tokens", "codec", "published_at"]
FIELDS += ["step_time_s", "island_step", "loss"]

OPS = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(FIELDS), JSON_VALUES),
    st.tuples(st.just("drop"), st.sampled_from(FIELDS), st.none()),
    st.tuples(st.just("scale"), st.integers(-12, 6), st.none()),
    st.tuples(st.just("claim"), st.integers(1, 2**60), st.integers(1, 2**60)),
    st.tuples(st.just("tree"), st.sampled_from(["extra", "shape", "nan", "dtype"]), st.none()),
    st.tuples(st.just("payload-bytes"), st.binary(max_size=64), st.booleans()),
    st.tuples(st.just("marker-bytes"), st.binary(max_size=64), st.none()),
    st.tuples(st.just("deep"), st.integers(100, 5000), st.sampled_from(["marker", "payload"])),
    st.tuples(st.just("junk-name"), st.sampled_from(["seq", "digit", "frag", "folder"]), st.none()),
    st.tuples(st.just("junk-object"), st.sampled_from(["heartbeat", "done", "chaos"]), st.binary()),
    st.tuples(st.just("copy"), st.sampled_from(["b", "a"]), st.none()),
)


class Hostile:
    """Island a: every write goes to a prefix island a may write."""

    def __init__(self, cfg, store, theta):
        self.cfg, self.store, self.theta, self.seq = cfg, store, theta, 0

    def put(self, relative: str, data: bytes) -> None:
        self.store.store.write(self.store.object_key(relative), data)

    def commit(self, tensors=None, raw: bytes | None = None, fields=None) -> None:
        """Commit `tensors` (or `raw` payload bytes) with a valid manifest, then apply
        `fields` to it (a value of _DROP deletes the field)."""
        seq, self.seq = self.seq, self.seq + 1
        stem = f"pseudograds/a/{seq:08d}-f000"
        data = raw if raw is not None else encode_tensors(tensors)
        key = f"{stem}-{uuid.uuid4().hex[:8]}.safetensors"
        self.put(key, data)
        manifest = dict(
            experiment=self.store.experiment,
            island="a",
            seq=seq,
            fragment=0,
            payload=key,
            nbytes=len(data),
            sha256=sha256(data),
            created_at=0.0,
            base_version=0,
            steps=4,
            tokens=512,
            codec="fp32",
            published_at=float(seq),
            step_time_s=1.0,
            loss=1.0,
        )
        for name, value in (fields or {}).items():
            if value is _DROP:
                manifest.pop(name, None)
            else:
                manifest[name] = value
        self.put(f"{stem}.json", json.dumps(manifest, allow_nan=True, default=str).encode())

    def apply(self, op) -> None:
        kind, x, y = op
        delta = random_delta(self.theta, 1000 + self.seq)
        if kind == "field":
            self.commit(delta, fields={x: y})
        elif kind == "drop":
            self.commit(delta, fields={x: _DROP})
        elif kind == "scale":
            self.commit({k: v * np.float32(10.0**x) for k, v in delta.items()})
        elif kind == "claim":
            self.commit(delta, fields={"steps": x, "tokens": y})
        elif kind == "tree":
            bad = dict(delta)
            if x == "extra":
                bad["blocks/99/evil"] = np.zeros(3, np.float32)
            elif x == "shape":
                bad[KERNEL] = np.zeros((3, 3), np.float32)
            elif x == "nan":
                bad[KERNEL] = np.full_like(delta[KERNEL], np.nan)
            else:
                bad[KERNEL] = delta[KERNEL].astype(np.float64)
            self.commit(bad)
        elif kind == "payload-bytes":
            data = encode_tensors(delta)
            if y:
                self.commit(raw=data[: len(data) // 2] + x)
            else:
                self.commit(raw=x)
        elif kind == "marker-bytes":
            self.put(f"pseudograds/a/{self.seq:08d}-f000.json", x)
            self.seq += 1
        elif kind == "deep":
            nested = b'{"a":' + b"[" * x + b"]" * x + b"}"
            if y == "marker":
                self.put(f"pseudograds/a/{self.seq:08d}-f000.json", nested)
                self.seq += 1
            else:
                self.commit(raw=len(nested).to_bytes(8, "little") + nested)
        elif kind == "junk-name":
            name = {
                "seq": f"pseudograds/a/{self.seq:09d}-f000.json",
                "digit": "pseudograds/a/0000000\u0663-f000.json",
                "frag": f"pseudograds/a/{self.seq:08d}-f0.json",
                "folder": "pseudograds/a/x/00000000-f000.json",
            }[x]
            self.put(name, dump_json({"seq": self.seq}))
        elif kind == "junk-object":
            where = {
                "heartbeat": "heartbeats/a.json",
                "done": "done/a.json",
                "chaos": f"metrics/chaos/{self.seq:020d}-0123abcd.json",
            }[x]
            self.put(where, y)
        elif kind == "copy":  # an old commit (its own, or one b published) under a new seq
            src = self.store.list_pseudograds(island=x)
            if src:
                raw = self.store.store.read(self.store.object_key(f"pseudograds/{src[0].id}.json"))
                self.put(f"pseudograds/a/{self.seq:08d}-f000.json", raw)
                self.seq += 1


_DROP = object()


def _run(method: str, ops_before: list, ops_between: list) -> None:
    # no grace floor: each one-shot merge_all applies what is there (c may never publish)
    cfg = small_config(islands=("a", "b", "c"), outer={"method": method, "grace_min_steps": 0.0})
    store = new_store(cfg)
    theta = store.load_params()
    hostile = Hostile(cfg, store, theta)
    honest = []
    for island in ("b", "c"):
        honest.append(publish_delta(store, cfg, island, 0, random_delta(theta, ord(island))))
    for op in ops_before:
        hostile.apply(op)
    Merger(cfg, store).merge_all()
    head = store.head(0).version  # small_config: one fragment
    for island in ("b", "c"):
        d = random_delta(theta, 10 * ord(island))
        honest.append(publish_delta(store, cfg, island, 1, d, base_version=head))
    for op in ops_between:
        hostile.apply(op)
    Merger(cfg, store).merge_all()
    Merger(cfg, store).merge_all()  # nothing new: nothing applied twice

    versions = store.list_fragment_versions(0)
    applied = [pg for m in versions for pg in m["applied"]]
    assert len(applied) == len(set(applied)), "a contribution was applied twice"
    for ref in honest:
        assert applied.count(ref.id) == 1, (ref.id, store.quarantined().get(ref.id))
    ledger = store.applied()
    where = {pg: m["version"] for m in versions for pg in m["applied"]}
    assert all(ledger[pg] == v for pg, v in where.items())
    tokens = {r.id: r.manifest.get("tokens") for r in store.list_pseudograds()}
    assert versions[-1]["tokens_merged"] == sum(tokens[pg] for pg in applied)
    assert not store.stop_requested()
    assert collect_status(cfg, store)["fragment_versions"] == [versions[-1]["version"]]


PLANS = (
    st.sampled_from(["nesterov", "decoupled"]),
    st.lists(OPS, max_size=8),
    st.lists(OPS, max_size=4),
)


def test_valid_contributions_are_applied_exactly_once_whatever_island_a_writes():
    FAST(given(*PLANS)(_run))()


@pytest.mark.slow
def test_valid_contributions_are_applied_exactly_once_whatever_island_a_writes_long_run():
    SLOW(given(*PLANS)(_run))()
