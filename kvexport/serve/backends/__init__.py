# SPDX-License-Identifier: Apache-2.0
"""Slot backends: onnxruntime / TensorRT graphs (:mod:`.graphs`) and the PyTorch reference (:mod:`.torch_slots`),
imported when opened (each pulls its own runtime)."""

from kvexport.serve.backends.base import SlotBackend

__all__ = ["SlotBackend"]
