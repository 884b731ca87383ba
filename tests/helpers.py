"""Shared builders for tests: a very small experiment on an in-memory store."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

from training.codecs import host as codecs
from training.config.experiment import parse_config
from training.merge.merger import initial_version
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

SMALL_MODEL = {"preset": "tiny", "d_model": 32, "n_heads": 2, "d_ff": 64, "max_seq_len": 32}


def small_config(name: str = "exp", islands=("a", "b"), **sections):
    data = {
        "name": name,
        "model": SMALL_MODEL,
        "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 2},
        "inner": {"H": 4, "warmup_steps": 1, "tau": 0},
        "islands": [i if isinstance(i, dict) else {"name": i} for i in islands],
        "codec": "fp32",
        "token_budget": 10**9,
        # rounds on the island's own step counter: publishes at fixed steps, whatever the wall
        # clock does (clock rounds are tested in tests/test_rounds.py with a fake clock)
        "outer": {"rounds": "steps", "quorum": 1},
        # one fragment, every island's contribution merged as it comes (the defaults: P = 4
        # tensor fragments, the automatic quorum): these tests publish whole-model deltas to
        # fragment 0; fragments: tests/test_fragments.py, test_tensors.py; the automatic
        # quorum: tests/test_quorum_auto.py
        "fragments": {"count": 1, "strategy": "strided"},
        # every version full (the default writes a full one every 8th): these tests read any
        # version whole; light versions are tested in tests/test_light_versions.py and in the
        # full_every = 4 rows of the crash, race and island-kill tests
        "syncer": {"full_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    return parse_config(data)


def new_store(cfg, url: str | None = None) -> ExperimentStore:
    store = ExperimentStore(open_store(url or f"memory://t-{uuid.uuid4().hex[:8]}"), cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    initial_version(cfg, store)
    return store


def publish_delta(store, cfg, island, seq, delta, base_version=0, fragment=0, steps=4, tokens=512):
    """Publish `delta` (a full or fragment-sized dict of float32 arrays) as a pseudo-gradient."""
    payload, _ = codecs.encode(delta, cfg.codec)
    return publish_payload(store, cfg, island, seq, payload, base_version, fragment, steps, tokens)


def publish_payload(
    store, cfg, island, seq, payload, base_version=0, fragment=0, steps=4, tokens=512
):
    """Publish an already encoded `payload` (of codec `cfg.codec`) as a pseudo-gradient: its
    checksum is right whatever it holds (what a buggy or hostile island could commit)."""
    manifest = dict(
        base_version=base_version,
        steps=steps,
        tokens=tokens,
        loss=1.0,
        codec=cfg.codec,
        step_time_s=1.0,
        published_at=float(seq),
    )
    return store.publish_pseudograd(island, seq, fragment, payload, manifest)


def fragment_sizes(shapes, assignment, num_fragments) -> list[int]:
    """Element count of each fragment of an `assignment` (name -> fragment) of tensors `shapes`."""
    sizes = [0] * num_fragments
    for name, shape in shapes.items():
        sizes[assignment[name]] += math.prod(shape)
    return sizes


def random_delta(params, seed, scale=1e-2):
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(size=v.shape) * scale).astype(np.float32) for k, v in params.items()}


class FakeClock:
    """A clock the test moves: ``clock()`` reads it, ``clock.t = ...`` sets it, and
    ``clock.sleep(s)`` (pass it where code sleeps) advances it, records the nap in ``naps``, then
    runs each ``(time, fn)`` of ``at`` whose time has come, once (to make things happen "while"
    code sleeps, without threads)."""

    def __init__(self, t: float = 0.0):
        self.t = t
        self.naps: list[float] = []
        self.at: list = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.naps.append(s)
        self.t += s
        for item in [h for h in self.at if h[0] <= self.t]:
            self.at.remove(item)
            item[1]()


def small_dag_params(name: str, store_url: str, islands, overrides=None, **changes) -> dict:
    """The trigger form of a small experiment (tiny model, seq 32, batch 2, 4 shards) with local
    islands `islands`; `overrides` adds to the form's overrides, `changes` to its fields."""
    return {
        "experiment_name": name,
        "store_url": store_url,
        "model_preset": "tiny",
        "islands": [{"name": n, "backend": "local", "hardware": {}} for n in islands],
        "H": 4,
        "codec": "fp32",
        "token_budget": 10**6,
        "overrides": {
            "model.d_model": 32,
            "model.n_heads": 2,
            "model.d_ff": 64,
            "model.max_seq_len": 32,
            "data.seq_len": 32,
            "data.batch_size": 2,
            "data.eval_batches": 1,
            "data.num_shards": 4,
            **(overrides or {}),
        },
        **changes,
    }


def tamper_params(store, fragment: int, version: int, name: str = "params"):
    """Change one value (flat index 3 of the first tensor: + 1 for a float, the lowest bit
    flipped for an integer) of a committed version's payload `name` (params by default) and
    rewrite its manifest's checksum to match: a stored version that is not what its merge
    made, internally consistent. Returns the tensor's name and the value's index."""
    from training.store.layout import dump_json
    from training.store.tensors import checksum, tensor_parts

    head = store.find_version(fragment, version)
    manifest = store.fragment_manifest(head)
    tensors = {n: np.array(v) for n, v in store.load_payload(head, name, manifest).items()}
    tensor = sorted(tensors)[0]
    flat = tensors[tensor].reshape(-1)
    if np.issubdtype(flat.dtype, np.integer):
        flat[3] ^= 1
    else:
        flat[3] += 1.0
    parts = tensor_parts(tensors)
    store.store.write_parts(store.object_key(f"{head.dir}/{name}.safetensors"), parts)
    manifest["crc32c"][name] = checksum(parts)
    store.store.write(store.object_key(f"{head.dir}/manifest.json"), dump_json(manifest))
    return tensor, [int(i) for i in np.unravel_index(3, tensors[tensor].shape)]


def tokens_discarded(store: ExperimentStore) -> int:
    """The tokens a restore of BEST discarded (0 when finalize restored nothing): the mean over
    fragments of the HEAD manifests' `restored_from.tokens_discarded`, as tokens_merged is. The
    tokens a run merged before its end are the restored model's tokens_merged plus these."""
    found = [
        store.fragment_manifest(store.head(p)).get("restored_from", {}).get("tokens_discarded", 0)
        for p in range(store.num_fragments())
    ]
    return sum(found) // len(found)


ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a `diloco` subprocess of the tests: this tree (and the plugins) on
    its path, CPU JAX, gcsfs usable against fake-gcs-server (docs: PLATFORM.md)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")]
    )
    return {**env, **extra}


def cli_process(*argv: str, **env: str) -> subprocess.Popen:
    """`diloco ARGV` as a separate process, as a user starts it (stdout and stderr to one
    text pipe)."""
    return subprocess.Popen(
        [sys.executable, "-m", "training.cli", *argv],
        env=cli_env(**env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def flip_update_byte(store, version: int, fragment: int = 0) -> None:
    """Flip the last byte of fragment `fragment` version `version`'s update.safetensors (bit rot:
    its crc32c no longer matches, nothing else changes)."""
    head = store.find_version(fragment, version)
    key = store.object_key(f"{head.dir}/update.safetensors")
    data = bytearray(store.store.read(key))
    data[-1] ^= 1
    store.store.write(key, bytes(data))


def promote_with_nan(store, merger, part: str = "outer") -> None:
    """Promote fragment 0's HEAD through the store's own promote (checksums that match) with
    NaN in the first tensor of `part` ("outer" state or "shadow") of the merger's warm state."""
    params, outer, shadow = merger._warm[0][1:4]
    arrays = {"outer": outer, "shadow": shadow}
    name = sorted(arrays[part])[0]
    arrays[part] = {**arrays[part], name: np.full_like(arrays[part][name], np.nan)}
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    assert store.promote_version(head, manifest, params, arrays["outer"], arrays["shadow"])
