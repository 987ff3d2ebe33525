# SPDX-License-Identifier: Apache-2.0
"""ONNX export with static caches and kvexport custom ops, an onnxruntime runtime, and parity reports.

``export_model`` writes the graphs (:mod:`kvexport.export.exporter`), ``OrtGenerator`` runs them with
onnxruntime IO binding (:mod:`kvexport.runtime.onnxruntime`), ``validate`` compares them with the PyTorch
model (:mod:`kvexport.export.validation`). torch (for exporting), onnxruntime and Polygraphy are imported
only when used, so a deployment that only runs exports does not load torch.
"""

from __future__ import annotations

from kvexport.export.validation import validate
from kvexport.manifest import atomic_output, read_manifest, verify_manifest, write_manifest
from kvexport.runtime import GenerationResult, OrtGenerator, open_onnxruntime


def __getattr__(name):
    if name == "export_model":
        from kvexport.export.exporter import export_model

        return export_model
    raise AttributeError(name)


__all__ = ["export_model", "OrtGenerator", "open_onnxruntime", "GenerationResult", "validate", "atomic_output", "read_manifest",
           "verify_manifest", "write_manifest"]
