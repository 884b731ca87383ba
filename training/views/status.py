"""What `diloco status` shows: versions, islands, staleness, throughput, last losses, and the
bytes the experiment holds in the store by kind."""

from __future__ import annotations

import time

from training.config.experiment import ExperimentConfig
from training.config.scavenge import METRIC as SCAVENGE_METRIC
from training.config.scavenge import scavenge_view
from training.island.goodput import BADPUT, experiment_goodput
from training.protocol.stall import island_state
from training.store.faces import ReaderFace

STATE_NOTE = {
    "finished": "  FINISHED: the token budget is merged",
    "stopped": "  STOPPED: a stop was requested",
}
"""What `diloco status` appends to its summary line for an experiment that is not running."""

STORAGE_KINDS = {
    "checkpoints": "checkpoints",
    "pseudograds": "pseudo-gradients",
    "fragments": "versions",
    "snapshots": "snapshots",
}
"""Top-level folder of the experiment -> the kind `diloco status` names it; the rest (ledger,
metrics, heartbeats, control, config, ...) is "records"."""


def bytes_by_kind(sizes: dict[str, int]) -> dict[str, int]:
    """Bytes per kind (`STORAGE_KINDS`, then "records" and "total") of keys relative to the
    experiment root."""
    out = dict.fromkeys([*STORAGE_KINDS.values(), "records"], 0)
    for key, size in sizes.items():
        out[STORAGE_KINDS.get(key.split("/", 1)[0], "records")] += int(size)
    out["total"] = sum(out.values())
    return out


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def collect_status(cfg: ExperimentConfig, store, now: float | None = None) -> dict:
    """Everything `diloco status` shows. Every record comes through the store's strict readers
    (training/store/island_records.py): junk names and broken heartbeats, markers and metrics are
    skipped and counted in `skipped` ({"count", "examples"}), never fatal. An island's state is
    the page's word (training/protocol/stall.py `island_state`: the one stall rule), without
    Airflow's task states."""
    store = ReaderFace(store)  # training/store/faces.py
    from training.model.evaluate import end_of_run_report

    now = time.time() if now is None else now
    skipped_before = store.skipped.count
    snapshot = store.current_snapshot()
    heads = list(snapshot.versions) if snapshot else None
    beats = store.heartbeats()
    done = store.done()
    stopped = store.stopped_islands()
    applied = store.applied_ids()
    quarantined = store.quarantined()
    pending = sum(len(refs) for refs in store.pending().values()) if heads else 0
    evals = store.read_metrics("eval")
    report = end_of_run_report(store)
    scavenged = scavenge_view(store.read_metrics(SCAVENGE_METRIC))
    islands = []
    for isl in cfg.islands:
        hb = beats.get(isl.name, {})
        scav = scavenged.get(isl.name) or {}
        base = hb.get("base_version")
        staleness = None
        if heads and isinstance(base, list) and len(base) == len(heads):
            staleness = max(h - b for h, b in zip(heads, base, strict=True))
        at = hb.get("time", hb.get("at"))  # as the page reads it (views/dashboard.py)
        age = now - at if isinstance(at, int | float) else None
        islands.append(
            dict(
                island=isl.name,
                backend=isl.backend,
                state=island_state(
                    isl.name in done,
                    age,
                    cfg.heartbeat_s,
                    stop_requested=isl.name in stopped,
                    left=scav.get("state") == "left",
                ),
                step=hb.get("step"),
                tokens=hb.get("tokens"),
                tokens_per_s=hb.get("tokens_per_s"),
                loss=hb.get("loss"),
                staleness=staleness,
                bytes_sent=hb.get("bytes_sent"),
                bytes_received=hb.get("bytes_received"),
                heartbeat_age_s=age,
                goodput=hb.get("goodput"),
                scavenged=bool(scav),
                joined_at=scav.get("joined_at"),
                left_at=scav.get("left_at"),
                left_reason=scav.get("reason"),
                window_closes_at=scav.get("closes_at"),
            )
        )
    return dict(
        experiment=cfg.name,
        store=cfg.store_url,
        fragment_versions=heads,
        tokens_merged=snapshot.tokens_merged if snapshot else 0,
        token_budget=cfg.token_budget,
        pending=pending,
        applied=len(applied),
        quarantined=len(quarantined),
        last_eval=evals[-1] if evals else None,
        best_eval=store.best(),
        warning=report["warning"],
        goodput=experiment_goodput(cfg, {n: hb.get("goodput_state") for n, hb in beats.items()}),
        stop_requested=store.stop_requested(None),
        state=store.run_state(),
        storage=bytes_by_kind(store.sizes()),
        islands=islands,
        skipped=dict(
            count=store.skipped.count - skipped_before, examples=store.skipped.examples[:5]
        ),
    )


def _clock(t) -> str:
    return "-" if not isinstance(t, int | float) else time.strftime("%H:%M:%S", time.localtime(t))


def _fmt(value, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def format_status(s: dict) -> str:
    lines = [
        f"experiment {s['experiment']}  store {s['store']}",
        f"fragment versions {_fmt(s['fragment_versions'])}  tokens merged {s['tokens_merged']:,} / "
        f"{s['token_budget']:,}  applied {s['applied']}  pending {s['pending']}  "
        f"quarantined {s['quarantined']}" + STATE_NOTE.get(s.get("state", "running"), ""),
    ]
    if s["last_eval"]:
        e = s["last_eval"]
        lines.append(f"last eval: versions {e.get('versions')} loss {_fmt(e.get('loss'), '.4f')}")
    if s.get("best_eval"):
        b = s["best_eval"]
        lines.append(f"best eval: versions {b.get('versions')} loss {_fmt(b.get('loss'), '.4f')}")
    if s.get("warning"):
        lines.append(f"WARNING: {s['warning']}")
    g = s.get("goodput")
    if g:
        top = sorted(((g["badput"][c], c) for c in BADPUT if g["badput"][c] >= 0.005), reverse=True)
        badput = ", ".join(f"{c} {v:.0%}" for v, c in top) or "none"
        lines.append(
            f"goodput {g['goodput']:.1%} (chip-weighted, {g['islands']} islands, {g['chips']} chips)"
            f"  badput: {badput}"
        )
    storage = s.get("storage")
    if storage:
        kinds = ", ".join(f"{k} {_human(v)}" for k, v in storage.items() if k != "total")
        lines.append(f"store holds {_human(storage['total'])}: {kinds}")
    skipped = s.get("skipped") or {}
    if skipped.get("count"):
        example = skipped["examples"][0] if skipped.get("examples") else ""
        lines.append(f"skipped {skipped['count']} unreadable objects, e.g. {example}")
    header = f"{'island':16s} {'state':11s} {'step':>7s} {'tokens':>10s} {'tok/s':>8s} {'loss':>7s} {'stale':>5s} {'beat age':>8s} {'goodput':>7s}"
    lines += ["", header, "-" * len(header)]
    for i in s["islands"]:
        lines.append(
            f"{i['island']:16s} {i['state']:11s} {_fmt(i['step']):>7s} {_fmt(i['tokens'], ','):>10s} "
            f"{_fmt(i['tokens_per_s'], '.0f'):>8s} {_fmt(i['loss'], '.3f'):>7s} "
            f"{_fmt(i['staleness']):>5s} {_fmt(i['heartbeat_age_s'], '.0f'):>8s} "
            f"{_fmt(i['goodput'], '.0%'):>7s}"
        )
    scav = [i for i in s["islands"] if i.get("scavenged")]
    if scav:
        lines += ["", "scavenged islands (metrics/scavenge):"]
        for i in scav:
            until = f"left {_clock(i['left_at'])} ({i['left_reason']})"
            if i["state"] != "left":
                until = f"window until {_clock(i['window_closes_at'])}"
            lines.append(f"  {i['island']:16s} joined {_clock(i['joined_at'])}  {until}")
    return "\n".join(lines)
