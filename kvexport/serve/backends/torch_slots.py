# SPDX-License-Identifier: Apache-2.0
"""Cache slots on the PyTorch path: kvexport's Decoder with one :class:`StaticCache` per slot.

The model is the export's source (``kvexport.export.reference.load_reference_model``: the manifest's model,
checked against its hash), with the export's press, budgets, window, chunk and cache format (what
``kvexport validate`` compares the export with). Each slot is a :class:`~kvexport.runtime.torch_driver.TorchDriver`
that makes a fresh batch-1 cache of the same fixed size for each admitted sequence. The slots that decode at the
same time run one batched forward (:class:`~kvexport.runtime.torch_driver.TorchBatch`, each cache keeping its own
plan: :meth:`kvexport.models.decoder.Decoder.decode_caches`), so the weights are read once per step for all of
them; ``decode="rows"`` steps them one by one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage
from kvexport.serve.backends.base import DECODE_MODES, SlotBackend


class TorchSlots(SlotBackend):
    """:class:`SlotBackend` on PyTorch for an export directory (``max_sequences`` slots, default the export's
    ``decode_batch``, else 4)."""

    name = "pytorch"

    def __init__(self, export_dir, max_sequences: int | None = None, threads: int | None = None,
                 decode: str = "auto"):
        import torch

        from kvexport.export.reference import load_reference_model, reference_kwargs
        from kvexport.export.source import press_from_dict
        from kvexport.manifest import ONNX_EXPORT, verify_manifest
        from kvexport.runtime.torch_driver import TorchBatch, TorchDriver

        manifest = verify_manifest(export_dir, ONNX_EXPORT)
        s = self.settings = manifest["settings"]
        if s["mode"] != "static":
            raise BadArtifact(f"{export_dir} is a growing-past (--dynamic-cache) export: serve a static-cache export")
        if max_sequences is not None and int(max_sequences) < 1:
            raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
        if decode not in DECODE_MODES:
            raise BadUsage(f"--decode {decode!r} is not one of: {', '.join(DECODE_MODES)}")
        self.batched = decode != "rows"
        if threads:
            torch.set_num_threads(int(threads))
        self.decoder = load_reference_model(manifest, root=Path(export_dir))
        self.press = press_from_dict(s["press"])
        self.evicting = self.press is not None
        self.n_slots = int(max_sequences or s.get("decode_batch") or 4)  # as the graph backend's default
        self.vocab_size = int(s["vocab_size"])
        kw = reference_kwargs(s, self.press)
        self._drivers = [TorchDriver(self.decoder, batch=1, **kw) for _ in range(self.n_slots)]
        #: decode together from this many decoding slots ("auto": 2, one row costs what it costs alone)
        self.batch_from = 1 if decode == "batched" else 2
        if self.batched:
            host = TorchBatch(self.decoder, self.batch_from)
            for d in self._drivers:
                d.host = host
        probe = TorchDriver(self.decoder, batch=1, **kw)
        probe.start(np.ones((1, 1), np.int64), 1)  # a slot's cache is the same size whatever its prompt
        self._per_slot = probe.resident_bytes()
        self.limit = int(s["max_positions"]) if self.evicting else int(kw["capacity"])

    def driver(self, slot: int):
        return self._drivers[slot]

    def release(self, slot: int) -> None:
        super().release(slot)
        self._drivers[slot].close()  # the next sequence gets a fresh cache of the same size

    def describe(self) -> str:
        if not self.batched:
            return "decode slot by slot"
        return f"one batched forward for >= {self.batch_from} decoding sequences, else slot by slot"

    def resident_bytes(self) -> dict:
        """Per slot: one batch-1 StaticCache (its buffers a row of the bank made at start; always this size)."""
        per = dict(self._per_slot)
        return {"per_slot": per, "slots": self.n_slots, "shared": {"total": 0}, "total": per["total"] * self.n_slots}


__all__ = ["TorchSlots"]
