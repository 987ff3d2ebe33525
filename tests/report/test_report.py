# SPDX-License-Identifier: Apache-2.0
"""The report: files, self-containedness, numbers matching the JSON, and what a browser shows."""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import pytest

from kvexport.errors import BadArtifact
from kvexport.profile.kv_bytes import CacheShape, cache_table
from kvexport.report import normalize_parity, write_report
from tests.report.browser import dump_dom, find_chromium, screenshot

CONTEXTS = [512, 2048, 8192]


def _rows(decode_ms: list[float], kv: list[int], rss: list[int]) -> list[dict]:
    return [{"context": c, "prefill_s": c / 4000, "ttft_s": c / 4000, "prefill_tokens_per_s": 4000.0, "decode_steps": 8,
             "decode_ms_p50": d, "decode_ms_p90": d * 1.2, "decode_ms_mean": d * 1.05, "tokens_per_s": 1e3 / (d * 1.05),
             "peak_rss_bytes": r, "rss_start_bytes": 300 << 20, "rss_delta_bytes": r - (300 << 20), "kv_bytes": k}
            for c, d, k, r in zip(CONTEXTS, decode_ms, kv, rss, strict=False)]


def make_dir(d: Path, passed: bool = True) -> Path:
    """A converted directory as convert writes it: convert.json, parity.json, profile.json."""
    d.mkdir(parents=True, exist_ok=True)
    shape = CacheShape(4, 2, 32, (16,) * 4, 8, 256, 32, 4)
    table = cache_table(shape, CONTEXTS)
    base_kv = [r["baseline_kv_bytes"] for r in table["contexts"]]
    conv_kv = [r["kv_bytes"] for r in table["contexts"]]
    (d / "convert.json").write_text(json.dumps({
        "format": "kvexport-convert", "version": 1, "kvexport_version": "0.1.0", "created": "2026-11-29 18:00:00 UTC",
        "settings": {"model": "/models/kvx-student", "press": "snapkv", "budget": 256, "window": 32,
                     "mla_rank": 16, "rope_dim": 8, "contexts": CONTEXTS},
        "model": {"name": "kvx-student", "family": "Llama", "num_layers": 4},
        "stages": [{"name": "load", "status": "done", "seconds": 1.5, "note": ""},
                   {"name": "distill", "status": "skipped", "seconds": 0.0, "note": "no --distill-teacher"}]}))
    (d / "parity.json").write_text(json.dumps({"pairs": {"pytorch~onnxruntime": {
        "max_abs_logit_error": 3.2e-6 if passed else 0.5, "max_rel_logit_error": 1e-6, "token_agreement": 1.0,
        "index_agreement": 1.0 if passed else 0.75, "steps": 64, "passed": passed,
        "tolerances": {"atol": 1e-4, "rtol": 1e-3}}}}))
    (d / "profile.json").write_text(json.dumps({
        "version": 1, "backend": "onnxruntime", "decode_steps": 8, "contexts": CONTEXTS, "skipped_contexts": [],
        "cache": table,
        "variants": {"converted": {"backend": "onnxruntime", "contexts": _rows([1.1, 1.2, 1.2], conv_kv,
                                                                                [320 << 20] * 3),
                                   "files": {"prefill.onnx": 5 << 20}, "files_bytes": 5 << 20},
                     "baseline": {"backend": "onnxruntime", "contexts": _rows([1.5, 3.0, 9.0], base_kv,
                                                                              [330 << 20, 380 << 20, 900 << 20]),
                                  "files": {"model.onnx": 5 << 20}, "files_bytes": 5 << 20}},
        "environment": {"platform": "Linux", "cpu_count": 2}}))
    return d


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_files_and_numbers(tmp_path):
    d = make_dir(tmp_path / "conv")
    rep = write_report(d)
    for f in ("report.html", "report.md", "report.json", "plots/decode_latency.png", "plots/memory.png"):
        assert (d / f).is_file(), f
    html = (d / "report.html").read_text()
    # self-contained: every image is an inline PNG, nothing is fetched
    srcs = re.findall(r'<img[^>]+src="([^"]+)"', html)
    assert len(srcs) == len(rep["plots"]) == 4
    for s in srcs:
        assert s.startswith("data:image/png;base64,")
        w, h = png_size(base64.b64decode(s.split(",", 1)[1]))
        assert w > 200 and h > 100
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert "Parity: PASSED" in html and "<title>kvexport report: kvx-student</title>" in html
    # the numbers shown are the JSON's: 8192 tokens, 4 layers x 24 elements x 4 B x 8192 vs 288 slots
    per_tok_conv = 4 * (16 + 8) * 4
    per_tok_base = 4 * 2 * 2 * 32 * 4
    ratio = per_tok_base * 8192 / (per_tok_conv * 288)
    md = (d / "report.md").read_text()
    assert f"{ratio:.3f}".rstrip("0") in md
    assert "| pytorch~onnxruntime | 3.20e-06 |" in md
    assert "![Decode latency per token" in md and "(plots/decode_latency.png)" in md
    j = json.loads((d / "report.json").read_text())
    assert j["verdict"] == "Parity: PASSED" and j["parity"]["passed"] is True
    assert j["profile"]["cache"]["per_token_ratio"] == pytest.approx(per_tok_base / per_tok_conv)


def test_failed_parity_is_shown(tmp_path):
    d = make_dir(tmp_path / "bad", passed=False)
    write_report(d)
    html = (d / "report.html").read_text()
    assert 'class="verdict fail">Parity: FAILED' in html
    assert "0.75" in html


def test_regenerates_and_refuses_empty(tmp_path):
    d = make_dir(tmp_path / "conv")
    write_report(d)
    (d / "parity.json").unlink()
    write_report(d)
    assert "Parity: NOT RUN" in (d / "report.html").read_text()
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadArtifact, match="none of convert.json"):
        write_report(tmp_path / "empty")
    (d / "profile.json").write_text("{not json")
    with pytest.raises(BadArtifact, match="profile.json is not valid JSON"):
        write_report(d)


@pytest.mark.parametrize("raw,names,verdict", [
    ({"pairs": {"a~b": {"passed": True}, "a~c": {"passed": False}}}, ["a~b", "a~c"], False),
    ({"pairs": [{"pair": "x", "passed": True}]}, ["x"], True),
    ({"pytorch~onnxruntime": {"passed": True, "max_abs_logit_error": 0.0}}, ["pytorch~onnxruntime"], True),
    ({"pairs": {}}, [], False),
])
def test_normalize_parity(raw, names, verdict):
    n = normalize_parity(raw)
    assert [p["pair"] for p in n["pairs"]] == names and n["passed"] is verdict


chromium = pytest.mark.skipif(find_chromium() is None,
                              reason="chromium not found (Debian: apt-get install chromium); browser test skipped")


@chromium
def test_browser_shows_title_verdict_and_plots(tmp_path):
    d = make_dir(tmp_path / "conv")
    rep = write_report(d)
    dom = dump_dom(d / "report.html")
    assert "<title>kvexport report: kvx-student</title>" in dom
    assert re.search(r'id="parity-verdict"[^>]*>Parity: PASSED<', dom)
    n = len(rep["plots"])
    # the page's load handler wrote how many figures decoded (naturalWidth > 0)
    m = re.search(r'id="img-check"[^>]*>images loaded: (\d+)/(\d+)<', dom)
    assert m, dom[-1500:]
    assert (int(m.group(1)), int(m.group(2))) == (n, n)
    widths = [int(w) for w in re.findall(r'data-natural-width="(\d+)"', dom)]
    assert len(widths) == n and all(w > 200 for w in widths)
    shot = screenshot(d / "report.html", tmp_path / "shot.png", height=1200)
    w, h = png_size(shot.read_bytes())
    assert (w, h) == (1280, 1200)


@chromium
def test_browser_shows_failed_verdict(tmp_path):
    d = make_dir(tmp_path / "bad", passed=False)
    write_report(d)
    dom = dump_dom(d / "report.html")
    assert re.search(r'id="parity-verdict" class="verdict fail">Parity: FAILED<', dom)


def test_accuracy_studies_are_tabled(tmp_path):
    d = make_dir(tmp_path / "conv")
    (d / "studies").mkdir()
    (d / "studies" / "press_study.json").write_text(json.dumps({
        "metric": "mean L2 discrepancy of the last hidden state", "prompts": 8,
        "rows": [{"press": "snapkv", "ratio": 0.5, "discrepancy": 0.125}, {"press": "knorm", "ratio": 0.5,
                                                                          "discrepancy": 0.25}]}))
    write_report(d)
    md = (d / "report.md").read_text()
    assert "## Accuracy studies" in md and "press_study:" in md
    assert "| snapkv | 0.5 | 0.125 |" in md and "| knorm | 0.5 | 0.25 |" in md
    assert "| metric | mean L2 discrepancy of the last hidden state |" in md


def test_conversion_manifest_guards_top_level_outputs(tmp_path):
    """DIR/manifest.json lists convert.json / parity.json / report.* by sha256; report refuses an altered one."""
    import json as _json

    from kvexport.convert import layout
    from kvexport.errors import BadArtifact
    from kvexport.report import collect as _collect
    from kvexport.report import write_report

    d = tmp_path / "conv"
    d.mkdir()
    (d / "convert.json").write_text(_json.dumps({"settings": {}}))
    (d / "parity.json").write_text(_json.dumps({"pairs": {"pytorch~onnxruntime": {"passed": True}}}))
    write_report(d)
    assert not (d / "manifest.json").exists()  # only a finished conversion has one; its writers then keep it
    layout.record_outputs(d)
    (d / "report.md").write_text("stale")
    write_report(d)  # rewrites report.* and their hashes
    files = _json.loads((d / "manifest.json").read_text())["files"]
    assert {"convert.json", "parity.json", "report.html", "report.md", "report.json"} <= set(files)
    _collect(d)  # intact: fine
    (d / "parity.json").write_text(_json.dumps({"pairs": {"pytorch~onnxruntime": {"passed": False}}}))
    with pytest.raises(BadArtifact, match="parity.json was altered"):
        _collect(d)
    (d / "parity.json").unlink()
    with pytest.raises(BadArtifact, match="missing parity.json"):
        _collect(d)
