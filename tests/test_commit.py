"""The store's one commit (training/store/commit.py), on memory:// and file://: payloads before
the marker before the pointer; a crash at each fault point (an exception in process, SIGKILL in a
child) leaves nothing a reader looks at or the whole commit; a lost marker and a lost
compare-and-swap are reported; steps out of order are refused before anything is written; the
store's five commits pass their kinds' fault points, each named only in commit.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.gcs_fixture import open_backend
from training.store import commit as commits
from training.store.commit import Commit, CommitOrder, CommitPoints
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("memory", "file")

POINTS = CommitPoints(
    payload_written=("t.payload-written",),
    mid_payload="t.mid-payload",
    committed="t.committed",
    before_pointer="t.before-pointer",
    after_pointer="t.after-pointer",
)
IN_ORDER = [
    "t.mid-payload",
    "t.payload-written",
    "t.committed",
    "t.before-pointer",
    "t.after-pointer",
]
PAYLOADS = {"a.json": b'{"a":1}', "b.bin": b"xxyy", "c.bin": b"1" * 10 + b"2" * 10 + b"3" * 10}
MARKER = "marker.json"


class Crash(BaseException):
    """A kill at a fault point, in process: nothing after it runs (no `except Exception`
    catches it, as none catches a SIGKILL)."""


class Recorder:
    """An object store that logs each write the commit makes, in order, into `log`."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log
        self.url = inner.url

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name not in ("write", "write_parts", "write_stream", "create", "delete") and not (
            name.startswith("compare_and_swap")
        ):
            return method

        def logged(key, *args):
            self.log.append((name, key))
            return method(key, *args)

        return logged


def _commit(store, tag: str, expected, hit=None):
    """One commit of all three steps under exp/: payloads of d-{tag}/, its marker, HEAD.json
    swapped from `expected` to d-{tag}: (marker created, new generation or None)."""
    commit = Commit(store, POINTS, hit, root="exp/")
    commit.write(f"d-{tag}/a.json", PAYLOADS["a.json"])
    commit.write_parts(f"d-{tag}/b.bin", [b"xx", memoryview(b"yy")])
    commit.write_stream(f"d-{tag}/c.bin", lambda: iter([b"1" * 10, b"2" * 10, b"3" * 10]))
    created = commit.mark(f"d-{tag}/{MARKER}", f"d-{tag}".encode())
    return created, commit.swap("HEAD.json", f"d-{tag}".encode(), expected)


def _reader(store) -> tuple[list[str], str | None]:
    """What a reader sees: the marked directories and the one HEAD names; asserts there is no
    half commit (a marker whose payloads are not all whole, a HEAD naming no marker)."""
    keys = store.list("exp/")
    marked = sorted(k.split("/")[1] for k in keys if k.endswith(f"/{MARKER}"))
    for directory in marked:
        for name, data in PAYLOADS.items():
            assert store.read(f"exp/{directory}/{name}") == data
    got = store.read_versioned("exp/HEAD.json")
    head = None if got is None else got[0].decode()
    assert head is None or head in marked
    return marked, head


def _generation(store):
    return store.read_versioned("exp/HEAD.json")[1]


@pytest.mark.parametrize("kind", BACKENDS)
def test_payloads_are_written_before_the_marker_before_the_pointer(kind, request, tmp_path):
    log: list = []
    store = Recorder(open_backend(kind, request, tmp_path), log)
    created, generation = _commit(store, "1", None, log.append)
    assert created and generation is not None
    assert log == [
        ("write", "exp/d-1/a.json"),
        ("write_parts", "exp/d-1/b.bin"),
        ("write_stream", "exp/d-1/c.bin"),
        "t.mid-payload",
        "t.payload-written",
        ("create", f"exp/d-1/{MARKER}"),
        "t.committed",
        "t.before-pointer",
        ("compare_and_swap_generation", "exp/HEAD.json"),
        "t.after-pointer",
    ]
    assert _reader(store.inner) == (["d-1"], "d-1")


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("point", IN_ORDER)
def test_a_crash_at_each_fault_point_leaves_nothing_or_the_whole_commit(
    kind, point, request, tmp_path
):
    store = open_backend(kind, request, tmp_path)
    _commit(store, "1", None)

    def hit(at: str) -> None:
        if at == point:
            raise Crash(at)

    with pytest.raises(Crash):
        _commit(store, "2", _generation(store), hit)
    marked, head = _reader(store)
    reached = IN_ORDER.index(point)
    # before the marker: nothing; marked, HEAD not moved: an orphan to pointer readers; moved: all
    assert marked == (["d-1"] if reached < 2 else ["d-1", "d-2"])
    assert head == ("d-2" if point == "t.after-pointer" else "d-1")


CHILD = """
import sys
from tests.test_commit import _commit, _generation
from training.faults.points import FaultPlan
from training.store.registry import open_store
store = open_store(sys.argv[1])
_commit(store, "2", _generation(store), FaultPlan({sys.argv[2]: 1}).hit)
"""


@pytest.mark.parametrize("point", IN_ORDER)
def test_a_process_killed_at_each_fault_point_leaves_nothing_or_the_whole_commit(point, tmp_path):
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    _commit(store, "1", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, url, point], cwd=ROOT, capture_output=True, timeout=60
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    marked, head = _reader(store)
    assert marked == (["d-1"] if IN_ORDER.index(point) < 2 else ["d-1", "d-2"])
    assert head == ("d-2" if point == "t.after-pointer" else "d-1")


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_lost_compare_and_swap_is_reported_and_the_winner_stands(kind, request, tmp_path):
    store = open_backend(kind, request, tmp_path)
    _commit(store, "0", None)
    expected = _generation(store)
    passed: list = []
    assert _commit(store, "1", expected)[1] is not None
    created, generation = _commit(store, "2", expected, passed.append)  # from the same HEAD
    assert (created, generation) == (True, None)
    assert "t.after-pointer" not in passed  # the pointer did not move
    assert _reader(store) == (["d-0", "d-1", "d-2"], "d-1")  # d-2: marked, an orphan


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_lost_marker_is_reported_and_the_first_stands(kind, request, tmp_path):
    store = open_backend(kind, request, tmp_path)
    passed: list = []
    for data, hit in ((b"first", None), (b"second", passed.append)):
        commit = Commit(store, POINTS, hit, root="exp/")
        commit.write(f"p-{data.decode()}", data)
        created = commit.mark(MARKER, data)
    assert created is False and "t.committed" not in passed
    assert store.read(f"exp/{MARKER}") == b"first"


def test_steps_out_of_order_are_refused_before_anything_is_written():
    store = open_store("memory://commit-order")
    commit = Commit(store, POINTS, root="exp/")
    assert commit.mark("m", b"m")
    for step in (lambda: commit.write("late", b"x"), lambda: commit.mark("m2", b"m")):
        with pytest.raises(CommitOrder, match="after the marker"):
            step()
    assert commit.swap("p", b"p", None) is not None
    with pytest.raises(CommitOrder, match="after the pointer"):
        commit.repoint("p", b"q")
    assert store.list("exp/") == ["exp/m", "exp/p"] and store.read("exp/p") == b"p"


# -- the store's commits ----------------------------------------------------------------------


def _tensors(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(4, value, np.float32), "v": np.arange(3, dtype=np.float32)}


class Passed:
    """A fault plan that only records the points passed."""

    def __init__(self):
        self.points: list[str] = []

    def hit(self, point: str) -> None:
        self.points.append(point)


@pytest.mark.parametrize("kind", BACKENDS)
def test_the_stores_commits_pass_their_kinds_fault_points_in_order(kind, request, tmp_path):
    passed = Passed()
    exp = ExperimentStore(open_backend(kind, request, tmp_path), "exp", faults=passed)
    seen = []

    def points() -> list[str]:
        got, passed.points[:] = list(passed.points), []
        return got

    exp.publish_pseudograd("a", 1, 0, _tensors(1.0))
    seen.append(points())
    head = exp.publish_fragment(0, 0, _tensors(0.0), _tensors(0.0))
    seen.append(points())
    head = exp.publish_fragment(0, 1, _tensors(1.0), None, expected=head, full_at=(0, head.dir))
    seen.append(points())
    manifest = exp.fragment_manifest(head)
    assert exp.promote_version(head, manifest, _tensors(1.0), _tensors(2.0), None)
    seen.append(points())
    exp.save_checkpoint("a", 4, _tensors(3.0), {"seq": 1})
    seen.append(points())
    assert exp.record_final({"loss": 1.0}) and exp.offer_best({"loss": 1.0})
    seen.append(points())
    assert seen == [
        ["pseudograd.payload-written", "pseudograd.committed"],
        ["global.payload-written", "global.before-cas", "global.after-cas"],
        ["global.payload-written", "light.before-manifest", "global.before-cas"]
        + ["global.after-cas"],
        ["light.before-promotion"],
        ["checkpoint.mid-state", "checkpoint.before-latest"],
        [],
    ]
    assert exp.load_checkpoint("a")[1]["seq"] == 1 and exp.best()["loss"] == 1.0


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_store_commit_killed_at_each_point_is_not_seen_or_seen_whole(kind, request, tmp_path):
    exp = ExperimentStore(open_backend(kind, request, tmp_path), "exp")
    head = exp.publish_fragment(0, 0, _tensors(0.0), _tensors(0.0))
    exp.save_checkpoint("a", 1, _tensors(0.0), {"seq": 0})
    for point in ("pseudograd.payload-written", "pseudograd.committed"):
        with pytest.raises(Crash):
            _crashing(exp, point).publish_pseudograd("a", 1, 0, _tensors(1.0))
        refs = exp.list_pseudograds("a")
        assert len(refs) == (point == "pseudograd.committed")
        if refs:
            assert np.array_equal(exp.load_pseudograd(refs[0])["w"], _tensors(1.0)["w"])
    for point in ("global.payload-written", "global.before-cas", "global.after-cas"):
        with pytest.raises(Crash):
            _crashing(exp, point).publish_fragment(
                0, head.version + 1, _tensors(1.0), _tensors(1.0), expected=head
            )
        now = exp.head(0)
        assert now.version == head.version + (point == "global.after-cas")
        assert np.array_equal(exp.load_fragment(now).params["w"], _tensors(float(now.version))["w"])
    for point in ("checkpoint.mid-state", "checkpoint.before-latest"):
        with pytest.raises(Crash):
            _crashing(exp, point).save_checkpoint("a", 2, _tensors(2.0), {"seq": 1})
        tensors, meta = exp.load_checkpoint("a")
        assert meta["step"] == 1 and np.array_equal(tensors["w"], _tensors(0.0)["w"])


def _crashing(exp: ExperimentStore, point: str) -> ExperimentStore:
    class Plan:
        def hit(self, at: str) -> None:
            if at == point:
                raise Crash(at)

    return exp.with_faults(Plan())


def test_each_commit_fault_point_is_named_once_in_commit_py_and_documented():
    named = {
        point
        for kind in vars(commits).values()
        if isinstance(kind, CommitPoints)
        for point in (*kind.payload_written, kind.mid_payload, kind.committed)
        + (kind.before_pointer, kind.after_pointer)
        if point is not None
    }
    assert len(named) == 9
    documented = (ROOT / "training/faults/points.py").read_text()
    assert all(re.search(rf"^    {re.escape(p)} ", documented, re.M) for p in named)
    for path in (ROOT / "training").rglob("*.py"):
        if path.name != "commit.py":
            text = path.read_text()
            assert not [p for p in named if f'fault("{p}")' in text or f'hit("{p}")' in text], path
