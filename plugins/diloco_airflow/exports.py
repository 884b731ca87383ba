"""The example consumer of the models asset: export an experiment's best snapshot to a folder.

`export_best(store_url, experiment, root)` runs `diloco export --snapshot best` (a subprocess:
jax and the model load there, not in the task's Airflow process) into a temporary folder, then
renames it to ``<root>/<experiment>/best-<snapshot id>``: a folder that exists is a finished
export, so a repeated event (the watcher is at least once) or a retried task does nothing twice.
BEST can move while the export runs: the export is pinned to the snapshot `diloco export` read
(its export.json records versions, dirs, tokens and eval loss), and the folder is named after
that snapshot, so its name always says what it holds and a moving BEST never fails the task.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from diloco_airflow import store
from diloco_airflow.assets import snapshot_id

log = logging.getLogger(__name__)


def _best_id(store_url: str, experiment: str) -> str | None:
    best = store.open_experiment(store_url, experiment).best()
    return snapshot_id(best) if best else None


def export_best(store_url: str, experiment: str, root: str | Path) -> dict:
    """Export `experiment`'s BEST into `root`; returns ``{"experiment", "snapshot", "out",
    "exported"}`` (`exported` False: that snapshot was exported already). Raises RuntimeError
    (one line) when the experiment has no BEST or the export command fails.

    The export is pinned: `diloco export --snapshot best` reads BEST once and records the
    snapshot it exported (export.json's versions and dirs); the folder is named after that
    snapshot, whatever BEST has become since (a moving BEST during a run is the normal case: it
    used to fail the task after three exports in a row). The next Asset event exports the
    newer one."""
    sid = _best_id(store_url, experiment)
    if sid is None:
        raise RuntimeError(f"{experiment}: no snapshots/BEST.json to export")
    out = Path(root) / experiment / f"best-{sid}"
    if (out / "config.json").exists():
        return {"experiment": experiment, "snapshot": sid, "out": str(out), "exported": False}
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    cmd = [sys.executable, "-m", "training.cli", "export", "--store", store_url]
    cmd += ["--experiment", experiment, "--snapshot", "best", "--out", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{experiment}: diloco export failed ({done.returncode}): {tail[0]}")
    # the export's own record (versions, dirs, tokens, eval loss, tokenizer), with the store
    # and the id of the snapshot it holds, which names the folder
    recorded = json.loads((tmp / "export.json").read_text())
    sid = snapshot_id(recorded)
    out = Path(root) / experiment / f"best-{sid}"
    recorded.update(store_url=store_url, experiment=experiment, snapshot=sid)
    (tmp / "export.json").write_text(json.dumps(recorded, indent=1) + "\n")
    exported = not (out / "config.json").exists()
    try:
        if exported:
            tmp.rename(out)
    except OSError:  # another export of the same snapshot finished first
        exported = False
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s: best snapshot %s exported to %s", experiment, sid, out)
    return {"experiment": experiment, "snapshot": sid, "out": str(out), "exported": exported}
