"""The store's faces: each role of the system sees only the part of one experiment it needs.

`ExperimentStore` holds every object of an experiment; no role needs all of it. A face is a
narrow view of one experiment: the names of the store methods one role calls, and nothing else.
A role is handed its face (`IslandFace(estore)`, ...) by whoever builds it (the CLI, a use case,
an Airflow task, the syncer for its merger); asking a face for anything else raises
`AttributeError` naming the role and the method, so a role that reaches past its face fails the
first test that runs that path, and tests/test_faces.py checks every role's modules statically
(`MODULES`: the attribute names each module asks of a store are in its face).

| face | who | what |
|---|---|---|
| `IslandFace` | training/island/ | versions to adopt, its contributions, heartbeats, done, its checkpoint, stop, the round clock |
| `MergeFace` | training/merge/ (but the syncer) | pending contributions, the ledger, fragment versions and promotions, snapshots, quarantine, merge metrics |
| `SyncerFace` | training/merge/syncer.py | leases, run markers, the finalize claim, what finishes a run |
| `ReaderFace` | training/views/, the Airflow page and triggers | what status, the page and the reports show: config, islands, versions, snapshots, metrics |
| `EvaluatorFace` | training/model/evaluate.py | the model at a snapshot, BEST and FINAL, eval records, restores |
| `MaintenanceFace` | garbage collection (plugins' retention) | the GC plan and its collection |

Every face also answers `experiment`, `url` and `skipped` (`IDENTITY`). A face of a face is
narrower still (never wider): `IslandFace(MergeFace(estore))` answers only what both do.

`protocol/broadcast.py` is called by the island and by the merge with their own faces: what it
asks of a store is in both (`BROADCAST`).
"""

from __future__ import annotations

from typing import Any, ClassVar

IDENTITY = frozenset({"experiment", "url", "skipped"})
"""What every face answers: the experiment's name, its store URL and the tally of objects its
readers skipped (`keys.SkipTally`: junk names and broken records are counted, never fatal)."""

BROADCAST = frozenset(
    {"fragment_manifest", "light_chain", "load_payload", "load_promoted_shadow", "promotion"}
)
"""What protocol/broadcast.py reads of a fragment version (island and merge)."""


class Face:
    """A narrow view of one experiment: only `METHODS` (and `IDENTITY`) pass through."""

    ROLE: ClassVar[str] = ""
    METHODS: ClassVar[frozenset[str]] = frozenset()
    MODULES: ClassVar[tuple[str, ...]] = ()
    """The modules (paths from the repository root) of this role, checked by tests/test_faces.py."""

    __slots__ = ("_of",)

    def __init__(self, of: Any):
        object.__setattr__(self, "_of", of)

    def __getattr__(self, name: str) -> Any:
        if name in self.METHODS or name in IDENTITY:
            return getattr(self._of, name)
        raise AttributeError(
            f"the {self.ROLE} face of the store has no {name!r} "
            f"(training/store/faces.py: a role sees only its face)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the {self.ROLE} face of the store is read-only ({name!r})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._of!r})"


class IslandFace(Face):
    """An island: the versions it adopts (heads, manifests, updates, promotions, whole reads),
    its pseudo-gradients and what was applied of them, heartbeats and done markers, its
    checkpoint, stop requests, the round clock."""

    ROLE = "island"
    METHODS = BROADCAST | {
        "heads",
        "find_version",
        "is_applied",
        "parallel",
        "list_pseudograds",
        "publish_pseudograd",
        "write_heartbeat",
        "write_events",
        "heartbeats",
        "mark_done",
        "done",
        "save_checkpoint",
        "load_checkpoint",
        "collect_uncommitted_checkpoints",
        "stop_requested",
        "round_clock",
    }
    MODULES = tuple(
        f"training/island/{m}.py"
        for m in (
            "adopt",
            "background",
            "checkpoint",
            "encode",
            "goodput",
            "multihost",
            "process",
            "publish",
            "state",
        )
    )


class MergeFace(Face):
    """A merge shard's merger (and replay): pending contributions and their payloads, the
    ledger and its cursors, fragment versions (publish, chains, promotions), snapshots of the
    merged model, quarantine, its records; the round clock it starts; the stop it asks for
    when the token budget is spent."""

    ROLE = "merge"
    METHODS = BROADCAST | {
        "heads",
        "head",
        "find_version",
        "list_fragment_versions",
        "load_fragment",
        "load_promoted",
        "pending_after",
        "pseudograd",
        "load_pseudograd",
        "checked_cursors",
        "repair_ledger",
        "publish_fragment",
        "promote_version",
        "quarantine",
        "current_snapshot",
        "record_snapshot",
        "append_metric",
        "write_events",
        "heartbeats",
        "done",
        "stopped_islands",
        "stop_requested",
        "request_stop",
        "round_clock",
        "create_round_clock",
        "hit_fault",
    }
    MODULES = (
        "training/merge/merger.py",
        "training/merge/apply.py",
        "training/merge/promote.py",
        "training/merge/reads.py",
        "training/merge/replay.py",
        "training/merge/warm.py",
    )


class SyncerFace(Face):
    """A syncer shard and its triggers: its lease, the run's islands-ended marker, the one
    finalize claim, and what says the run is finished (config, done, left, pending)."""

    ROLE = "syncer"
    METHODS = frozenset(
        {
            "config",
            "done",
            "stopped_islands",
            "pending",
            "read_lease",
            "swap_lease",
            "drop_lease",
            "mark_run_ended",
            "run_ended",
            "claim_finalize",
            "newest_metric",
        }
    )
    MODULES = ("training/merge/syncer.py", "training/merge/evaluator.py")


class ReaderFace(Face):
    """`diloco status`, the DiLoCo page, reports, Airflow triggers: reads only."""

    ROLE = "reader"
    METHODS = frozenset(
        {
            "config",
            "heartbeats",
            "done",
            "stopped_islands",
            "stop_requested",
            "run_state",
            "pending",
            "applied_ids",
            "quarantined",
            "quarantine_ids",
            "quarantine_reason",
            "list_fragment_versions",
            "current_snapshot",
            "snapshots",
            "best",
            "read_metrics",
            "read_metrics_after",
            "sizes",
        }
    )
    MODULES = (
        "training/views/dashboard.py",
        "training/views/report.py",
        "training/views/status.py",
        "plugins/diloco_airflow/triggers.py",
        "plugins/diloco_airflow/maintenance.py",
    )


class EvaluatorFace(Face):
    """Evaluation of the global model: the params at a snapshot (on the fragments' chains),
    eval records, BEST (offered by compare-and-swap) and FINAL, restores of a snapshot."""

    ROLE = "evaluator"
    METHODS = frozenset(
        {
            "current_snapshot",
            "snapshot_of",
            "snapshot_history",
            "record_snapshot",
            "on_chain",
            "load_params",
            "best",
            "offer_best",
            "restore_snapshot",
            "append_metric",
            "read_metrics",
            "write_events",
        }
    )
    MODULES = ("training/model/evaluate.py",)


class MaintenanceFace(Face):
    """Garbage collection: what a collection would delete, and the collection."""

    ROLE = "maintenance"
    METHODS = frozenset({"plan_gc", "collect_garbage"})
    MODULES = ("plugins/diloco_airflow/retention.py",)


FACES: tuple[type[Face], ...] = (
    IslandFace,
    MergeFace,
    SyncerFace,
    ReaderFace,
    EvaluatorFace,
    MaintenanceFace,
)
