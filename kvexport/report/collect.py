# SPDX-License-Identifier: Apache-2.0
"""Gather what a converted directory holds into one report dictionary (``report.json``).

Reads, all optional except convert.json or profile.json: ``convert.json`` (settings, model, stages),
``parity.json`` (per backend pair), ``profile.json`` (latency, memory, cache accounting) and accuracy
studies (``accuracy*.json``, ``studies/*.json``). Parity files come in a few shapes; they are
normalised to a list of pairs ``{pair, passed, max_abs_logit_error, ...}`` and one verdict.
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
    from kvexport.convert import layout

    layout.verify_conversion(d, layout.REPORT_OUTPUTS)  # a damaged conversion is refused (exit 4, naming the file), never reported on
    convert = read_json(d / "convert.json")
    profile = read_json(d / "profile.json")
    parity = normalize_parity(read_json(d / "parity.json"))
    if convert is None and profile is None and parity is None:
        raise BadArtifact(f"{d} has none of convert.json, profile.json, parity.json: run `kvexport convert` "
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
        "studies": studies,
    }


def _title(convert: Any, d: Path) -> str:
    name = None
    if isinstance(convert, dict):
        name = (convert.get("model") or {}).get("name")
    return f"kvexport report: {name or d.name}"


__all__ = ["collect", "normalize_parity", "read_json"]
