# SPDX-License-Identifier: Apache-2.0
"""The accuracy figure of a cell, read from the quality studies' JSON under ``docs/`` when one applies.

A press study (:mod:`kvexport.eval.press_study`) is indexed by prompt length P and compression ratio r; a
static budget B at context C keeps B of C prompt tokens, i.e. r = 1 − B/C. A study figure is shown for a cell
only when the study's P equals the cell's prompt length and one of its ratios lies within 0.05 of r: top-1
agreement with the full cache over the study's future tokens, and its perplexity. Nothing else is
extrapolated; cells without a matching study show "—".
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_studies(docs: Path | None = None) -> list[dict]:
    out = []
    for f in sorted(Path(docs or REPO / "docs").rglob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and isinstance(d.get("results"), dict) and "prompt_len" in d.get("settings", {}):
            d["_file"] = str(f.relative_to(Path(docs or REPO / "docs")))
            out.append(d)
    return out


def lookup(studies: list[dict], press: str | None, budget: int | None, prompt_tokens: int) -> dict | None:
    """{"agreement", "ppl", "ratio", "source"} for a press row at this prompt length, or None."""
    if press is None or budget is None:
        return None
    ratio = max(0.0, 1.0 - budget / prompt_tokens)
    for s in studies:
        if int(s["settings"]["prompt_len"]) != int(prompt_tokens) or press not in s["results"]:
            continue
        by_ratio = s["results"][press]
        best = min(by_ratio, key=lambda r: abs(float(r) - ratio), default=None)
        if best is not None and abs(float(best) - ratio) <= 0.05:
            m = by_ratio[best]
            return {"agreement": m.get("agreement"), "ppl": m.get("ppl"), "ratio": float(best), "source": s["_file"]}
    return None
