# SPDX-License-Identifier: Apache-2.0
"""Profiling: latency per context length, analytic KV bytes, measured memory, Jetson tegrastats.

Nothing here imports a GPU library at module load; NVML, CUDA and TensorRT are probed lazily.
"""

from __future__ import annotations

from kvexport.cache.memory import CacheShape, cache_table, full_cache_of
from kvexport.profile.memory import PeakRSS, rss_bytes
from kvexport.profile.profiler import environment, percentile, profile_runner, prompt_ids
from kvexport.profile.run import BACKENDS, profile_dir
from kvexport.profile.tegrastats import TegraSample, TegraStatsSampler, is_jetson, parse_line, summarize

__all__ = ["CacheShape", "cache_table", "full_cache_of", "PeakRSS", "rss_bytes", "environment", "percentile",
           "profile_runner", "prompt_ids", "BACKENDS", "profile_dir", "TegraSample", "TegraStatsSampler",
           "is_jetson", "parse_line", "summarize"]
