# SPDX-License-Identifier: Apache-2.0
"""The report: files, self-containedness, numbers matching the JSON, and what a browser shows."""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import pytest

from kvexport.cache.memory import CacheShape, cache_table
from kvexport.errors import BadArtifact
from kvexport.report import normalize_parity, write_report
from tests.report.browser import dump_dom, find_chromium, screenshot

CONTEXTS = [512, 2048, 8192]


def _sp(v: float, rel: float = 0.1) -> dict:
    return {"p10": v * (1 - rel / 2), "p50": v, "p90": v * (1 + rel / 2), "relative": rel}


def _rows(decode_ms: list[float], kv: list[int], rss: list[int], rel: float = 0.1) -> list[dict]:
    return [{"context": c, "repeats": 3, "prefill_s": c / 4000, "ttft_s": c / 4000, "prefill_tokens_per_s": 4000.0,
             "decode_steps": 8, "decode_ms_p50": d, "decode_ms_p90": d * 1.2, "decode_ms_mean": d * 1.05,
             "tokens_per_s": 1e3 / (d * 1.05),
             "spread": {"ttft_s": _sp(c / 4000, rel), "decode_ms_p50": _sp(d, rel), "decode_ms_p90": _sp(d * 1.2, rel)},
             "peak_rss_bytes": r, "rss_start_bytes": 300 << 20, "rss_delta_bytes": r - (300 << 20), "kv_bytes": k}
            for c, d, k, r in zip(CONTEXTS, decode_ms, kv, rss, strict=False)]


#: parity.json's fidelity block as the validator writes it (schema of kvexport.export.validation)
FIDELITY = {"reference": "original model (transformers, full cache)", "candidate": "onnxruntime:CPUExecutionProvider",
            "eval_data": "bundled:stdlib", "prefix_tokens": 512, "scored_tokens": 1024,
            "next_token_agreement": 0.9375, "mean_kl": 0.0421, "ppl_original": 4.25, "ppl_converted": 4.4625,
            "ppl_increase": 0.05,
            "recall": {"span_recall": {"original": 0.875, "converted": 0.625, "examples": 16},
                       "passkey": {"original": 1.0, "converted": 0.8125, "examples": 16}},
            "gates": {"min_agreement": 0.9, "max_ppl_increase": None, "passed": True}}


def profile_doc(backend: str = "onnxruntime", conv_ms=(1.1, 1.2, 1.2), base_ms=(1.5, 3.0, 9.0), rel: float = 0.1,
                other_cores: float = 0.1, gpu: str | None = None) -> dict:
    shape = CacheShape(4, 2, 32, (16,) * 4, 8, 256, 32, 4)
    table = cache_table(shape, CONTEXTS)
    base_kv = [r["baseline_kv_bytes"] for r in table["contexts"]]
    conv_kv = [r["kv_bytes"] for r in table["contexts"]]
    env = {"platform": "Linux", "cpu_model": "Test CPU 9000", "cpu_count": 2}
    if gpu:
        env["gpu"] = gpu
    return {
        "version": 1, "backend": backend, "decode_steps": 8, "repeats": 3, "contexts": CONTEXTS,
        "skipped_contexts": [], "cache": table,
        "variants": {"converted": {"backend": backend, "contexts": _rows(list(conv_ms), conv_kv, [320 << 20] * 3, rel),
                                   "files": {"prefill.onnx": 5 << 20}, "files_bytes": 5 << 20},
                     "baseline": {"backend": backend, "contexts": _rows(list(base_ms), base_kv,
                                                                        [330 << 20, 380 << 20, 900 << 20], rel),
                                  "files": {"model.onnx": 5 << 20}, "files_bytes": 5 << 20}},
        "environment": env,
        "machine_load": {"cpu_count": 2, "busy_cores": 1.0 + other_cores, "own_cores": 1.0, "other_cores": other_cores,
                         "load_avg_start": [0.5, 0.4, 0.3], "load_avg_end": [1.2, 0.6, 0.4]}}


def make_dir(d: Path, passed: bool = True, fidelity: dict | None = None, profile: dict | None = None) -> Path:
    """A converted directory as convert writes it: convert.json, parity.json, profile.json."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "convert.json").write_text(json.dumps({
        "format": "kvexport-convert", "version": 1, "kvexport_version": "0.1.0", "created": "2026-11-29 18:00:00 UTC",
        "settings": {"model": "/models/kvx-student", "press": "snapkv", "budget": 256, "window": 32,
                     "mla_rank": 16, "rope_dim": 8, "contexts": CONTEXTS},
        "model": {"name": "kvx-student", "family": "Llama", "num_layers": 4, "parameters": 1 << 18},
        "stages": [{"name": "load", "status": "done", "seconds": 1.5, "note": ""},
                   {"name": "distill", "status": "skipped", "seconds": 0.0, "note": "no --distill-teacher"}]}))
    parity = {"pairs": {"pytorch~onnxruntime": {
        "max_abs_logit_error": 3.2e-6 if passed else 0.5, "max_rel_logit_error": 1e-6, "token_agreement": 1.0,
        "index_agreement": 1.0 if passed else 0.75, "steps": 64, "passed": passed,
        "tolerances": {"atol": 1e-4, "rtol": 1e-3}}}}
    if fidelity is not None:
        parity["fidelity"] = fidelity
    (d / "parity.json").write_text(json.dumps(parity))
    (d / "profile-onnxruntime.json").write_text(json.dumps(profile or profile_doc()))
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
    assert f"{ratio:.1f}×" in md and "151.7×" in md and "151.704" not in md
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
    (d / "profile-onnxruntime.json").write_text("{not json")
    with pytest.raises(BadArtifact, match="profile-onnxruntime.json is not valid JSON"):
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
    # the page's load handler noted, in an attribute, how many figures decoded (naturalWidth > 0)
    m = re.search(r'<body[^>]*data-images-decoded="(\d+)/(\d+)"', dom)
    assert m, dom[:1500]
    assert (int(m.group(1)), int(m.group(2))) == (n, n)
    assert "images loaded" not in dom
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

    from kvexport import layout
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


def _md(d: Path) -> str:
    return (d / "report.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_what_compression_cost_is_shown_next_to_the_verdict(tmp_path):
    d = make_dir(tmp_path / "conv", fidelity=FIDELITY)
    write_report(d)
    md = _md(d)
    assert md.index("## Parity") < md.index("## What compression cost") < md.index("## Plots")
    assert "| next-token agreement | 93.8 % |" in md
    assert "| perplexity | 4.25 → 4.46 (+5.0 %) |" in md
    assert "| span recall | 0.88 → 0.62 |" in md and "| passkey | 1.00 → 0.81 |" in md
    assert "bundled:stdlib: 1024 tokens scored after a 512-token prefix" in _flat(md)
    assert "Gates: next-token agreement >= 90.0 %: PASSED" in md
    # the summary quotes it in one line
    assert "| what compression cost | next-token agreement 93.8 %, perplexity 4.25 → 4.46 (+5.0 %)" in md
    html = (d / "report.html").read_text()
    assert 'id="fidelity"' in html and "What compression cost" in html


def test_no_fidelity_block_renders_nothing(tmp_path):
    d = make_dir(tmp_path / "conv")
    write_report(d)
    assert "compression cost" not in _md(d) and 'id="fidelity"' not in (d / "report.html").read_text()


def test_failed_gate_is_a_warning(tmp_path):
    fid = {**FIDELITY, "gates": {"min_agreement": 0.99, "max_ppl_increase": 0.01, "passed": False}}
    d = make_dir(tmp_path / "conv", fidelity=fid)
    write_report(d)
    md = _md(d)
    assert "> **Warning:** A fidelity gate failed" in md and "perplexity increase <= +1.0 %: FAILED" in md


def test_spread_machine_and_cpu_warning(tmp_path):
    d = make_dir(tmp_path / "conv")
    write_report(d)
    md = _md(d)
    # every latency carries its p10-p90 over the runs: decode p50 1.2 ms at +-5 %
    assert "| 8192 | 2.05 (1.95–2.15) | 4000 | 1.2 (1.14–1.26) | 1.44 (1.37–1.51) | 794 |" in md
    assert "3 runs per context (in brackets: p10–p90 over the runs)" in md
    # the machine and its load
    assert "| cpu model | Test CPU 9000 |" in md and "| CPU cores busy while profiling | 1.1 of 2" in md
    assert "| load average (1 min) before → after | 0.50 → 1.20 |" in md
    # CPU numbers do not carry over; a narrow spread and an idle machine give no other warning
    warnings = [ln for ln in md.splitlines() if ln.startswith("> **Warning:**")]
    assert len(warnings) == 1 and "measured on a CPU (Test CPU 9000, 2 cores, onnxruntime)" in warnings[0]
    assert "do not carry over to a Jetson" in warnings[0]


def test_wide_spread_and_busy_machine_are_warned(tmp_path):
    d = make_dir(tmp_path / "conv", profile=profile_doc(rel=0.9, other_cores=1.6))
    write_report(d)
    text = _flat(_md(d))
    assert "Latency moved by more than 25% between repeated runs" in text
    assert "converted decode p50 at 512 tokens: 0.605–1.59 ms" in text
    assert "other processes kept 1.6 of 2 CPU cores busy while profiling (load average 1.2)" in text


def test_no_cpu_warning_on_a_gpu(tmp_path):
    d = make_dir(tmp_path / "conv", profile=profile_doc(gpu="NVIDIA H200"))
    write_report(d)
    assert "measured on a CPU" not in _md(d)


def test_slower_than_baseline_is_said_plainly(tmp_path):
    prof = profile_doc(conv_ms=(32.9, 33.0, 33.1), base_ms=(2.28, 6.0, 40.0))
    prof["cache"]["shape"].update(budget=None, window=0, capacity=16384)
    d = make_dir(tmp_path / "conv", profile=prof)
    write_report(d)
    text = _flat(_md(d))
    assert ("The converted model is slower than the uncompressed baseline here: decode p50 at 512 tokens: "
            "32.9 vs 2.28 ms (14.4× slower); decode p50 at 2048 tokens: 33 vs 6 ms (5.5× slower)") in text
    assert "full cache of up to 16384 slots in power-of-two buckets and attends over its whole bucket" in text
    # the summary table gives every context, not only the longest
    assert "512: 32.9 vs 2.28 ms (14.4× slower); 2048: 33 vs 6 ms (5.5× slower); 8192: 33.1 vs 40 ms (1.2× faster)" \
        in text


def test_resident_bytes_beside_kv(tmp_path):
    prof = profile_doc()
    for r in prof["variants"]["converted"]["contexts"]:
        r["resident"] = {"total": 3 << 20, "kv": r["kv_bytes"], "positions": 4096, "query_ring": 1 << 20}
    d = make_dir(tmp_path / "conv", profile=prof)
    write_report(d)
    md = _md(d)
    conv_kv = prof["variants"]["converted"]["contexts"][-1]["kv_bytes"]
    assert "| context | KV cache (analytic) | resident per sequence | of which K/V | process peak RSS |" in md
    assert f"| 8192 | {conv_kv / 1024:.2f} KiB | 3.00 MiB | {conv_kv / 1024:.2f} KiB |" in md
    assert "Besides K/V, a sequence keeps resident: positions 4.00 KiB, query ring 1.00 MiB." in md


def test_profiles_of_each_backend_side_by_side(tmp_path):
    d = make_dir(tmp_path / "conv")
    (d / "profile-pytorch.json").write_text(json.dumps(profile_doc("pytorch", conv_ms=(7.0, 7.5, 8.0))))
    write_report(d)
    md = _md(d)
    assert "onnxruntime, converted:" in md and "pytorch, converted:" in md
    assert "| 8192 | 2.05 (1.95–2.15) | 4000 | 8 (7.6–8.4) |" in md
    # a legacy profile.json is onnxruntime's
    (d / "profile-onnxruntime.json").rename(d / "profile.json")
    write_report(d)
    assert "onnxruntime, converted:" in _md(d)


def test_disk_sizes_with_why_and_next_steps(tmp_path):
    d = make_dir(tmp_path / "conv")
    (d / "onnx").mkdir()
    weights = (1 << 18) * 4  # parameters x fp32
    for g in ("prefill", "decode"):
        (d / "onnx" / f"{g}.onnx").write_bytes(b"g" * 1000)
        (d / "onnx" / f"{g}.onnx.data").write_bytes(b"w" * weights)
    (d / "baseline").mkdir()
    (d / "baseline" / "model.onnx.data").write_bytes(b"w" * weights)
    write_report(d)
    md = _md(d)
    row = next(ln for ln in md.splitlines() if ln.startswith("| onnx/ |"))
    assert "| 2.00 MiB |" in row and "decode.onnx.data 1.0 MiB, prefill.onnx.data 1.0 MiB" in row
    assert "each a full copy of the 1.0 MiB of weights: one per graph" in row
    assert "| baseline/ | 1.00 MiB | the original model exported with a growing cache" in md
    # the next commands name this directory
    q = str(d.resolve())
    assert f"kvexport build-engine {q}/onnx --plugins build/plugins/libkvexport_plugins.so --fp16 --out {q}/engine" \
        in md
    assert f"kvexport profile {q} --backend tensorrt" in md and "examples/jetson/deploy.sh ~/conv 87" in md


def test_stage_table_has_a_total(tmp_path):
    d = make_dir(tmp_path / "conv")
    write_report(d)
    assert "| total |  | 1.5 |  |" in _md(d)
