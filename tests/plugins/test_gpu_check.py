# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_check.sh in its dry mode (no GPU here): runs end to end, skips the GPU steps with a message, collects
the GPU tests without polygraphy / TensorRT, and writes the JSON report; plus the report's arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.plugins import test_kernels_gpu as gpu_tests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check would run for real")
def test_dry_mode_runs_end_to_end(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no CUDA GPU visible to torch: dry mode" in r.stdout
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = {s["step"]: s for s in doc["steps"]}
    assert doc["dry_run"] is True and list(steps) == ["imports", "environment", "build", "tests", "benchmark",
                                                      "memcheck", "racecheck", "ncu"]
    assert steps["imports"]["status"] == "ok" and steps["environment"]["status"] == "ok"
    n_rows = sum(1 for _ in gpu_check.latent_grid()) + len(gpu_check.TOPK_SHAPES)
    assert f"{n_rows} benchmark rows planned" in steps["imports"]["detail"]
    n_tests = len(gpu_tests.TOPK_CASES) + len(gpu_tests.LATENT_CASES) + len(gpu_tests.LATENT_V2_CASES) + 2
    assert steps["tests"]["detail"] == f"dry run: {n_tests} GPU kernel tests collected"
    for name in ("build", "benchmark", "memcheck", "racecheck", "ncu"):
        assert steps[name]["status"] == "skipped" and steps[name]["detail"].startswith("dry run:"), steps[name]
    assert "| tests | skipped | dry run:" in r.stdout  # the one table


def test_report_shares_and_targets():
    """The table's share of copy bandwidth and the target lines follow from the measured numbers."""
    copy = 4000.0
    t = gpu_check.TARGET_LATENT
    latent = dict(label="", batch=t["B"], heads=t["H"], rank=t["R"], rope=t["Dr"], context=t["S"], dtype=t["dtype"],
                  us=10.0, must_bytes=31_000_000, achieved_gbs=3100.0, max_abs_err=1e-3, path="mma", splits=66,
                  partial_bytes=34.7e6)
    topk = dict(label="MLA latent rows", batch=1, heads=1, slots=32768, k=8192, key_dim=576, value_dim=0,
                dtype="float16", us=42.0, exact=True)
    bench = dict(meta=dict(copy_gbs=copy), latent=[latent], topk=[topk])
    table = gpu_check.report_table([dict(step="tests", status="ok", detail="115 passed")], bench, "H200")
    assert "| 3100 | 78 % | mma x66, 34.7 MB |" in table
    targets = gpu_check._targets(bench)
    assert targets[0].endswith("78 % of copy bandwidth (target 80 %): NOT met")
    assert targets[1] == "target TopKGather S=32k: 42.0 us (target < 50 us): met"


def test_benchmark_rows_on_the_cpu_library():
    """The benchmark code path (inputs, workspaces, reference checks, row fields) on the CPU build of the kernels,
    with a wall-clock timer: what the one GPU run would execute, minus CUDA events."""
    import time

    from tests.plugins import cpu_kernels
    from tests.plugins.kernels_lib import KernelsLib

    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler for the CPU build")
    lib = KernelsLib(cpu_kernels.build("fast", shared=True))

    def timer(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    latent = gpu_check.bench_latent(torch, lib, timer, grid=[("", 1, 8, 64, 32, 200, "float16"),
                                                            ("", 2, 4, 48, 16, 90, "float32"),
                                                            ("int8", 1, 8, 64, 32, 150, "float16", 1),
                                                            ("fp8", 1, 4, 48, 16, 90, "float32", 2)], device="cpu")
    topk = gpu_check.bench_topk(torch, lib, timer, shapes=[("t", 1, 2, 3000, 500, 8, 0, "float16")], device="cpu")
    assert [r["within_tol"] for r in latent] == [True, None, True, True]  # the reference check runs at batch 1
    assert latent[0]["path"] == "mma" and latent[1]["path"] == "simt" and topk[0]["exact"]
    assert latent[2]["path"] == "mma" and latent[3]["path"] == "simt"  # quantized caches: both paths
    assert latent[2]["must_bytes"] == gpu_check.must_bytes(1, 8, 64, 32, 150, 2, quantized=True)
    assert latent[0]["must_bytes"] == gpu_check.must_bytes(1, 8, 64, 32, 200, 2)
    assert not gpu_check.wrong_results(dict(latent=latent, topk=topk))
