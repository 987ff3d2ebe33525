# SPDX-License-Identifier: Apache-2.0
"""The conversion report: ``report.html`` (self-contained, figures embedded), ``report.md`` (+ ``plots/*.png``)
and ``report.json``, made from what a converted directory holds. ``kvexport report DIR`` regenerates them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvexport.atomic import atomic_write_bytes, rebase_paths
from kvexport.report.collect import collect, normalize_parity
from kvexport.report.plots import make_plots
from kvexport.report.render import render_html, render_md, verdict_text
from kvexport.report.sections import fidelity_of, quality, quality_line

REPORT_FILES = ("report.html", "report.md", "report.json")


def write_report(out_dir: str | Path, shown_as: str | Path | None = None) -> dict[str, Any]:
    """Collect ``out_dir`` and write report.html, report.md, report.json and plots/*.png into it. ``shown_as``: the
    name the directory will have (a conversion is reported before its temporary directory is renamed into place).

    Returns the report dictionary (with ``files``: what was written). Each file is written to a
    temporary name and renamed, so a failed run never leaves half a report.
    """
    d = Path(out_dir)
    rep = rebase_paths(collect(d), d, shown_as)
    plots = make_plots(rep.get("profile"))
    written = []
    plot_dir = d / "plots"
    plot_files = {}
    if plots:
        plot_dir.mkdir(exist_ok=True)
        for stem, (caption, png) in plots.items():
            _atomic_write(plot_dir / f"{stem}.png", png)
            plot_files[stem] = (caption, f"plots/{stem}.png")
            written.append(f"plots/{stem}.png")
    rep["plots"] = {k: v[1] for k, v in plot_files.items()}
    rep["verdict"] = verdict_text(rep.get("parity"))
    fid = fidelity_of(rep)
    if fid:  # beside parity's verdict: has the conversion kept the model (kvexport.export.quality)
        rep["quality"] = {**quality(fid), "line": quality_line(fid)}
    _atomic_write(d / "report.html", render_html(rep, plots).encode("utf-8"))
    _atomic_write(d / "report.md", render_md(rep, plot_files).encode("utf-8"))
    written += ["report.html", "report.md", "report.json"]
    rep["files"] = written
    public = {k: v for k, v in rep.items() if k != "parity"}
    if rep.get("parity") is not None:
        public["parity"] = {k: v for k, v in rep["parity"].items() if k != "raw"}
    _atomic_write(d / "report.json", json.dumps(public, indent=2, default=str).encode("utf-8"))
    from kvexport import layout

    if layout.has_outputs_manifest(d):
        layout.record_outputs(d)  # the new report files' hashes
    return rep


def _atomic_write(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data)  # a temporary sibling, renamed on success, removed on any error


__all__ = ["write_report", "collect", "normalize_parity", "make_plots", "render_html", "render_md", "REPORT_FILES"]
