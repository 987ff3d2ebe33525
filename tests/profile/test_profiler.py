# SPDX-License-Identifier: Apache-2.0
"""The profiler's bookkeeping on a scripted runner (no timing is asserted), memory probes, profile_dir."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvexport.cache.memory import CacheShape
from kvexport.profile.memory import PeakRSS, lifetime_peak_rss_bytes, rss_bytes
from kvexport.profile.profiler import percentile, profile_runner, prompt_ids


@pytest.fixture(scope="module")
def runner(tiny_models):
    """A real driver as the profiler runs it: the PyTorch path of a tiny Llama, Knorm budget 16, window 4."""
    from kvexport.models.decoder import Decoder
    from kvexport.presses import make_press
    from kvexport.profile.runners import ProfiledDriver
    from kvexport.runtime.torch_driver import TorchDriver

    dec = Decoder.from_hf(tiny_models("llama"))
    shape = CacheShape(dec.spec.num_layers, dec.spec.num_kv_heads, dec.spec.head_dim, None, 0, 16, 4, 4,
                       query_heads=dec.spec.num_heads, query_dim=dec.spec.head_dim, vocab_size=dec.spec.vocab_size)
    return ProfiledDriver(TorchDriver(dec, make_press("knorm", budget=16), window=4, chunk=8), "pytorch", [], shape)


def test_profile_rows(runner):
    out = profile_runner(runner, [8, 32], decode_steps=3, vocab_size=50, repeats=2)
    assert out["backend"] == "pytorch"
    rows = out["contexts"]
    assert [row["context"] for row in rows] == [8, 32]
    for row in rows:
        assert row["decode_steps"] == 3 and row["repeats"] == 2
        assert row["decode_ms_p50"] <= row["decode_ms_p90"]
        assert row["tokens_per_s"] == pytest.approx(1e3 / row["decode_ms_p50"])
        assert row["tokens_per_s_mean"] == pytest.approx(1e3 / row["decode_ms_mean"])
        assert row["ttft_s"] == row["prefill_s"] > 0
        assert row["kv_bytes"] == runner.cache_shape.bytes_at(row["context"] + 3)
        assert row["resident"]["kv"] == row["kv_bytes"]  # the cache as allocated is the formula's
        assert row["peak_rss_bytes"] >= row["rss_start_bytes"] > 0
        assert "tegrastats" not in row or row["tegrastats"]["samples"] >= 0


def test_peak_rss_sees_a_transient_allocation():
    """A 128 MiB buffer, touched and held until the sampler has taken 3 samples, shows in the peak (>= 80 %)."""
    import time

    from kvexport.models.release import free_memory

    free_memory()  # an earlier test's garbage (cycles) collected inside the window would hide the allocation
    n = 128 << 20
    m = PeakRSS(interval_s=0.001)

    def hold():  # keep the buffer alive for >= 3 sampling intervals, however slow the sampler thread is
        first, t0 = m.samples, time.monotonic()
        while m.samples < first + 3 and time.monotonic() - t0 < 10:
            time.sleep(0.001)

    with m:
        buf = np.ones(n, dtype=np.uint8)  # touched pages count in RSS
        hold()
        del buf
        free_memory()  # what the allocator kept of it goes back too (a suite run once saw RSS stay at the peak)
    assert m.samples >= 3
    assert m.delta >= n * 0.8
    assert rss_bytes() < m.peak
    assert lifetime_peak_rss_bytes() >= m.peak * 0.9


def test_percentile_and_prompts():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(float(np.percentile([1, 2, 3, 4], 50)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    a, b = prompt_ids(100, 40, seed=3), prompt_ids(100, 40, seed=3)
    assert a.shape == (1, 100) and (a == b).all() and a.min() >= 3 and a.max() < 40


def test_profile_runner_samples_tegrastats(runner, tmp_path, monkeypatch):
    """With a tegrastats on PATH (a Jetson), every context row carries the parsed summary."""
    import os
    import stat
    from pathlib import Path

    fix = Path(__file__).parent / "fixtures" / "tegrastats_orin_agx.txt"
    script = tmp_path / "tegrastats"
    script.write_text(f'#!/bin/sh\nwhile true; do cat "{fix}"; sleep 0.01; done\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    out = profile_runner(runner, [8], decode_steps=60, vocab_size=50, tegrastats_interval_ms=10, repeats=2)
    teg = out["contexts"][0]["tegrastats"]
    assert teg["samples"] >= 1
    assert teg["ram_total_mb"] == 62841
    assert set(teg["power_mw"]) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"}


def test_profile_dir_pytorch(tmp_path, tiny_hf_dir):
    """profile_dir on a convert-like directory, PyTorch backend: both variants, analytic KV bytes, skips."""
    from kvexport.profile.run import profile_dir

    d = tmp_path / "conv"
    d.mkdir()
    (d / "convert.json").write_text(json.dumps({"settings": {
        "model": str(tiny_hf_dir), "press": "knorm", "budget": 16, "window": 4, "chunk": 16}}))
    prof = profile_dir(d, backend="pytorch", contexts=[32, 64, 100000], decode_steps=3)
    assert json.loads((d / "profile-pytorch.json").read_text())["backend"] == "pytorch"
    assert prof["contexts"] == [32, 64]
    assert prof["skipped_contexts"][0]["context"] == 100000
    conv, base = prof["variants"]["converted"], prof["variants"]["baseline"]
    L, H, D = 2, 2, 16
    per_tok = L * 2 * H * D * 4
    assert [r["kv_bytes"] for r in conv["contexts"]] == [20 * per_tok, 20 * per_tok]
    assert [r["kv_bytes"] for r in base["contexts"]] == [35 * per_tok, 67 * per_tok]
    assert prof["cache"]["contexts"][1]["ratio"] == pytest.approx(64 / 20)
    assert conv["files_bytes"] > 0
