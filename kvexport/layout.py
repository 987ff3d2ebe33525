# SPDX-License-Identifier: Apache-2.0
"""What a ``kvexport convert`` directory holds, and how to read its settings back.

    DIR/convert.json      resolved settings, model facts, stage times (input for --config)
    DIR/onnx/             the exported graphs + manifest.json (``kvexport generate/validate DIR/onnx``)
    DIR/baseline/         the uncompressed baseline export (full cache, growing past), for comparison
    DIR/engine/           TensorRT engines (--target tensorrt)
    DIR/mla/              the MLA model (rewritten, distilled) the export was made from
    DIR/parity.json       validation per backend pair, fidelity against the original model
                          (``kvexport validate DIR`` rewrites it)
    DIR/profile-B.json    latency, memory, cache accounting on backend B (``kvexport profile DIR --backend B``;
                          one file per backend, side by side; an older DIR/profile.json is onnxruntime's)
    DIR/report.html       self-contained report; report.md + plots/*.png; report.json
    DIR/manifest.json     sha256 of the top-level files above (convert.json, parity.json, profile-*.json,
                          report.*, plots/*); the sub-directories carry their own manifests
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
#: --choose's search: what was tried, its numbers, what was chosen (kvexport.convert.choose)
CHOICE_JSON = "choice.json"
#: the layer-wise MLA refit's per-layer results (convert --refit-steps; kvexport.mla.refit)
REFIT_JSON = "refit.json"
#: the profile of a conversion before profiles were kept per backend (read as onnxruntime's)
PROFILE_JSON = "profile.json"
MANIFEST = "manifest.json"


def profile_name(backend: str) -> str:
    """File name of the profile taken on ``backend``: ``profile-onnxruntime.json``, ..."""
    return f"profile-{backend}.json"


def profile_files(d: str | Path) -> dict[str, Path]:
    """{backend: path} of every profile in ``d``; a legacy ``profile.json`` counts as onnxruntime's unless
    ``profile-onnxruntime.json`` exists too."""
    d = Path(d)
    out = {p.name[len("profile-"):-len(".json")]: p for p in sorted(d.glob("profile-*.json")) if p.is_file()}
    if (d / PROFILE_JSON).is_file():
        out.setdefault("onnxruntime", d / PROFILE_JSON)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "onnxruntime", kv[0])))


def _read_json(p: Path) -> Any:
    """The JSON document at ``p``, or None when there is no such file; BadArtifact when it is not valid JSON."""
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArtifact(f"{p} is not valid JSON ({e.__class__.__name__})") from None


def read_convert_json(d: str | Path) -> dict[str, Any] | None:
    p = Path(d) / CONVERT_JSON
    if not p.is_file():
        return None
    data = _read_json(p)
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise BadArtifact(f"{p} is not a kvexport convert.json (no 'settings')")
    return data


def read_manifest(export_dir: str | Path) -> dict[str, Any] | None:
    data = _read_json(Path(export_dir) / MANIFEST)
    return data if isinstance(data, dict) else None


CONVERSION_KIND = "kvexport-conversion"
#: top-level files a conversion lists in DIR/manifest.json (the writers update their own entries)
OUTPUT_FILES = (CONVERT_JSON, PARITY_JSON, CHOICE_JSON, REFIT_JSON, PROFILE_JSON, "report.html", "report.md", "report.json")
#: sub-directories with their own manifest.json, verified by the readers (report, profile)
VERIFIED_SUBDIRS = (ONNX_DIR, BASELINE_DIR, ENGINE_DIR)


def is_conversion(d: str | Path) -> bool:
    return (Path(d) / CONVERT_JSON).is_file()


def record_outputs(d: str | Path) -> Path:
    """Write DIR/manifest.json listing the sha256 of the conversion's top-level outputs present now."""
    from kvexport.atomic import atomic_write_bytes
    from kvexport.manifest import _version, sha256_file

    d = Path(d)
    names = [n for n in OUTPUT_FILES if (d / n).is_file()]
    names += sorted(p.name for p in d.glob("profile-*.json") if p.is_file())
    names += sorted(p.relative_to(d).as_posix() for p in (d / "plots").glob("*.png"))
    doc = {"format": 1, "kind": CONVERSION_KIND, "kvexport_version": _version(),
           "files": {n: sha256_file(d / n) for n in names}}
    path = d / MANIFEST
    atomic_write_bytes(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    return path


def has_outputs_manifest(d: str | Path) -> bool:
    """DIR/manifest.json is a conversion's outputs record (written when ``kvexport convert`` finished)."""
    m = read_manifest(d)
    return m is not None and m.get("kind") == CONVERSION_KIND


REPORT_OUTPUTS = ("report.html", "report.md", "report.json", "plots/")


def write_parity(d: str | Path, parity: dict[str, Any]) -> Path:
    """Write DIR/parity.json (atomically) and, for a finished conversion, its new hash into DIR/manifest.json:
    a re-validation (``kvexport validate DIR``) keeps the directory verifiable."""
    from kvexport.atomic import atomic_write_bytes

    d = Path(d)
    path = d / PARITY_JSON
    atomic_write_bytes(path, (json.dumps(parity, indent=2, default=str) + "\n").encode())
    if has_outputs_manifest(d):
        record_outputs(d)
    return path


def verify_conversion(d: str | Path, rewrites: tuple[str, ...] = ()) -> None:
    """BadArtifact naming the first missing or altered file: the top-level outputs listed in DIR/manifest.json,
    then every sub-directory's own manifest (onnx/, baseline/, engine/). ``rewrites``: outputs the caller is
    about to write again (names, or folder prefixes ending in "/"), not checked."""
    from kvexport.manifest import sha256_file, verify_manifest

    d = Path(d)
    top = read_manifest(d)
    if top is not None and top.get("kind") == CONVERSION_KIND:
        for rel, digest in sorted((top.get("files") or {}).items()):
            if any(rel == r or (r.endswith("/") and rel.startswith(r)) for r in rewrites):
                continue
            if not (d / rel).is_file():
                raise BadArtifact(f"{d} is missing {rel} (listed in {MANIFEST})")
            if sha256_file(d / rel) != digest:
                raise BadArtifact(f"{d}/{rel} was altered (sha256 differs from {MANIFEST})")
    finished = top is not None and top.get("kind") == CONVERSION_KIND
    for sub in VERIFIED_SUBDIRS:  # a finished conversion's onnx/ must carry its manifest; others when they have one
        if (d / sub).is_dir() and ((d / sub / MANIFEST).is_file() or (sub == ONNX_DIR and finished)):
            verify_manifest(d / sub)


def export_dir_of(d: str | Path) -> Path:
    """The exported graphs of ``d``: ``d/onnx`` for a convert directory, ``d`` itself for a plain export."""
    d = Path(d)
    if (d / ONNX_DIR / MANIFEST).is_file() or (d / ONNX_DIR).is_dir():
        return d / ONNX_DIR
    return d


__all__ = ["CONVERT_JSON", "ONNX_DIR", "BASELINE_DIR", "ENGINE_DIR", "MLA_DIR", "PARITY_JSON", "PROFILE_JSON",
           "profile_name", "profile_files", "write_parity",
           "MANIFEST", "CONVERSION_KIND", "OUTPUT_FILES", "CHOICE_JSON", "REFIT_JSON", "read_convert_json", "is_conversion", "record_outputs",
           "verify_conversion", "has_outputs_manifest", "REPORT_OUTPUTS", "read_manifest", "export_dir_of"]
