# SPDX-License-Identifier: Apache-2.0
"""Cache slots on the PyTorch reference path: kvexport's Decoder with one :class:`StaticCache` per slot.

The model is the export's source (``kvexport.export.reference.load_reference_model``: the manifest's model,
checked against its hash), with the export's press, budgets, window, chunk and cache format (what
``kvexport validate`` compares the export with). Each slot is a :class:`~kvexport.runtime.torch_driver.TorchDriver`
that makes a fresh batch-1 cache of the same fixed size for each admitted sequence; decode steps run one slot at a
time (no batching across slots: this backend is the reference, not the fast path).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage
from kvexport.serve.backends.base import SlotBackend


class TorchSlots(SlotBackend):
    """:class:`SlotBackend` on PyTorch for an export directory (``max_sequences`` slots, default 4)."""

    name = "pytorch"

    def __init__(self, export_dir, max_sequences: int | None = None, threads: int | None = None):
        import torch

        from kvexport.export.reference import load_reference_model, reference_kwargs
        from kvexport.export.source import press_from_dict
        from kvexport.manifest import ONNX_EXPORT, verify_manifest
        from kvexport.runtime.torch_driver import TorchDriver

        manifest = verify_manifest(export_dir, ONNX_EXPORT)
        s = self.settings = manifest["settings"]
        if s["mode"] != "static":
            raise BadArtifact(f"{export_dir} is a growing-past (--dynamic-cache) export: serve a static-cache export")
        if max_sequences is not None and int(max_sequences) < 1:
            raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
        if threads:
            torch.set_num_threads(int(threads))
        self.decoder = load_reference_model(manifest, root=Path(export_dir))
        self.press = press_from_dict(s["press"])
        self.evicting = self.press is not None
        self.n_slots = int(max_sequences or 4)
        self.vocab_size = int(s["vocab_size"])
        kw = reference_kwargs(s, self.press)
        self._drivers = [TorchDriver(self.decoder, batch=1, **kw) for _ in range(self.n_slots)]
        probe = TorchDriver(self.decoder, batch=1, **kw)
        probe.start(np.ones((1, 1), np.int64), 1)  # a slot's cache is the same size whatever its prompt
        self._per_slot = probe.resident_bytes()
        self.limit = int(s["max_positions"]) if self.evicting else int(kw["capacity"])

    def driver(self, slot: int):
        return self._drivers[slot]

    def release(self, slot: int) -> None:
        super().release(slot)
        self._drivers[slot].close()  # the next sequence gets a fresh cache of the same size

    def resident_bytes(self) -> dict:
        """Per slot: one batch-1 StaticCache (allocated when a sequence is admitted, always this size)."""
        per = dict(self._per_slot)
        return {"per_slot": per, "slots": self.n_slots, "shared": {"total": 0}, "total": per["total"] * self.n_slots}


__all__ = ["TorchSlots"]
