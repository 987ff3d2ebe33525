# SPDX-License-Identifier: Apache-2.0
"""This machine's memory bandwidth, measured in the same run as the decode timings.

A NumPy copy of a large float32 array (``np.copyto``, 4× larger than any cache level) moves each byte twice
(read + write), like STREAM's "copy"; the figure reported is bytes read + written per second, best of
``repeats``, single-threaded (NumPy's copy is), so it is a lower bound of what two threads could draw.
"""

from __future__ import annotations

import time

import numpy as np


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> dict:
    """Returns {"copy_gbps": best GB/s (1e9 bytes/s, read+write), "all_gbps": [...], "array_mib": mib}."""
    n = mib * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = time.perf_counter() - t0
        rates.append(2 * src.nbytes / dt / 1e9)
    return {"copy_gbps": max(rates), "all_gbps": [round(r, 2) for r in rates], "array_mib": mib}


def decode_bound(weight_bytes: int, cache_bytes: int, step_ms: float, bandwidth_gbps: float) -> dict:
    """Bytes one decode step must read (weights + whole cache) over the step time, against the bandwidth."""
    b = int(weight_bytes) + int(cache_bytes)
    achieved = b / (step_ms / 1e3) / 1e9 if step_ms else None
    return {"bytes_per_step": b, "achieved_gbps": achieved,
            "fraction_of_bandwidth": achieved / bandwidth_gbps if achieved and bandwidth_gbps else None,
            "floor_ms": b / (bandwidth_gbps * 1e9) * 1e3 if bandwidth_gbps else None}
