# SPDX-License-Identifier: Apache-2.0
"""What the profiler times: a step driver (:mod:`kvexport.runtime.protocol`) run by the one loop
(:func:`kvexport.runtime.loop.generate`: the prompt, then greedy tokens, each step timed).

:class:`ProfiledDriver` has ``generate(ids (1, N), new_tokens)`` (one run), ``files()`` (the model / engine files
it loaded), ``resident_bytes()`` and ``cache_shape`` (:class:`~kvexport.cache.memory.CacheShape`). The drivers: PyTorch
(:class:`~kvexport.runtime.torch_driver.TorchDriver`), onnxruntime (:func:`kvexport.runtime.open_onnxruntime`) and
TensorRT (:class:`kvexport.tensorrt.generator.TrtGenerator`), opened by :mod:`kvexport.profile.run`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.cache.memory import CacheShape
from kvexport.errors import BadArtifact, BadUsage
from kvexport.runtime.loop import generate


class ProfiledDriver:
    """``driver`` as the profiler runs it; ``backend``: its name in the profile; ``files``: what it loaded."""

    def __init__(self, driver, backend: str, files: list[Path] | None = None, cache_shape: CacheShape | None = None,
                 name: str | None = None):
        if int(driver.batch) != 1:
            raise BadArtifact(f"{name or backend} was exported for batch {driver.batch}; the profiler runs batch 1")
        self.driver, self.backend, self._files, self.cache_shape = driver, backend, list(files or []), cache_shape
        self.name = name or backend

    def files(self) -> list[Path]:
        return self._files

    def generate(self, ids: np.ndarray, new_tokens: int):
        """One timed run: the one loop on the driver (a fresh sequence of ``ids`` (1, N), ``new_tokens`` greedy
        tokens, the first from the prompt); a prompt the export refuses is a BadArtifact naming it."""
        try:
            return generate(self.driver, np.asarray(ids, dtype=np.int64), max_new_tokens=new_tokens)
        except BadUsage as e:
            raise BadArtifact(f"{self.name}: {e}") from None

    def resident_bytes(self) -> dict[str, int]:
        """What the driver holds now, read from its allocations."""
        return self.driver.resident_bytes()

    def close(self) -> None:
        self.driver.close()


__all__ = ["ProfiledDriver"]
