# SPDX-License-Identifier: Apache-2.0
"""Latency and memory of one runner across context lengths.

For each context length C: a fresh sequence, a prompt of C token ids (fixed seed), prefill timed
(= time to first token: the prefill's last logits give the first token), then ``decode_steps``
single-token steps each timed. While that runs a thread samples the process RSS (peak), NVML/CUDA
memory is read where a GPU is present, and on a Jetson ``tegrastats`` is sampled too. A short
warm-up run comes first and is not counted (onnxruntime and PyTorch allocate on their first call).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.profile.kv_bytes import CacheShape
from kvexport.profile.memory import PeakRSS, gpu_present, nvml_device_memory, torch_cuda_peak, torch_cuda_reset_peak
from kvexport.profile.tegrastats import TegraStatsSampler, is_jetson


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (NumPy's default), ``q`` in [0, 100]."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def prompt_ids(n: int, vocab_size: int, seed: int = 0, low: int = 3) -> np.ndarray:
    """(1, n) int64 token ids drawn uniformly from [low, vocab) with a fixed seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(low, max(low + 1, vocab_size), size=(1, n), dtype=np.int64)


def profile_runner(runner, contexts: list[int], decode_steps: int, vocab_size: int, seed: int = 0,
                   warmup: bool = True, tegrastats_interval_ms: int = 100) -> dict[str, Any]:
    """-> ``{"backend", "contexts": [{context, prefill_s, ttft_s, decode_ms_p50, decode_ms_p90, decode_ms_mean,
    tokens_per_s, kv_bytes, peak_rss_bytes, rss_start_bytes, rss_delta_bytes, [gpu_*], [tegrastats]}, ...]}``."""
    shape: CacheShape | None = getattr(runner, "cache_shape", None)
    if warmup:
        runner.start(16 + 2)
        tok = runner.prefill(prompt_ids(min(16, min(contexts)), vocab_size, seed + 1))
        for _ in range(2):
            tok = runner.decode(tok)
    jetson = is_jetson()
    gpu = gpu_present()
    rows = []
    for C in contexts:
        ids = prompt_ids(C, vocab_size, seed)
        torch_cuda_reset_peak()
        sampler = TegraStatsSampler(tegrastats_interval_ms) if jetson else None
        if sampler is not None:
            sampler.__enter__()
        try:
            with PeakRSS() as mem:
                runner.start(C + decode_steps)
                t0 = time.perf_counter()
                tok = runner.prefill(ids)
                ttft = time.perf_counter() - t0
                steps = []
                for _ in range(decode_steps):
                    t1 = time.perf_counter()
                    tok = runner.decode(tok)
                    steps.append(time.perf_counter() - t1)
        finally:
            if sampler is not None:
                sampler.__exit__(None, None, None)
        ms = [s * 1e3 for s in steps]
        row: dict[str, Any] = {
            "context": int(C),
            "prefill_s": ttft,
            "ttft_s": ttft,
            "prefill_tokens_per_s": C / ttft if ttft > 0 else None,
            "decode_steps": decode_steps,
            "decode_ms_p50": percentile(ms, 50),
            "decode_ms_p90": percentile(ms, 90),
            "decode_ms_mean": float(np.mean(ms)),
            # from the median step: one scheduler hiccup on a shared machine does not move it
            "tokens_per_s": 1e3 / percentile(ms, 50) if ms else None,
            "tokens_per_s_mean": 1e3 / float(np.mean(ms)) if ms else None,
            "peak_rss_bytes": mem.peak,
            "rss_start_bytes": mem.start,
            "rss_delta_bytes": mem.delta,
        }
        if shape is not None:
            row["kv_bytes"] = shape.bytes_at(C + decode_steps)
        if gpu:
            dev = nvml_device_memory()
            if dev is not None:
                row["gpu_memory_used_bytes"] = dev["used"]
            peak = torch_cuda_peak()
            if peak is not None:
                row["torch_cuda_peak_bytes"] = peak
            eng_mem = getattr(runner, "device_memory_bytes", None)
            if eng_mem is not None:
                row["engine_device_memory_bytes"] = int(eng_mem)
        if sampler is not None:
            row["tegrastats"] = sampler.summary()
        rows.append(row)
    files = {}
    for f in runner.files():
        try:
            files[str(f)] = Path(f).stat().st_size
        except OSError:
            continue
    return {
        "backend": runner.backend,
        "cache": shape.to_dict() if shape is not None else None,
        "files": files,
        "files_bytes": sum(files.values()),
        "contexts": rows,
    }


def environment() -> dict[str, Any]:
    """Where the numbers were taken."""
    import os

    env: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                           "python": platform.python_version(), "cpu_count": os.cpu_count(),
                           "jetson": is_jetson()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    try:
        import onnxruntime

        env["onnxruntime"] = onnxruntime.__version__
    except Exception:  # noqa: BLE001
        pass
    if Path("/etc/nv_tegra_release").exists():
        env["nv_tegra_release"] = Path("/etc/nv_tegra_release").read_text(errors="replace").splitlines()[0][:200]
    return env


__all__ = ["profile_runner", "prompt_ids", "percentile", "environment"]
