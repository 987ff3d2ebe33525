# SPDX-License-Identifier: Apache-2.0
"""The quality verdict: has a conversion kept the model, beside the parity verdict that says whether the export
computes what the compressed model computes.

Read from the fidelity block of parity.json (:mod:`kvexport.export.fidelity`: the converted model against the
original on held-out text and recall probes). Three levels, the thresholds stated in :data:`THRESHOLDS`:

- ``LOST``: next-token agreement below 80 %, or perplexity up more than 25 %, or a recall task the original solves
  (accuracy >= 0.5) on which the conversion keeps less than half of the original's accuracy;
- ``DEGRADED``: not lost, but agreement below 90 %, perplexity up more than 10 %, or a solved recall task below
  90 % of the original's accuracy (the targets convert's defaults are chosen to meet, docs/realsize.md);
- ``KEPT``: none of these.

A recall task the original itself fails (accuracy below 0.5) says nothing about the conversion: it is listed as
uninformative and does not count. Without the measures (no original model, fidelity off) the verdict is
``UNMEASURED``. The gates of ``--min-agreement`` / ``--max-ppl-increase`` are separate: they fail the run; the
verdict only says, in words a newcomer cannot miss, what the numbers mean.
"""

from __future__ import annotations

from typing import Any

#: (lost below / above, degraded below / above) per measure; recall as a fraction of the original's accuracy
THRESHOLDS = {
    "agreement": {"lost": 0.80, "degraded": 0.90},
    "ppl_increase": {"lost": 0.25, "degraded": 0.10},
    "recall_kept": {"lost": 0.50, "degraded": 0.90},
    "recall_solved": 0.50,  # an original accuracy below this makes the task uninformative
}
LEVELS = ("KEPT", "DEGRADED", "LOST", "UNMEASURED")


def quality_verdict(fid: dict[str, Any] | None) -> dict[str, Any]:
    """-> {"level", "reasons": [plain-words lines], "uninformative": [task names], "thresholds"}."""
    out: dict[str, Any] = {"level": "UNMEASURED", "reasons": [], "uninformative": [], "thresholds": THRESHOLDS}
    if not isinstance(fid, dict) or fid.get("skipped") or fid.get("next_token_agreement") is None:
        why = fid.get("skipped") if isinstance(fid, dict) else None
        out["reasons"] = [f"not measured ({why})" if why else "not measured"]
        return out
    lost: list[str] = []
    degraded: list[str] = []
    t = THRESHOLDS
    a = float(fid["next_token_agreement"])
    if a < t["agreement"]["lost"]:
        lost.append(f"next-token agreement {a:.1%} < {t['agreement']['lost']:.0%}")
    elif a < t["agreement"]["degraded"]:
        degraded.append(f"next-token agreement {a:.1%} < {t['agreement']['degraded']:.0%}")
    p = fid.get("ppl_increase")
    if p is not None:
        p = float(p)
        if p > t["ppl_increase"]["lost"]:
            lost.append(f"perplexity +{p:.1%} > +{t['ppl_increase']['lost']:.0%}")
        elif p > t["ppl_increase"]["degraded"]:
            degraded.append(f"perplexity +{p:.1%} > +{t['ppl_increase']['degraded']:.0%}")
    for name, r in (fid.get("recall") or {}).items():
        if not isinstance(r, dict) or r.get("original") is None or r.get("converted") is None:
            continue
        o, c = float(r["original"]), float(r["converted"])
        label = name.replace("_", " ")
        if o < t["recall_solved"]:
            out["uninformative"].append(name)
            continue
        kept = c / o
        if kept < t["recall_kept"]["lost"]:
            lost.append(f"{label} {o:.2f} -> {c:.2f}: the original solves it, the conversion does not")
        elif kept < t["recall_kept"]["degraded"]:
            degraded.append(f"{label} {o:.2f} -> {c:.2f} (< {t['recall_kept']['degraded']:.0%} of the original's)")
    out["level"] = "LOST" if lost else "DEGRADED" if degraded else "KEPT"
    out["reasons"] = lost + degraded
    return out


def quality_line(fid: dict[str, Any] | None) -> str:
    """The verdict in one line, e.g. ``quality LOST: passkey 1.00 -> 0.00: the original solves it, ...``."""
    v = fid.get("quality") if isinstance(fid, dict) and isinstance(fid.get("quality"), dict) else quality_verdict(fid)
    head = {"KEPT": "quality KEPT: the conversion stays close to the original model",
            "DEGRADED": "quality DEGRADED: the conversion drifts from the original model",
            "LOST": "quality LOST: this conversion no longer behaves like the original model",
            "UNMEASURED": "quality UNMEASURED"}[v["level"]]
    parts = list(v["reasons"]) if v["level"] != "KEPT" else []
    if v["uninformative"]:
        parts.append(", ".join(n.replace("_", " ") for n in v["uninformative"])
                     + " uninformative (the original fails it too)")
    return head + (" (" + "; ".join(parts) + ")" if parts else "")


def quality_markup(fid: dict[str, Any] | None) -> str:
    """:func:`quality_line` in rich markup for a terminal: bold red when LOST, yellow when DEGRADED."""
    from rich.markup import escape

    v = fid.get("quality") if isinstance(fid, dict) and isinstance(fid.get("quality"), dict) else quality_verdict(fid)
    style = {"KEPT": "green", "DEGRADED": "bold yellow", "LOST": "bold red", "UNMEASURED": "dim"}[v["level"]]
    return f"[{style}]{escape(quality_line(fid))}[/]"


__all__ = ["THRESHOLDS", "LEVELS", "quality_verdict", "quality_line", "quality_markup"]
