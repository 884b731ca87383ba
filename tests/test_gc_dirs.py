"""Garbage collection leaves no empty directories in a local store (issue 24 item 9)."""

from __future__ import annotations

from training.store.experiment import ExperimentStore
from training.store.local import LocalStore

CKPT = "checkpoints/a/c0000000004-0123abcd"


def test_a_deleted_checkpoint_leaves_no_directory(tmp_path):
    estore = ExperimentStore(LocalStore(tmp_path), "exp")
    for name in ("state.safetensors", "meta.json"):
        estore.store.write(estore.object_key(f"{CKPT}/{name}"), b"x")
    assert estore.delete_prefix(f"{CKPT}/") == 2
    assert not (tmp_path / "exp" / CKPT).exists()
    assert (tmp_path / "exp" / "checkpoints" / "a").is_dir()  # its parent stays


def test_a_directory_with_an_object_left_stays(tmp_path):
    store = LocalStore(tmp_path)
    store.write(f"exp/{CKPT}/meta.json", b"x")
    store.write(f"exp/{CKPT}/state.safetensors", b"x")
    store.delete(f"exp/{CKPT}/meta.json")
    assert not store.remove_empty_dir(f"exp/{CKPT}/")
    assert store.read(f"exp/{CKPT}/state.safetensors") == b"x"
