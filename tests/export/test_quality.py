# SPDX-License-Identifier: Apache-2.0
"""The quality verdict beside parity: its thresholds on fidelity blocks, recall the original fails shown as
uninformative, and a conversion built to be bad (the bundled student, StreamingLLM keeping 6 tokens) called LOST in
the terminal, the report and report.json while its parity passes."""

from __future__ import annotations

import json

import pytest

from kvexport.cli import main
from kvexport.export.quality import THRESHOLDS, quality_line, quality_verdict


def fid(agreement=0.95, ppl=0.02, **recall):
    return {"next_token_agreement": agreement, "ppl_increase": ppl,
            "recall": {k: {"original": o, "converted": c, "examples": 8} for k, (o, c) in recall.items()}}


@pytest.mark.parametrize("f,level", [
    (fid(), "KEPT"),
    (fid(agreement=0.85), "DEGRADED"),
    (fid(agreement=0.79), "LOST"),
    (fid(ppl=0.12), "DEGRADED"),
    (fid(ppl=0.26), "LOST"),
    (fid(passkey=(1.0, 0.875)), "DEGRADED"),  # 87.5 % of the original's accuracy
    (fid(passkey=(1.0, 0.375)), "LOST"),
    (fid(passkey=(0.875, 0.875)), "KEPT"),
    (fid(passkey=(0.25, 0.0)), "KEPT"),  # the original fails it: says nothing
    (fid(agreement=0.547, ppl=3.28, passkey=(0.88, 0.0), span_recall=(0.38, 0.0)), "LOST"),  # SmolLM2 at 2 rounds' defaults
])
def test_levels(f, level):
    assert quality_verdict(f)["level"] == level


def test_boundaries_are_the_stated_thresholds():
    t = THRESHOLDS
    assert quality_verdict(fid(agreement=t["agreement"]["lost"]))["level"] == "DEGRADED"
    assert quality_verdict(fid(agreement=t["agreement"]["degraded"]))["level"] == "KEPT"
    assert quality_verdict(fid(ppl=t["ppl_increase"]["lost"]))["level"] == "DEGRADED"
    assert quality_verdict(fid(ppl=t["ppl_increase"]["degraded"]))["level"] == "KEPT"


def test_uninformative_recall_is_named_not_counted():
    v = quality_verdict(fid(passkey=(0.25, 0.0), span_recall=(1.0, 1.0)))
    assert v["uninformative"] == ["passkey"] and v["level"] == "KEPT"
    line = quality_line(fid(passkey=(0.25, 0.0)))
    assert line.startswith("quality KEPT") and "passkey uninformative (the original fails it too)" in line
    lost = quality_line(fid(agreement=0.5, passkey=(1.0, 0.0)))
    assert lost.startswith("quality LOST") and "agreement 50.0% < 80%" in lost and "passkey 1.00 -> 0.00" in lost


def test_unmeasured():
    assert quality_verdict(None)["level"] == "UNMEASURED"
    assert quality_verdict({"skipped": "no original model"})["reasons"] == ["not measured (no original model)"]


def test_a_conversion_built_to_be_bad_is_called_lost(tmp_path, capsys):
    """StreamingLLM keeping 6 tokens + 2 window slots, chunk 8, on the bundled student: parity passes (the export
    computes what the compressed model computes), the verdict says the model is lost, in the terminal, the report's
    summary (HTML and Markdown) and report.json."""
    out = tmp_path / "bad"
    rc = main(["convert", "--out", str(out), "--press", "streaming_llm", "--budget", "6", "--window", "2",
               "--chunk", "8", "--no-profile", "--no-baseline", "--validate-steps", "4"])
    text = capsys.readouterr()
    assert rc == 0, text.err[-2000:]
    parity = json.loads((out / "parity.json").read_text())
    assert all(p["passed"] for p in parity["pairs"].values())
    f = parity["fidelity"]
    assert f["quality"]["level"] == "LOST"
    # the verdict follows from the measured numbers by the stated thresholds (recomputed here from the raw ones)
    assert (f["next_token_agreement"] < THRESHOLDS["agreement"]["lost"]
            or f["ppl_increase"] > THRESHOLDS["ppl_increase"]["lost"]), f
    # the student's recall probes at 48 tokens: the original fails them, so they are uninformative, not "0 -> 0"
    failed = sorted(k for k, r in f["recall"].items() if isinstance(r, dict)
                    and r["original"] < THRESHOLDS["recall_solved"])
    assert sorted(f["quality"]["uninformative"]) == failed
    assert "quality LOST" in text.err + text.out
    html = (out / "report.html").read_text()
    assert 'id="quality-verdict" class="verdict fail"' in html and "quality LOST" in html
    assert "quality LOST" in (out / "report.md").read_text()
    rj = json.loads((out / "report.json").read_text())
    assert rj["quality"]["level"] == "LOST" and rj["quality"]["line"].startswith("quality LOST")
