"""The store's faces (training/store/faces.py): each role asks of a store only what its face has.

Statically: every attribute a role's module asks of a store-named value (`store`, `estore`,
`self.store`, `view.estore`, ...) is in its face; the broadcast protocol's in both the island's
and the merge's. At run time: a face refuses anything else with a line naming the role."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from training.store.experiment import ExperimentStore
from training.store.faces import (
    BROADCAST,
    FACES,
    IDENTITY,
    IslandFace,
    MergeFace,
    ReaderFace,
)
from training.store.memory import MemoryStore

ROOT = Path(__file__).resolve().parents[1]
INSTANCE = {"store", "experiment", "max_workers", "faults", "skipped"}  # set in __init__
STORE_NAMES = {n for n in dir(ExperimentStore) if not n.startswith("__")} | INSTANCE


def _asked(path: Path) -> set[str]:
    """The ExperimentStore attributes `path` asks of a value whose name says it is a store."""
    asked = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or node.attr not in STORE_NAMES:
            continue
        base = node.value
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        if "store" in name.lower():
            asked.add(node.attr)
    return asked


@pytest.mark.parametrize("face", FACES, ids=lambda f: f.ROLE)
def test_every_module_of_a_role_asks_only_what_its_face_has(face):
    for module in face.MODULES:
        past = _asked(ROOT / module) - face.METHODS - IDENTITY
        assert not past, f"{module} reaches past the {face.ROLE} face: {sorted(past)}"


def test_the_broadcast_protocol_asks_what_both_the_island_and_the_merge_have():
    asked = _asked(ROOT / "training/protocol/broadcast.py")
    assert asked <= BROADCAST
    assert BROADCAST <= IslandFace.METHODS & MergeFace.METHODS


def test_every_method_of_every_face_is_the_stores():
    for face in FACES:
        assert face.METHODS <= STORE_NAMES, face.ROLE


def test_every_role_module_exists():
    missing = [m for face in FACES for m in face.MODULES if not (ROOT / m).is_file()]
    assert not missing


def test_a_face_answers_its_methods_and_refuses_the_rest():
    estore = ExperimentStore(MemoryStore("mem"), "exp")
    face = IslandFace(estore)
    assert face.experiment == "exp" and face.heads == estore.heads
    with pytest.raises(
        AttributeError, match="the island face of the store has no 'publish_fragment'"
    ):
        _ = face.publish_fragment


def test_a_face_of_a_face_is_narrower_never_wider():
    face = ReaderFace(IslandFace(ExperimentStore(MemoryStore("mem"), "exp")))
    assert face.heartbeats  # in both
    with pytest.raises(AttributeError, match="island face"):
        _ = face.config  # the reader's, but not the island's


def test_a_face_cannot_be_written_through():
    with pytest.raises(AttributeError, match="read-only"):
        IslandFace(ExperimentStore(MemoryStore("mem"), "exp")).heads = None


def test_an_island_and_a_merger_hand_their_face_to_every_part_they_build(tmp_path):
    from tests.helpers import new_store, small_config
    from training.island.process import Island
    from training.merge.merger import Merger

    cfg = small_config()
    store = new_store(cfg, f"file://{tmp_path}")
    island = Island(cfg, "a", store, background=False)
    assert {type(s) for s in (island.store, island.adopter.store, island.publisher.store)} == {
        IslandFace
    }
    merger = Merger(cfg, store)
    assert {type(s) for s in (merger.store, merger._reads.store)} == {MergeFace}
