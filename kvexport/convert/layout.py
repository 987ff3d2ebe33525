# SPDX-License-Identifier: Apache-2.0
"""What a ``kvexport convert`` directory holds, and how to read its settings back.

    DIR/convert.json      resolved settings, model facts, stage times (input for --config)
    DIR/onnx/             the exported graphs + manifest.json (``kvexport generate/validate DIR/onnx``)
    DIR/baseline/         the uncompressed baseline export (full cache, growing past), for comparison
    DIR/engine/           TensorRT engines (--target tensorrt)
    DIR/mla/              the MLA model (rewritten, distilled) the export was made from
    DIR/parity.json       validation per backend pair (copied from onnx/parity.json)
    DIR/profile.json      latency, memory, cache accounting (``kvexport profile DIR``)
    DIR/report.html       self-contained report; report.md + plots/*.png; report.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvexport.errors import BadArtifact

CONVERT_JSON = "convert.json"
ONNX_DIR = "onnx"
BASELINE_DIR = "baseline"
ENGINE_DIR = "engine"
MLA_DIR = "mla"
PARITY_JSON = "parity.json"
PROFILE_JSON = "profile.json"
MANIFEST = "manifest.json"


def read_convert_json(d: str | Path) -> dict[str, Any] | None:
    p = Path(d) / CONVERT_JSON
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArtifact(f"{p} is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise BadArtifact(f"{p} is not a kvexport convert.json (no 'settings')")
    return data


def read_manifest(export_dir: str | Path) -> dict[str, Any] | None:
    p = Path(export_dir) / MANIFEST
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArtifact(f"{p} is not valid JSON ({e.__class__.__name__})") from None
    return data if isinstance(data, dict) else None


def export_dir_of(d: str | Path) -> Path:
    """The exported graphs of ``d``: ``d/onnx`` for a convert directory, ``d`` itself for a plain export."""
    d = Path(d)
    if (d / ONNX_DIR / MANIFEST).is_file() or (d / ONNX_DIR).is_dir():
        return d / ONNX_DIR
    return d


__all__ = ["CONVERT_JSON", "ONNX_DIR", "BASELINE_DIR", "ENGINE_DIR", "MLA_DIR", "PARITY_JSON", "PROFILE_JSON",
           "MANIFEST", "read_convert_json", "read_manifest", "export_dir_of"]
