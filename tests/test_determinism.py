"""Issue 28, item 5: the same quick virtual-clock experiment, run in two processes whose
thread and vector settings differ, ends with the same parameters bit for bit.

Run A: XLA and every BLAS/OpenMP pool on one thread, the merge's C loops (-march=native).
Run B: XLA's default thread pools, 2 threads elsewhere, the merge's numpy code instead of the C
loops (DILOCO_NATIVE=0), and numpy's AVX-512 dispatch switched off (NPY_DISABLE_CPU_FEATURES).
What the bits depend on and what they do not: docs/ALGORITHM.md, "What the bits depend on".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json
from tests.helpers import small_config
from training.bench.sim import run_islands
cfg = small_config(
    codec="int4", inner={"H": 3}, outer={"method": "nesterov"}, token_budget=12 * 4 * 32
)
out = run_islands(cfg, eval_dt=1e9, jitter=0.3)
print(json.dumps({"sha": out["params_sha256"], "merges": out["merges"]}))
"""

THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
ONE = {
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    **dict.fromkeys(THREADS, "1"),
}
OTHER = {
    "XLA_FLAGS": "",
    **dict.fromkeys(THREADS, "2"),
    "DILOCO_NATIVE": "0",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL",
}


def _run(settings: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ONE and k not in OTHER}
    env.update(settings, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_processes_with_other_thread_and_simd_settings_end_with_the_same_bits():
    a, b = _run(ONE), _run(OTHER)
    assert a["merges"] >= 3  # 12 steps of 2 islands at H = 3: several merges really happened
    assert a == b
