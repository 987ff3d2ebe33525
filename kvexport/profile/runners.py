# SPDX-License-Identifier: Apache-2.0
"""What the profiler times: a runner feeds a prompt and then one token at a time to one backend.

A runner has ``start()`` (a fresh sequence, caches emptied), ``prefill(ids (1, N) int64) -> next token``
and ``decode(token) -> next token`` (greedy), ``files()`` (the model/engine files it loaded) and
``cache_shape`` (:class:`~kvexport.profile.kv_bytes.CacheShape`). Backends:

- ``pytorch``: kvexport's Decoder with the static cache (or a full cache for the baseline).
- ``onnxruntime``: the exported graphs through :class:`kvexport.export.OrtGenerator` (lazy import).
- ``tensorrt``: the engines through kvexport.tensorrt (lazy import; MissingBackend without it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.profile.kv_bytes import CacheShape


class PyTorchRunner:
    """kvexport's reference path: ``Decoder`` + ``StaticCache`` (press) or a growing full cache.

    decoder: a kvexport Decoder (GQA or MLA attention); press None = full cache sized for
    ``max_tokens``; chunk: prefill chunk length (None = one shot).
    """

    backend = "pytorch"

    def __init__(self, decoder, press=None, budget: int | None = None, window: int = 32, chunk: int | None = 512,
                 max_tokens: int = 8192, files: list[Path] | None = None, cache_shape: CacheShape | None = None):
        self.decoder, self.press, self.budget, self.window, self.chunk = decoder, press, budget, window, chunk
        self.max_tokens = int(max_tokens)
        self._files = list(files or [])
        self.cache_shape = cache_shape
        self.cache = None
        self.next_pos = 0

    def files(self) -> list[Path]:
        return self._files

    def start(self, total_tokens: int | None = None) -> None:
        L = self.decoder.spec.num_layers
        if self.press is None:
            budgets = [int(total_tokens or self.max_tokens)] * L
            window = 1
        else:
            budgets = self.press.layer_budgets(L, int(self.budget or 0) or int(total_tokens or self.max_tokens))
            window = self.window
        self.cache = self.decoder.new_cache(1, self.press, budgets, window)
        self.next_pos = 0

    def prefill(self, ids: np.ndarray) -> int:
        import torch

        from kvexport.generation import prefill

        t = torch.as_tensor(ids, dtype=torch.long)
        pos = torch.arange(t.shape[1], dtype=torch.long)[None]
        with torch.no_grad():
            logits = prefill(self.decoder, self.cache, t, pos, self.chunk)
        self.next_pos = t.shape[1]
        return int(logits[0, -1].argmax())

    def resident_bytes(self) -> dict[str, int]:
        """What the PyTorch cache holds now, by kind (:meth:`kvexport.cache.static_cache.StaticCache.resident_bytes`)."""
        return self.cache.resident_bytes() if self.cache is not None else {"total": 0}

    def decode(self, token: int) -> int:
        import torch

        with torch.no_grad():
            logits = self.decoder(torch.tensor([[token]]), torch.tensor([[self.next_pos]]), self.cache, mode="decode")
        self.next_pos += 1
        return int(logits[0, -1].argmax())


class OrtRunner:
    """Exported graphs on onnxruntime, one step at a time, through the step API of
    :class:`kvexport.export.OrtGenerator` (``prefill`` / ``decode``: chunked prefill with the last chunk padded,
    decode at slot ``fill``, host-triggered compaction; the growing-past baseline takes the prompt in chunks of
    the export's ``chunk`` too, so both variants prefill the same way)."""

    backend = "onnxruntime"

    def __init__(self, export_dir: Path, cache_shape: CacheShape | None = None, providers: list[str] | None = None):
        try:
            from kvexport.export import OrtGenerator
        except ImportError as e:  # the export package is missing from this install
            raise MissingBackend(f"the onnxruntime runner needs kvexport.export ({e})") from None
        self.dir = Path(export_dir)
        self.gen = OrtGenerator(self.dir, providers=providers)
        self.cache_shape = cache_shape
        self.total_tokens: int | None = None
        if int(self.gen.batch) != 1:
            raise BadArtifact(f"{self.dir} was exported for batch {self.gen.batch}; the profiler runs batch 1")

    def files(self) -> list[Path]:
        return sorted(p for p in self.dir.rglob("*") if p.is_file() and (p.suffix == ".onnx" or p.name.endswith(".data")))

    def start(self, total_tokens: int | None = None) -> None:
        self.total_tokens = total_tokens  # the sequence's length: a bucketed cache takes its bucket at prefill
        self.gen.reset()

    def prefill(self, ids: np.ndarray) -> int:
        ids = np.asarray(ids, dtype=np.int64)
        try:
            logits = self.gen.prefill(ids, np.ones_like(ids), reserve=self.total_tokens)
        except BadUsage as e:
            raise BadArtifact(f"{self.dir}: {e}") from None
        return int(logits.argmax(-1)[0])

    def decode(self, token: int) -> int:
        return int(self.gen.decode(np.array([int(token)], np.int64)).argmax(-1)[0])

    def resident_bytes(self) -> dict[str, int]:
        """What the generator holds now, read from its allocations (:meth:`OrtGenerator.resident_bytes`)."""
        return self.gen.resident_bytes()


class TensorRTRunner(OrtRunner):
    """Engines built by ``kvexport build-engine`` through :class:`kvexport.tensorrt.generator.TrtGenerator`'s
    step API (same host rules as onnxruntime). ``export_dir``: the export; ``engines``: default
    ``EXPORT_DIR-tensorrt``. MissingBackend (one line) without TensorRT or a GPU."""

    backend = "tensorrt"

    def __init__(self, export_dir: Path, cache_shape: CacheShape | None = None, engines: Path | None = None,
                 runner_factory=None):
        from kvexport.tensorrt.generator import TrtGenerator

        self.dir = Path(export_dir)
        self.gen = TrtGenerator(self.dir, engines=engines, runner_factory=runner_factory)
        self.cache_shape = cache_shape
        self.total_tokens: int | None = None
        if int(self.gen.batch) != 1:
            raise BadArtifact(f"{self.dir} was exported for batch {self.gen.batch}; the profiler runs batch 1")

    def files(self) -> list[Path]:
        eng = self.gen.engine_dir
        return sorted(p for p in eng.rglob("*") if p.is_file() and p.suffix in (".engine", ".plan"))


__all__ = ["PyTorchRunner", "OrtRunner", "TensorRTRunner"]
