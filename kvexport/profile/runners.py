# SPDX-License-Identifier: Apache-2.0
"""What the profiler times: a step driver (:mod:`kvexport.runtime.protocol`) fed a prompt and then one greedy token
at a time through the one loop's :class:`~kvexport.runtime.loop.Stream`.

:class:`ProfiledDriver` has ``start(total_tokens)`` (a fresh sequence of that length is coming), ``prefill(ids (1, N)
int64) -> next token``, ``decode(token) -> next token``, ``files()`` (the model / engine files it loaded),
``resident_bytes()`` and ``cache_shape`` (:class:`~kvexport.cache.memory.CacheShape`). The drivers: PyTorch
(:class:`~kvexport.runtime.torch_driver.TorchDriver`), onnxruntime (:func:`kvexport.runtime.open_onnxruntime`) and
TensorRT (:class:`kvexport.tensorrt.generator.TrtGenerator`), opened by :mod:`kvexport.profile.run`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.cache.memory import CacheShape
from kvexport.errors import BadArtifact, BadUsage
from kvexport.runtime.loop import Stream, greedy


class ProfiledDriver:
    """``driver`` as the profiler runs it; ``backend``: its name in the profile; ``files``: what it loaded."""

    def __init__(self, driver, backend: str, files: list[Path] | None = None, cache_shape: CacheShape | None = None,
                 name: str | None = None):
        if int(driver.batch) != 1:
            raise BadArtifact(f"{name or backend} was exported for batch {driver.batch}; the profiler runs batch 1")
        self.driver, self.backend, self._files, self.cache_shape = driver, backend, list(files or []), cache_shape
        self.name = name or backend
        self.stream: Stream | None = None
        self.total: int | None = None

    def files(self) -> list[Path]:
        return self._files

    def start(self, total_tokens: int | None = None) -> None:
        """A fresh sequence of ``total_tokens`` tokens (prompt + decoded) is next: a full cache is sized for it."""
        self.total = total_tokens
        self.stream = None

    def prefill(self, ids: np.ndarray) -> int:
        ids = np.asarray(ids, dtype=np.int64)
        new = None if self.total is None else max(1, int(self.total) - ids.shape[1] + 1)
        try:
            self.stream = Stream(self.driver, ids, new_tokens=new)
            logits = self.stream.prefill()
        except BadUsage as e:
            raise BadArtifact(f"{self.name}: {e}") from None
        return int(greedy(logits)[0])

    def decode(self, token: int) -> int:
        return int(greedy(self.stream.decode(np.array([int(token)], np.int64)))[0])

    def resident_bytes(self) -> dict[str, int]:
        """What the driver holds now, read from its allocations."""
        return self.driver.resident_bytes()

    def close(self) -> None:
        self.driver.close()


__all__ = ["ProfiledDriver"]
