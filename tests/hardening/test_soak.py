# SPDX-License-Identifier: Apache-2.0
"""Long-run stability of an export through onnxruntime (static budget): finite logits at every step, exactly
``budget`` kept slots after every compaction, kept positions strictly increasing, and the process's memory
flat after warm-up (RSS growth < 2 %, measured in a fresh subprocess). 2 000 steps here, 20 000 marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.hardening.conftest import EXPORT_ARGS


def _soak(export_dir, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "tests.hardening.soak_driver", str(export_dir), str(steps)],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(res: dict, steps: int) -> None:
    budget, window = int(EXPORT_ARGS[3]), int(EXPORT_ARGS[5])
    assert res["problem"] is None, res["problem"]
    assert res["steps"] == steps
    # the 21-token prompt leaves `budget` slots filled; then one compaction every `window` decode steps
    assert res["compactions"] == steps // window
    assert res["last_position"] == 21 + steps - 1
    growth = (res["rss_end"] - res["rss_warm"]) / res["rss_warm"]
    assert growth < 0.02, f"RSS grew {growth:.2%} after warm-up ({res['rss_warm']} -> {res['rss_end']} bytes)"
    assert budget == 16


def test_soak_2000_steps(export_dir):
    _check(_soak(export_dir, 2000), 2000)


@pytest.mark.slow
def test_soak_20000_steps(export_dir):
    _check(_soak(export_dir, 20000), 20000)
