# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert`` end to end on a tiny model: every file, parity, profile numbers, the report,
reproduction from convert.json; failed stages and missing TensorRT leave the right things behind."""

from __future__ import annotations

import json

import pytest

from kvexport.cli import main
from kvexport.convert.config import ConvertConfig

ARGS = ["--press", "knorm", "--budget", "16", "--window", "4", "--chunk", "8", "--mla-rank", "16", "--rope-dim", "8",
        "--contexts", "32,128", "--decode-steps", "4", "--validate-steps", "8", "--repeats", "2"]


@pytest.fixture(scope="module")
def converted(tiny_hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert") / "tiny-kvx"
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out), *ARGS])
    return out, rc


def test_every_file(converted, tiny_hf_dir):
    out, rc = converted
    assert rc == 0
    for f in ("convert.json", "parity.json", "profile-onnxruntime.json", "report.html", "report.md", "report.json",
              "plots/decode_latency.png", "plots/memory.png", "onnx/manifest.json", "onnx/prefill.onnx",
              "onnx/decode.onnx", "onnx/compact.onnx", "baseline/manifest.json", "baseline/model.onnx",
              "mla/kvexport_mla.json", "mla/model.safetensors"):
        assert (out / f).is_file(), f
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary directories left
    cj = json.loads((out / "convert.json").read_text())
    assert cj["settings"]["model"] == str(tiny_hf_dir.resolve())
    assert [s["name"] for s in cj["stages"]] == ["load", "choose", "rewrite", "distill", "export", "engine",
                                                  "validate", "profile", "report"]
    assert {s["name"]: s["status"] for s in cj["stages"]} == {
        "load": "done", "choose": "skipped", "rewrite": "done", "distill": "skipped", "export": "done", "engine": "skipped",
        "validate": "done", "profile": "done", "report": "done"}
    assert cj["mla"] == {"kv_ranks": [16, 16], "rope_dim": 8}


def test_parity_passed(converted):
    out, _ = converted
    parity = json.loads((out / "parity.json").read_text())
    pair = parity["pairs"]["pytorch~onnxruntime"]
    assert pair["passed"] is True and pair["token_agreement"] == 1.0
    assert pair["max_abs_logit_error"] <= pair["tolerances"]["atol"] + pair["tolerances"]["rtol"] * 100
    assert pair["steps"] == 8


def test_profile_numbers(converted):
    out, _ = converted
    prof = json.loads((out / "profile-onnxruntime.json").read_text())
    assert prof["backend"] == "onnxruntime" and prof["contexts"] == [32, 128] and prof["repeats"] == 2
    # tiny model: 2 layers; MLA latent 16 + rope 8 elements per token and layer, fp32; 16 + 4 slots
    per_tok, base_per_tok = 2 * (16 + 8) * 4, 2 * 2 * 2 * 16 * 4
    assert prof["cache"]["bytes_per_token"] == per_tok and prof["cache"]["baseline_bytes_per_token"] == base_per_tok
    conv, base = prof["variants"]["converted"], prof["variants"]["baseline"]
    assert [r["kv_bytes"] for r in conv["contexts"]] == [20 * per_tok, 20 * per_tok]
    assert [r["kv_bytes"] for r in base["contexts"]] == [(c + 4) * base_per_tok for c in (32, 128)]
    for r in conv["contexts"] + base["contexts"]:
        assert r["decode_ms_p50"] <= r["decode_ms_p90"] and r["peak_rss_bytes"] > 0
        assert r["repeats"] == 2 and set(r["spread"]) == {"ttft_s", "decode_ms_p50", "decode_ms_p90"}
        sp = r["spread"]["ttft_s"]
        assert sp["p10"] <= r["ttft_s"] == sp["p50"] <= sp["p90"]
    load = prof["machine_load"]
    assert load["cpu_count"] >= 1 and load["own_cores"] > 0 and load["other_cores"] >= 0
    # the graphs and the one weights file they share (each weight stored once)
    onnx_bytes = sum(p.stat().st_size for p in (out / "onnx").iterdir() if p.suffix in (".onnx", ".data"))
    assert (out / "onnx" / "weights.data").is_file() and conv["files_bytes"] == onnx_bytes


def test_report_shows_it(converted):
    out, _ = converted
    html = (out / "report.html").read_text()
    assert "Parity: PASSED" in html and "<title>kvexport report: tiny-llama</title>" in html
    assert html.count('src="data:image/png;base64,') == 4
    md = (out / "report.md").read_text()
    assert "pytorch~onnxruntime" in md and "| 128 |" in md


def test_convert_json_reproduces_settings(converted):
    """``--config DIR/convert.json`` resolves to the very same settings (the conversion is then the same run)."""
    out, _ = converted
    saved = json.loads((out / "convert.json").read_text())["settings"]
    again = ConvertConfig.from_file(out / "convert.json").resolve()
    assert again.to_dict() == saved


def test_report_and_profile_commands(converted, capsys):
    out, _ = converted
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0
    assert "Parity: PASSED" in (out / "report.html").read_text()
    assert main(["report", str(out / "nope")]) == 4
    assert "is not a directory" in capsys.readouterr().err
    assert main(["profile", str(out), "--backend", "cuda"]) == 2
    assert main(["profile", str(out), "--contexts", "16", "--decode-steps", "2", "--no-baseline",
                 "--no-report"]) == 0
    prof = json.loads((out / "profile-onnxruntime.json").read_text())
    assert prof["contexts"] == [16] and list(prof["variants"]) == ["converted"]


def test_profiles_of_two_backends_side_by_side(converted, capsys):
    """`kvexport profile DIR --backend pytorch` adds profile-pytorch.json; onnxruntime's stays as it was, the
    manifest lists both and the report shows both."""
    out, _ = converted
    ort = (out / "profile-onnxruntime.json").read_bytes()
    assert main(["profile", str(out), "--backend", "pytorch", "--contexts", "24", "--decode-steps", "2",
                 "--repeats", "1"]) == 0
    assert (out / "profile-onnxruntime.json").read_bytes() == ort
    assert json.loads((out / "profile-pytorch.json").read_text())["backend"] == "pytorch"
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert {"profile-onnxruntime.json", "profile-pytorch.json"} <= set(files)
    md = (out / "report.md").read_text()
    assert "onnxruntime, converted:" in md and "pytorch, converted:" in md
    assert main(["report", str(out)]) == 0  # the directory still verifies


def test_validate_a_conversion_keeps_it_verifiable(converted, capsys):
    """`kvexport validate DIR` (the Jetson flow) rewrites DIR/parity.json and its hash; profile and report
    still accept the directory (copying onnx/parity.json over it used to break the manifest)."""
    from kvexport import layout

    out, _ = converted
    before = json.loads((out / "parity.json").read_text())
    assert main(["validate", str(out), "--steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "pytorch~onnxruntime" in text and "updated" in text
    after = json.loads((out / "parity.json").read_text())
    assert after["pairs"]["pytorch~onnxruntime"]["steps"] == 2 != before["pairs"]["pytorch~onnxruntime"]["steps"]
    assert not (out / "onnx" / "parity.json").exists()  # the export stays as exported
    layout.verify_conversion(out)
    assert main(["report", str(out)]) == 0


def test_generate_from_a_conversion(converted, capsys):
    out, _ = converted
    assert main(["generate", str(out), "-p", "def f(", "-n", "3"]) == 0
    assert "'def f(' ->" in capsys.readouterr().out


def test_failed_stage_leaves_nothing(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    import kvexport.convert.stages as stages

    def boom(st):
        (st.work / "onnx").mkdir()
        (st.work / "onnx" / "half.onnx").write_bytes(b"x")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(stages, "stage_export", boom)
    out = tmp_path / "out"
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out), "--press", "knorm", "--budget", "16"])
    err = capsys.readouterr().err
    assert rc == 70 and "error: stage 'export' failed: RuntimeError: disk on fire" in err
    assert list(tmp_path.iterdir()) == []  # neither out nor a temporary sibling


def test_tensorrt_missing(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    import kvexport.convert.stages as stages

    monkeypatch.setattr(stages, "tensorrt_problem", lambda: "TensorRT is not installed (test)")
    out = tmp_path / "out"
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out), "--press", "knorm", "--budget", "16",
               "--target", "tensorrt"])
    err = capsys.readouterr().err
    assert rc == 5 and "TensorRT is not installed (test)" in err and "nothing was written" in err
    assert not out.exists()

    # --allow-partial: the stages before the engine run, the ONNX result is kept, exit 5 all the same
    def fake_export(st):
        (st.work / "onnx").mkdir()
        (st.work / "onnx" / "decode.onnx").write_bytes(b"onnx")
        return "fake"

    monkeypatch.setattr(stages, "stage_export", fake_export)
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out), "--press", "knorm", "--budget", "16",
               "--target", "tensorrt", "--allow-partial", "--no-validate", "--no-profile"])
    err = capsys.readouterr().err
    assert rc == 5 and "kept the ONNX result" in err
    assert (out / "onnx" / "decode.onnx").read_bytes() == b"onnx"
    cj = json.loads((out / "convert.json").read_text())
    eng = next(s for s in cj["stages"] if s["name"] == "engine")
    assert eng["status"] == "skipped" and eng["note"] == "TensorRT is not installed (test)"
    eng_lines = [ln for ln in err.splitlines() if "] engine" in ln]
    assert eng_lines and all("skipped  TensorRT is not installed (test)" in ln for ln in eng_lines), err
    assert cj["engine_missing"] == "TensorRT is not installed (test)"
    assert "Parity: NOT RUN" in (out / "report.html").read_text()


@pytest.mark.parametrize("variant", ["onnx", "baseline"])
def test_step_runner_matches_generate(converted, variant):
    """The profiler's onnxruntime runs produce the greedy tokens of the PyTorch library path with the export's model
    and settings (kvexport.generation.generate, what validate compares with)."""
    import numpy as np

    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.manifest import verify_manifest
    from kvexport.profile.profiler import prompt_ids
    from kvexport.profile.runners import ProfiledDriver
    from kvexport.runtime import open_onnxruntime

    out, _ = converted
    ids = prompt_ids(45, 4096, seed=7)  # several chunks, past the budget: compactions in prefill and decode
    runner = ProfiledDriver(open_onnxruntime(out / variant), "onnxruntime")
    toks = runner.generate(ids, 12).tokens[0].tolist()
    manifest = verify_manifest(out / variant)
    s = manifest["settings"]
    from kvexport.export.source import press_from_dict

    dec = load_reference_model(manifest, root=out / variant)
    ref = reference_generate(dec, s, press_from_dict(s["press"]), ids, np.ones_like(ids), 12)
    assert toks == ref.tokens[0].tolist()


def test_profile_a_plain_export(converted):
    """``kvexport profile`` also takes an export directory on its own (settings from its manifest)."""
    from kvexport.profile.run import profile_dir

    out, _ = converted
    prof = profile_dir(out / "onnx", contexts=[24], decode_steps=2, write=False)
    # the export's manifest forbids new files there: the profile goes beside it, or to --out
    assert main(["profile", str(out / "onnx"), "--contexts", "24", "--decode-steps", "2", "--repeats", "1"]) == 0
    beside = out / "onnx.profile-onnxruntime.json"
    assert json.loads(beside.read_text())["contexts"] == [24]
    beside.unlink()
    target = out.parent / "plain-profile.json"
    assert main(["profile", str(out / "onnx"), "--contexts", "24", "--decode-steps", "2", "--out", str(target)]) == 0
    assert json.loads(target.read_text())["contexts"] == [24]
    assert not (out / "onnx" / "profile.json").exists()
    from kvexport.manifest import verify_manifest

    verify_manifest(out / "onnx")
    assert list(prof["variants"]) == ["converted"]
    assert prof["cache"]["shape"]["mla_ranks"] == [16, 16] and prof["cache"]["shape"]["budget"] == 16
    assert prof["variants"]["converted"]["contexts"][0]["kv_bytes"] == 20 * 2 * (16 + 8) * 4


@pytest.mark.slow
def test_convert_json_reproduces_the_export(converted, tmp_path):
    """``kvexport convert --config DIR/convert.json --out DIR2`` writes byte-identical graphs."""
    out, _ = converted
    again = tmp_path / "again"
    assert main(["convert", "--config", str(out / "convert.json"), "--out", str(again), "--no-validate",
                 "--no-profile"]) == 0
    for sub in ("onnx", "baseline"):
        a = json.loads((out / sub / "manifest.json").read_text())["files"]
        b = json.loads((again / sub / "manifest.json").read_text())["files"]
        assert a == b
    assert (json.loads((again / "convert.json").read_text())["settings"]
            == {**json.loads((out / "convert.json").read_text())["settings"], "validate": False, "profile": False})


def test_mla_export_records_its_source(converted):
    """The MLA export of a conversion names DIR/mla as its reference (relative, so the directory can move) and
    carries the tokenizer: ``kvexport validate DIR/onnx`` needs no --model."""
    from kvexport.export import validate
    from kvexport.manifest import verify_manifest

    out, _ = converted
    s = verify_manifest(out / "onnx")["settings"]
    assert s["source_relative"] == "../mla" and s["mla"] is not None
    assert s["tokenizer"] == "tokenizer" and (out / "onnx" / "tokenizer" / "tokenizer.json").is_file()
    rep = validate(out / "onnx", prompts=[5], steps=2, write=False)
    assert rep["pairs"]["pytorch~onnxruntime"]["passed"]
