# SPDX-License-Identifier: Apache-2.0
"""Memory probes: process peak RSS (sampling thread), and GPU memory where a GPU is present.

Every GPU probe is imported lazily and returns None when its library or a device is missing, so
this module works on a CPU-only machine without NVML, CUDA or TensorRT.
"""

from __future__ import annotations

import os
import threading
from typing import Any


def rss_bytes() -> int:
    """Resident set size of this process now."""
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def lifetime_peak_rss_bytes() -> int:
    """High-water mark of this process's RSS since it started (``getrusage``; Linux reports KiB)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PeakRSS:
    """Samples RSS every ``interval_s`` in a thread; ``peak`` is the largest seen inside the block.

    ``with PeakRSS() as m: work()`` -> ``m.start``, ``m.peak`` (bytes), ``m.delta = peak - start``.
    The block's start and end are sampled too, so a block shorter than the interval still counts.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = float(interval_s)
        self.start = 0
        self.peak = 0
        self.samples = 0  # samples taken by the thread so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def delta(self) -> int:
        return self.peak - self.start


def nvml_device_memory(index: int = 0) -> dict[str, int] | None:
    """Used/total bytes of GPU ``index`` from NVML (``nvidia-ml-py``), or None."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(h)
            return {"used": int(info.used), "total": int(info.total)}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no driver, no device
        return None


def torch_cuda_peak() -> int | None:
    """Peak bytes allocated by PyTorch on the current CUDA device, or None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001
        return None


def torch_cuda_reset_peak() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    except Exception:  # noqa: BLE001
        pass


def trt_engine_device_memory(engine: Any) -> int | None:
    """Activation memory a TensorRT engine needs (``device_memory_size_v2`` on 10.x), or None."""
    for attr in ("device_memory_size_v2", "device_memory_size"):
        v = getattr(engine, attr, None)
        if v is not None:
            try:
                return int(v)
            except (TypeError, ValueError):
                return None
    return None


def gpu_present() -> bool:
    """True when NVML or PyTorch sees an NVIDIA GPU."""
    if nvml_device_memory() is not None:
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


__all__ = ["rss_bytes", "lifetime_peak_rss_bytes", "PeakRSS", "nvml_device_memory", "torch_cuda_peak",
           "torch_cuda_reset_peak", "trt_engine_device_memory", "gpu_present"]
