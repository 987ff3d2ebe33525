# SPDX-License-Identifier: Apache-2.0
"""Arrays kept on disk until they are read back, one at a time.

Validation keeps the candidate's outputs until the reference (or the original model) has produced its own: every
stored run's logits, prompts x steps x vocabulary floats (validate's parity prompts: 60 MB on a 32k vocabulary,
0.23 GB on Llama-3's 128k; the fidelity windows as much again), held in memory beside the reference model they
would raise the stage's peak by as much. They go to a temporary directory (``tempfile``'s, the user's umask),
removed by :meth:`SpilledArrays.close` or when the object is collected.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np


class SpilledArrays:
    """A list of arrays on disk: ``append`` writes one, indexing and iteration read them back (each a fresh
    array in memory only while the caller holds it)."""

    def __init__(self, prefix: str = "kvexport-"):
        self._dir: tempfile.TemporaryDirectory | None = tempfile.TemporaryDirectory(prefix=prefix)
        self._paths: list[Path] = []

    def append(self, arr) -> int:
        if self._dir is None:
            raise ValueError("this SpilledArrays was closed")
        path = Path(self._dir.name) / f"{len(self._paths)}.npy"
        np.save(path, np.ascontiguousarray(arr))
        self._paths.append(path)
        return len(self._paths) - 1

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.load(self._paths[i])

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self._paths)):
            yield self[i]

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
        self._dir, self._paths = None, []


class StoredRuns:
    """Generation results by key, their logits (``prompt_logits`` (B, V), ``step_logits`` [(B, V)]) on disk and
    the rest (tokens, kept positions, timings) in memory; ``get`` returns a copy with the logits read back."""

    def __init__(self, prefix: str = "kvexport-runs-"):
        self._logits = SpilledArrays(prefix)
        self._runs: dict[Any, tuple[Any, int]] = {}

    def __setitem__(self, key, res) -> None:
        stacked = np.stack([np.asarray(res.prompt_logits)] + [np.asarray(x) for x in res.step_logits], axis=1)
        light = copy.copy(res)
        light.prompt_logits, light.step_logits = None, []
        self._runs[key] = (light, self._logits.append(stacked))

    def get(self, key, default=None):
        hit = self._runs.get(key)
        if hit is None:
            return default
        light, i = hit
        logits = self._logits[i]
        res = copy.copy(light)
        res.prompt_logits = logits[:, 0]
        res.step_logits = [logits[:, k] for k in range(1, logits.shape[1])]
        return res

    def close(self) -> None:
        self._logits.close()
        self._runs.clear()


__all__ = ["SpilledArrays", "StoredRuns"]
