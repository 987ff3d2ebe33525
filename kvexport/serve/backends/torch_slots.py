# SPDX-License-Identifier: Apache-2.0
"""Cache slots on the PyTorch reference path: kvexport's Decoder with one :class:`StaticCache` per slot.

The model is the export's source (``kvexport.export.validation.load_reference_model``: the manifest's model,
checked against its hash), with the export's press, budgets, window and chunk. Each admitted sequence gets a fresh
batch-1 cache of the same fixed size; prefill chunks and decode steps go through ``decoder(ids, positions, cache,
mode=...)`` one slot at a time (no batching across slots: this backend is the reference, not the fast path).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage
from kvexport.serve.backends.base import SlotBackend


class TorchSlots(SlotBackend):
    """:class:`SlotBackend` on PyTorch for an export directory (``max_sequences`` slots, default 4)."""

    name = "pytorch"

    def __init__(self, export_dir, max_sequences: int | None = None, threads: int | None = None):
        import torch

        from kvexport.export.exporter import press_from_dict
        from kvexport.export.manifest import ONNX_EXPORT, verify_manifest
        from kvexport.export.validation import load_reference_model

        manifest = verify_manifest(export_dir, ONNX_EXPORT)
        s = self.settings = manifest["settings"]
        if s["mode"] != "static":
            raise BadArtifact(f"{export_dir} is a growing-past (--dynamic-cache) export: serve a static-cache export")
        if max_sequences is not None and int(max_sequences) < 1:
            raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
        if threads:
            torch.set_num_threads(int(threads))
        self._torch = torch
        self.decoder = load_reference_model(manifest, root=Path(export_dir))
        self.press = press_from_dict(s["press"])
        self.evicting = self.press is not None
        self._shape = ([int(b) for b in (s["budgets"] if self.evicting else s["capacities"])],
                       int(s["window"]) if self.evicting else 0, int(s["chunk"]))
        self.n_slots = int(max_sequences or 4)
        self.vocab_size = int(s["vocab_size"])
        self._per_slot = self._new_cache().resident_bytes()
        self.limit = int(s["max_positions"]) if self.evicting else min(self._shape[0])
        self._caches: list = [None] * self.n_slots
        self._pending: list[deque] = [deque() for _ in range(self.n_slots)]
        self._prompt: list = [None] * self.n_slots
        self._next = [0] * self.n_slots

    def _new_cache(self):
        budgets, window, chunk = self._shape
        return self.decoder.new_cache(1, self.press, budgets, window, chunk)

    def start(self, slot: int, prompt: list[int]) -> int:
        torch = self._torch
        cache = self._new_cache()
        cache.plan.check_fits(len(prompt))
        cache.on_compaction = lambda where, slot=slot: self._compacted(slot, where)
        ids = torch.tensor([prompt], dtype=torch.long)
        self._caches[slot] = cache
        self._prompt[slot] = (ids, torch.arange(ids.shape[1])[None])
        self._pending[slot] = deque(cache.plan.chunks(ids.shape[1]))
        self._next[slot] = ids.shape[1]
        return len(self._pending[slot])

    def prefill_step(self, slot: int) -> np.ndarray | None:
        ids, pos = self._prompt[slot]
        c = self._pending[slot].popleft()
        with self._torch.inference_mode():
            logits = self.decoder(ids[:, c.start:c.stop], pos[:, c.start:c.stop], self._caches[slot], mode="prefill")
        if self._pending[slot]:
            return None
        self._prompt[slot] = None
        return logits[0, -1].float().numpy().copy()

    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        torch = self._torch
        out = np.empty((len(slots), self.vocab_size), np.float32)
        with torch.inference_mode():
            for j, (r, tok) in enumerate(zip(slots, tokens, strict=True)):
                pos = torch.tensor([[self._next[r]]], dtype=torch.long)
                logits = self.decoder(torch.tensor([[tok]], dtype=torch.long), pos, self._caches[r], mode="decode")
                out[j] = logits[0, -1].float().numpy()
                self._next[r] += 1
        return out

    def _compacted(self, slot: int, where: str) -> None:
        if self.on_compaction is not None:
            self.on_compaction(slot, where)

    def release(self, slot: int) -> None:
        self._caches[slot] = None  # the next sequence gets a fresh cache of the same size
        self._prompt[slot] = None
        self._pending[slot].clear()

    def kept_positions(self, slot: int) -> list[np.ndarray]:
        return [p.numpy().copy() for p in self._caches[slot].kept_positions()]

    def resident_bytes(self) -> dict:
        """Per slot: one batch-1 StaticCache (allocated when a sequence is admitted, always this size)."""
        per = dict(self._per_slot)
        return {"per_slot": per, "slots": self.n_slots, "shared": {"total": 0}, "total": per["total"] * self.n_slots}


__all__ = ["TorchSlots"]
