# SPDX-License-Identifier: Apache-2.0
"""Gather what a converted directory holds into one report dictionary (``report.json``).

Reads, all optional but one of the first three: ``convert.json`` (settings, model, stages),
``parity.json`` (per backend pair, and what compression cost against the original model),
``profile-<backend>.json`` (latency, memory, cache accounting; one per backend, a legacy ``profile.json``
is onnxruntime's) and accuracy studies (``accuracy*.json``, ``studies/*.json``); and the size of every
artifact on disk with what makes it that size. Parity files come in a few shapes; they are normalised
to a list of pairs ``{pair, passed, max_abs_logit_error, ...}`` and one verdict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvexport.errors import BadArtifact

PARITY_FIELDS = ("max_abs_logit_error", "max_rel_logit_error", "token_agreement", "index_agreement", "steps")


def read_json(path: Path) -> Any | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArtifact(f"{path} is not valid JSON ({e.__class__.__name__}); rerun the stage that writes it") from None


def normalize_parity(parity: Any) -> dict[str, Any] | None:
    """parity.json in any of: ``{"pairs": [..]}``, ``{"pairs": {name: {..}}}``, ``{name: {.., "passed"}}``
    -> ``{"passed": bool, "pairs": [{"pair": name, "passed": bool, ...}], "tolerances": {...}}``."""
    if parity is None:
        return None
    if not isinstance(parity, dict):
        raise BadArtifact("parity.json is not a JSON object")
    raw = parity.get("pairs", None)
    pairs: list[dict[str, Any]] = []
    if isinstance(raw, list):
        for i, p in enumerate(raw):
            if isinstance(p, dict):
                name = p.get("pair") or p.get("name") or "-".join(str(x) for x in p.get("backends", [])) or f"pair{i}"
                pairs.append({**p, "pair": str(name)})
    else:
        src = raw if isinstance(raw, dict) else parity
        for name, p in src.items():
            if isinstance(p, dict) and ("passed" in p or "max_abs_logit_error" in p):
                pairs.append({**p, "pair": str(p.get("pair", name))})
    for p in pairs:
        if "passed" not in p:
            p["passed"] = None
    verdict = parity.get("passed")
    if verdict is None:
        verdict = bool(pairs) and all(p.get("passed") is True for p in pairs)
    tol = parity.get("tolerances") or next((p.get("tolerances") for p in pairs if p.get("tolerances")), None)
    return {"passed": bool(verdict), "pairs": pairs, "tolerances": tol, "raw": parity}


def collect(out_dir: str | Path) -> dict[str, Any]:
    """-> the report dictionary of ``out_dir``; :class:`BadArtifact` when it holds nothing to report."""
    d = Path(out_dir)
    if not d.is_dir():
        raise BadArtifact(f"{d} is not a directory made by kvexport convert")
    from kvexport import layout

    layout.verify_conversion(d, layout.REPORT_OUTPUTS)  # a damaged conversion is refused (exit 4, naming the file), never reported on
    convert = read_json(d / "convert.json")
    profiles = {b: read_json(p) for b, p in layout.profile_files(d).items()}
    profile = next(iter(profiles.values()), None)  # onnxruntime's when there is one (plots, cache accounting)
    parity = normalize_parity(read_json(d / "parity.json"))
    if convert is None and profile is None and parity is None:
        raise BadArtifact(f"{d} has none of convert.json, profile-*.json, parity.json: run `kvexport convert` "
                          "or `kvexport profile` first")
    studies = {}
    for f in sorted(list(d.glob("accuracy*.json")) + list((d / "studies").glob("*.json"))):
        data = read_json(f)
        if data is not None:
            studies[f.stem] = data
    return {
        "title": _title(convert, d),
        "dir": str(d.resolve()),
        "convert": convert,
        "parity": parity,
        "profile": profile,
        "profiles": profiles,
        "studies": studies,
        "artifacts": artifacts(d, convert),
        # a lossy cache against its fp32 twin (kvexport.export.twin), when validate measured it
        "twin": (parity or {}).get("raw", {}).get("twin") if parity else None,
    }


#: what each part of a conversion is for (the report's disk table)
WHY = {
    "onnx": "the exported graphs (prefill, decode, compact) and the tokenizer: what a deployment needs",
    "baseline": "the original model exported with a growing cache, only to compare against (drop it with "
                "--no-baseline)",
    "mla": "the rewritten MLA model in PyTorch form: the reference of `kvexport validate` and of the PyTorch "
           "profile; not needed to deploy",
    "engine": "TensorRT engines, one per graph, for this GPU and TensorRT version only",
    "plots": "the report's figures",
}


def artifacts(d: Path, convert: Any) -> list[dict[str, Any]]:
    """Size on disk of each sub-directory and the top-level files, with why (graph weights stored once per
    graph are named as such)."""
    out = []
    params = ((convert or {}).get("model") or {}).get("parameters") if isinstance(convert, dict) else None
    fp16 = bool(((convert or {}).get("settings") or {}).get("fp16")) if isinstance(convert, dict) else False
    weight_bytes = params * (2 if fp16 else 4) if params else None
    for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = [f for f in sub.rglob("*") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        why = WHY.get(sub.name, "")
        data = sorted((f for f in files if f.name.endswith(".data") or f.suffix in (".safetensors", ".engine")),
                      key=lambda f: (-f.stat().st_size, f.name))
        big = [f for f in data if f.stat().st_size > 0.05 * max(size, 1)]
        if big:
            what = ", ".join(f"{f.relative_to(sub).as_posix()} {_mib(f.stat().st_size)}" for f in big)
            copies = [f for f in big if weight_bytes and abs(f.stat().st_size - weight_bytes) < 0.15 * weight_bytes]
            if len(copies) > 1:
                what += f" (each a full copy of the {_mib(weight_bytes)} of weights: one per graph)"
            elif len(copies) == 1:
                what += f" (the {_mib(weight_bytes)} of weights)"
            why = f"{why}; largest: {what}" if why else f"largest: {what}"
        out.append({"path": sub.name + "/", "bytes": size, "why": why or "-"})
    top = [p for p in d.iterdir() if p.is_file()]
    if top:
        out.append({"path": "top-level files", "bytes": sum(p.stat().st_size for p in top),
                    "why": "settings, parity, profiles, this report (" + ", ".join(sorted(p.name for p in top)[:8])
                           + (", ..." if len(top) > 8 else "") + ")"})
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _title(convert: Any, d: Path) -> str:
    name = None
    if isinstance(convert, dict):
        name = (convert.get("model") or {}).get("name")
    return f"kvexport report: {name or d.name}"


__all__ = ["collect", "normalize_parity", "read_json"]
