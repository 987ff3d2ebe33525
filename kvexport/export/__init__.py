# SPDX-License-Identifier: Apache-2.0
"""ONNX export with static caches and kvexport custom ops, an onnxruntime runtime, and parity reports.

``export_model`` writes the graphs (:mod:`kvexport.export.exporter`), ``OrtGenerator`` runs them with
onnxruntime IO binding (:mod:`kvexport.export.runtime`), ``validate`` compares them with the PyTorch
model (:mod:`kvexport.export.validate`). onnxruntime and Polygraphy are imported only when used.
"""

from __future__ import annotations

from kvexport.export.exporter import export_model
from kvexport.export.manifest import atomic_output, read_manifest, verify_manifest, write_manifest
from kvexport.export.runtime import OrtGenerationResult, OrtGenerator
from kvexport.export.validate import validate

__all__ = ["export_model", "OrtGenerator", "OrtGenerationResult", "validate", "atomic_output", "read_manifest",
           "verify_manifest", "write_manifest"]
