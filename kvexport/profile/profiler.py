# SPDX-License-Identifier: Apache-2.0
"""Latency and memory of one runner across context lengths.

For each context length C: a fresh sequence, a prompt of C token ids (fixed seed), prefill timed
(= time to first token: the prefill's last logits give the first token), then ``decode_steps``
single-token steps each timed, the whole repeated a few times so that the spread between runs is known.
While that runs a thread samples the process RSS (peak), NVML/CUDA
memory is read where a GPU is present, and on a Jetson ``tegrastats`` is sampled too. A short
warm-up run comes first and is not counted (onnxruntime and PyTorch allocate on their first call).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.cache.memory import CacheShape
from kvexport.profile.memory import PeakRSS, gpu_present, nvml_device_memory, torch_cuda_peak, torch_cuda_reset_peak
from kvexport.profile.runners import ProfiledDriver
from kvexport.profile.tegrastats import TegraStatsSampler, is_jetson


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (NumPy's default), ``q`` in [0, 100]."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def prompt_ids(n: int, vocab_size: int, seed: int = 0, low: int = 3) -> np.ndarray:
    """(1, n) int64 token ids drawn uniformly from [low, vocab) with a fixed seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(low, max(low + 1, vocab_size), size=(1, n), dtype=np.int64)


#: timed runs of each context by default; the report shows the spread (p10-p90) over them
DEFAULT_REPEATS = 3


def spread(xs: list[float]) -> dict[str, float]:
    """p10, median and p90 of repeated measurements, and the relative width ``(p90 - p10) / median``."""
    p10, p50, p90 = (percentile(xs, q) for q in (10, 50, 90))
    return {"p10": p10, "p50": p50, "p90": p90, "relative": (p90 - p10) / p50 if p50 > 0 else 0.0}


def profile_runner(runner: ProfiledDriver, contexts: list[int], decode_steps: int, vocab_size: int, seed: int = 0,
                   warmup: bool = True, tegrastats_interval_ms: int = 100, repeats: int = DEFAULT_REPEATS,
                   on_step=None) -> dict[str, Any]:
    """-> ``{"backend", "contexts": [{context, repeats, prefill_s, ttft_s, decode_ms_p50, decode_ms_p90,
    decode_ms_mean, tokens_per_s, spread, kv_bytes, [resident], peak_rss_bytes, rss_start_bytes, rss_delta_bytes,
    [gpu_*], [tegrastats]}, ...]}``.

    Each context runs ``repeats`` times (a fresh sequence each time): ``ttft_s``, ``decode_ms_p50`` and
    ``decode_ms_p90`` are medians over the runs (of each run's TTFT, p50 and p90 step), ``decode_ms_mean`` pools
    every step, and ``spread`` holds p10/p50/p90 over the runs of those three (how much they moved between
    runs; the figure itself is that p50).
    A run is the one loop's :func:`~kvexport.runtime.loop.generate` on ``runner.driver`` (a step driver): TTFT is
    its prefill time, the steps its per-step times (each with its compaction).
    ``resident``: what the driver keeps resident for one sequence (``runner.resident_bytes()``).
    ``on_step(message)``: called before each timed run ("context 2048, run 2/3")."""
    if repeats < 1:
        raise ValueError(f"repeats {repeats} must be >= 1")
    shape: CacheShape | None = getattr(runner, "cache_shape", None)
    if warmup:
        runner.generate(prompt_ids(min(16, min(contexts)), vocab_size, seed + 1), 3)
    jetson = is_jetson()
    gpu = gpu_present()
    rows = []
    for C in contexts:
        ids = prompt_ids(C, vocab_size, seed)
        torch_cuda_reset_peak()
        sampler = TegraStatsSampler(tegrastats_interval_ms) if jetson else None
        if sampler is not None:
            sampler.__enter__()
        ttfts: list[float] = []
        runs: list[list[float]] = []
        try:
            with PeakRSS() as mem:
                for r in range(repeats):
                    if on_step is not None:
                        on_step(f"context {C}, run {r + 1}/{repeats}")
                    res = runner.generate(ids, decode_steps + 1)
                    ttfts.append(res.prefill_seconds)
                    runs.append([s * 1e3 for s in res.decode_seconds])
        finally:
            if sampler is not None:
                sampler.__exit__(None, None, None)
        ms = [x for steps in runs for x in steps]
        ttft = percentile(ttfts, 50)
        p50s, p90s = [percentile(st, 50) for st in runs], [percentile(st, 90) for st in runs]
        p50, p90 = percentile(p50s, 50), percentile(p90s, 50)
        row: dict[str, Any] = {
            "context": int(C),
            "repeats": repeats,
            "prefill_s": ttft,
            "ttft_s": ttft,
            "prefill_tokens_per_s": C / ttft if ttft > 0 else None,
            "decode_steps": decode_steps,
            "decode_ms_p50": p50,
            "decode_ms_p90": p90,
            "decode_ms_mean": float(np.mean(ms)),
            # from the median step: one scheduler hiccup on a shared machine does not move it
            "tokens_per_s": 1e3 / p50 if ms else None,
            "tokens_per_s_mean": 1e3 / float(np.mean(ms)) if ms else None,
            "spread": {"ttft_s": spread(ttfts), "decode_ms_p50": spread(p50s), "decode_ms_p90": spread(p90s)},
            "peak_rss_bytes": mem.peak,
            "rss_start_bytes": mem.start,
            "rss_delta_bytes": mem.delta,
        }
        if shape is not None:
            row["kv_bytes"] = shape.bytes_at(C + decode_steps)
        row["resident"] = {k: int(v) for k, v in dict(runner.resident_bytes()).items()}
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


class MachineLoad:
    """How busy the machine was while a block ran: CPU cores in use by everything, by this process, and by
    the other processes (their difference), plus the load average before and after.

    ``with MachineLoad() as m: work()`` -> ``m.to_dict()``."""

    def __enter__(self) -> "MachineLoad":
        import os

        import psutil

        self._proc = psutil.Process(os.getpid())
        psutil.cpu_percent(interval=None)  # starts the system-wide measurement
        self._own0 = self._cpu_seconds()
        self._t0 = time.perf_counter()
        self.load_start = _loadavg()
        return self

    def _cpu_seconds(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)

    def __exit__(self, *exc) -> None:
        import os

        import psutil

        wall = max(time.perf_counter() - self._t0, 1e-9)
        n = os.cpu_count() or 1
        self.busy_cores = psutil.cpu_percent(interval=None) / 100.0 * n
        self.own_cores = (self._cpu_seconds() - self._own0) / wall
        self.other_cores = max(0.0, self.busy_cores - self.own_cores)
        self.load_end = _loadavg()
        self.cpu_count = n

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_count": self.cpu_count, "busy_cores": round(self.busy_cores, 2),
                "own_cores": round(self.own_cores, 2), "other_cores": round(self.other_cores, 2),
                "load_avg_start": self.load_start, "load_avg_end": self.load_end}


def _loadavg() -> list[float] | None:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()[:120]
    except OSError:
        pass
    return platform.processor() or None


def environment() -> dict[str, Any]:
    """Where the numbers were taken."""
    import os

    env: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                           "cpu_model": _cpu_model(), "python": platform.python_version(),
                           "cpu_count": os.cpu_count(), "jetson": is_jetson()}
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


__all__ = ["profile_runner", "prompt_ids", "percentile", "spread", "environment", "MachineLoad", "DEFAULT_REPEATS"]
