"""The README's walkthrough, run as printed (issue 36: every command a doc shows runs on the
defaults). docs/DATA.md's walkthrough is tests/test_e2e_data_model.py (its experiment.json is
read from the doc); the Airflow deploy block is tests/test_installed.py.

The README's `diloco` block is pasted into bash as a user would, in a fresh directory (its
`$PWD`), with the project's `diloco` console script on PATH (the installed entry point, which
does not put the working directory on `sys.path`): the experiment lines run as they are, the
islands in the background, `diloco merge --follow` until the run ends, then status, eval, list,
history, report and replay. The bench lines run their parsers only (`--help`: each bench is
minutes long and measured in docs/BENCHMARKS.md by its own command); that still imports every
bench module from the console script, which is where `No module named 'tests'` broke them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from training.config.experiment import parse_config
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def readme_block() -> list[str]:
    """The lines of the README's ```sh block under "The `diloco` command", as printed."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## The `diloco` command", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line.strip()]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)  # as a user's shell has it: the installed package only
    return env


def test_the_readme_walkthrough_runs_as_printed(tmp_path):
    lines = readme_block()
    benches = [line for line in lines if line.startswith("diloco bench ")]
    experiment = [line for line in lines if line not in benches]
    assert experiment[0].startswith("diloco init") and len(benches) >= 2
    script = "set -e\n" + "\n".join(experiment) + "\nwait\n"
    run = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    store = ExperimentStore(open_store(f"file://{tmp_path}/runs/store"), "exp1")
    cfg = parse_config(store.read_config())
    assert set(store.done()) == {i.name for i in cfg.islands}
    assert store.stop_reason() == "budget"
    assert (tmp_path / "runs" / "report").is_dir()
    for line in benches:
        words = shlex.split(line.split("  #")[0])[:3]  # diloco bench NAME
        got = subprocess.run(
            [*words, "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True
        )
        assert got.returncode == 0 and "usage:" in got.stdout, (line, got.stderr[-2000:])
