# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert`` settings: refusals before any work, config files, defaults, the saved round trip."""

from __future__ import annotations

import json
import re

import pytest

from kvexport.cli import main
from kvexport.convert.config import ConvertConfig, default_budget, default_mla_rank, default_rope_dim, parse_contexts
from kvexport.errors import BadUsage

REFUSALS = [
    (["--mla-rank", "16", "--mla-energy", "0.9"], "exclude each other"),
    (["--press", "none", "--budget", "64"], "--budget needs an eviction press"),
    (["--press", "none", "--window", "8"], "--window needs an eviction press"),
    (["--neighbors", "2", "--budget", "64"], "--neighbors refines an eviction press"),
    (["--rope-dim", "8"], "--rope-dim only applies to the MLA rewrite"),
    (["--mla-rank", "16", "--rope-dim", "7"], "positive even number"),
    (["--mla-energy", "1.5"], r"must be in \(0, 1\]"),
    (["--mla-rank", "0"], "must be >= 1"),
    (["--distill-data", "x.txt"], "need a teacher"),
    (["--distill-tokens", "100"], "need a teacher"),
    (["--distill-teacher", "T", "--distill-data", "x.txt"], "distillation repairs the MLA rewrite"),
    (["--mla-rank", "16", "--distill-teacher", "T"], "needs --distill-data"),
    (["--refit-steps", "10"], "--refit-steps repairs the MLA rewrite: add --mla-rank R"),
    (["--mla-rank", "16", "--refit-steps", "-1"], "--refit-steps -1 must be >= 0"),
    (["--allow-partial"], "--allow-partial only applies to --target tensorrt"),
    (["--target", "tpu"], "not one of: onnx, tensorrt"),
    (["--press", "nosuch", "--budget", "300"], "unknown press 'nosuch'"),
    (["--press", "snapkv", "--window", "0"], "--window 0 must be >= 1"),
    (["--contexts", "512,abc"], "is not an integer"),
    (["--decode-steps", "0"], "--decode-steps 0 must be >= 1"),
    (["--repeats", "0"], "--repeats 0 must be >= 1"),
    (["--min-agreement", "1.5"], r"--min-agreement 1.5 must be in \[0, 1\]"),
    (["--max-ppl-increase", "-0.1"], "--max-ppl-increase -0.1 must be >= 0"),
    (["--eval-data", "no/such.txt"], "--eval-data no/such.txt does not exist"),
    (["--no-fidelity", "--min-agreement", "0.9"], "--no-fidelity drops the fidelity check"),
    (["--no-validate", "--max-ppl-increase", "0.1"], "checked by the validate stage; drop --no-validate"),
    (["--kv-dtype", "int4"], r"--kv-dtype 'int4' unknown; accepted: fp32, fp16, bf16, int8, fp8"),
    (["--weights", "int3"], r"--weights 'int3' unknown; accepted: fp32, fp16, int4, int4-a8, int4-qdq"),
    (["--weights", "int4-a8", "--target", "tensorrt"], "--weights int4-a8 is onnxruntime's MatMulNBits"),
    (["--weights", "int4-a8", "--fp16"], "rewrites an fp32 export's weights"),
]


@pytest.mark.parametrize("args,reason", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_refused_before_any_work(tmp_path, capsys, args, reason):
    out = tmp_path / "out"
    rc = main(["convert", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert re.search(reason, err), err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary sibling either


def test_refusals_that_need_the_model(tmp_path, capsys, tiny_hf_dir):
    out = tmp_path / "out"
    cases = [
        (["--mla-rank", "4096"], "MLA rank r_kv 4096 is larger than the rank of the stacked"),
        (["--press", "snapkv", "--budget", "32"], "must exceed the 64 tokens snapkv always keeps"),
        (["--press", "random", "--budget", "100"], "cannot be exported"),
        (["--press", "knorm", "--budget", "5000"], "exceeds the model's 4096 positions"),
        (["--mla-rank", "16", "--distill-teacher", str(tmp_path / "nope"), "--distill-data", __file__],
         "is not a model directory"),
    ]
    for args, reason in cases:
        rc = main(["convert", str(tiny_hf_dir), "--out", str(out), *args])
        err = capsys.readouterr().err
        assert rc == 2 and reason in err, (args, err)
        assert not out.exists()
    rc = main(["convert", str(tmp_path / "missing"), "--out", str(out)])
    assert rc == 2 and f"model directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    rc = main(["convert", str(tmp_path / "missing.gguf"), "--out", str(out)])
    assert rc == 2 and f"GGUF file {tmp_path / 'missing.gguf'} does not exist" in capsys.readouterr().err
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out)])
    assert rc == 2 and "not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "x"


def test_out_is_required(capsys):
    assert main(["convert"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_config_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("press: knorm\nbudget: 128\nwindow: 16\ncontexts: [2048, 512]\nfp16: true\n")
    cfg = ConvertConfig.from_file(y)
    assert (cfg.press, cfg.budget, cfg.window, cfg.contexts, cfg.fp16) == ("knorm", 128, 16, [512, 2048], True)
    # flags given on the command line win over the file
    cfg2 = cfg.merged({"budget": 64, "window": None})
    assert (cfg2.budget, cfg2.window) == (64, 16)
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"mla-rank": 24, "rope-dim": 8, "out": "ignored"}))
    assert (ConvertConfig.from_file(j).mla_rank, ConvertConfig.from_file(j).rope_dim) == (24, 8)
    bad = tmp_path / "bad.yaml"
    bad.write_text("presss: knorm\n")
    with pytest.raises(BadUsage, match="unknown setting"):
        ConvertConfig.from_file(bad)
    bad.write_text("budget: [1, 2\n")
    with pytest.raises(BadUsage, match="cannot be parsed"):
        ConvertConfig.from_file(bad)
    bad.write_text("budget: 12.5\n")
    with pytest.raises(BadUsage, match="must be an integer"):
        ConvertConfig.from_file(bad)
    bad.write_text("fp16: maybe\n")
    with pytest.raises(BadUsage, match="true or false"):
        ConvertConfig.from_file(bad)
    with pytest.raises(BadUsage, match="does not exist"):
        ConvertConfig.from_file(tmp_path / "nope.yaml")


def test_showcase_defaults_and_explicit_choice():
    # the defaults chosen on SmolLM2 (docs/sweep.md): SnapKV + lookahead 64 + neighbours 3, budget 2048, window 32,
    # chunk 512, an int8 cache, no MLA
    cfg = ConvertConfig().resolve()
    assert cfg.showcase_defaults
    assert (cfg.press, cfg.budget, cfg.window, cfg.chunk) == ("snapkv", 2048, 32, 512)
    assert (cfg.neighbors, cfg.lookahead, cfg.kv_dtype, cfg.mla_rank) == (3, 64, "int8", None)
    assert ConvertConfig(kv_dtype="fp16").resolve().kv_dtype == "fp16"  # a given format is kept
    only_mla = ConvertConfig(mla_rank=32).resolve()
    assert not only_mla.showcase_defaults and only_mla.press == "none" and only_mla.budget is None
    assert only_mla.kv_dtype is None and only_mla.lookahead is None
    only_press = ConvertConfig(press="knorm").resolve()  # kvpress's KNorm as given: no refinements, model dtype
    assert (only_press.budget, only_press.window, only_press.mla_rank) == (2048, 32, None)
    assert (only_press.neighbors, only_press.lookahead, only_press.kv_dtype) == (0, 0, None)
    # a size without a press: the default press, refinements and cache format at that size
    sized = ConvertConfig(budget=512).resolve()
    assert (sized.press, sized.budget, sized.window, sized.neighbors, sized.lookahead, sized.kv_dtype) == (
        "snapkv", 512, 32, 3, 64, "int8")
    assert ConvertConfig(window=8, kv_dtype="fp32").resolve().kv_dtype == "fp32"
    with_mla = ConvertConfig(budget=256, mla_rank=32).resolve()  # MLA's latent cache keeps the model's dtype
    assert (with_mla.press, with_mla.budget, with_mla.kv_dtype, with_mla.mla_rank) == ("snapkv", 256, None, 32)


def test_default_budget_fits_the_model():
    assert default_budget(8192) == 2048 and default_budget(32768) == 2048
    assert default_budget(2048) == 512 and default_budget(3) == 1


@pytest.mark.parametrize("kw, match", [
    ({"press": "knorm", "lookahead": 64}, "knorm scores without observation queries"),
    ({"press": "none", "neighbors": 3}, "--neighbors refines an eviction press"),
    ({"press": "snapkv", "lookahead": -1}, "--lookahead -1 must be >= 0"),
    ({"neighbors": -2, "press": "snapkv"}, "--neighbors -2 must be >= 0"),
    ({"choose": True, "budget": 512}, "--choose picks the press, budget, cache format and MLA rank itself; drop --budget"),
    ({"choose": True, "kv_dtype": "int8"}, "drop --kv-dtype"),
    ({"min_recall": 0.9}, "--min-recall and --choose-context are settings of --choose"),
    ({"choose": True, "min_recall": 1.5}, r"--min-recall 1.5 must be in \[0, 1\]"),
])
def test_refinements_and_choose_refused_in_one_line(kw, match):
    with pytest.raises(BadUsage, match=match):
        ConvertConfig(**kw).resolve()


def test_choose_leaves_compression_to_its_stage():
    cfg = ConvertConfig(choose=True, min_agreement=0.85).resolve()
    assert not cfg.showcase_defaults and cfg.press is None and cfg.budget is None and cfg.kv_dtype is None


def test_default_mla_rank_targets_two_x():
    # the default is the studies' best measured trade-off (docs/mla.md): 2x per token, d_rope = head_dim.
    # the student: 2 KV heads x 2 x head 32 = 128 elements per token and layer -> 64 = r_kv 32 + d_rope 32
    assert default_rope_dim(32) == 32 and default_mla_rank(2, 32, 32) == 32
    # Llama-3.2-1B: 8 x 2 x 64 = 1024 elements -> 512 = r_kv 448 + d_rope 64
    assert default_rope_dim(64) == 64 and default_mla_rank(8, 64, 64) == 448


def test_parse_contexts():
    assert parse_contexts("8192, 512,2048,512") == [512, 2048, 8192]
    with pytest.raises(BadUsage):
        parse_contexts("0")
    with pytest.raises(BadUsage):
        parse_contexts("")


@pytest.mark.parametrize("model", ["kvx-student", "kvx-teacher-2x", "kvx-teacher-4x"])
def test_example_config_fits_every_bundled_model(model):
    """examples/convert_config.yaml resolves on each bundled model (a fixed r_kv 128 fitted none of them)."""
    from kvexport.convert.stages import resolve_settings
    from kvexport.paths import MODELS_DIR, REPO_ROOT

    cfg = ConvertConfig.from_file(REPO_ROOT / "examples" / "convert_config.yaml")
    cfg.model = str(MODELS_DIR / model)
    cfg, _, spec = resolve_settings(cfg)
    assert cfg.uses_mla and cfg.rope_dim == spec.head_dim


def test_examples_parse():
    """The examples' YAML is a valid convert config and their scripts are valid bash."""
    import subprocess

    from kvexport.paths import REPO_ROOT

    ex = REPO_ROOT / "examples"
    cfg = ConvertConfig.from_file(ex / "convert_config.yaml")
    assert (cfg.press, cfg.budget, cfg.mla_energy, cfg.mla_rank, cfg.rope_dim, cfg.contexts) == (
        "snapkv", 256, 0.9, None, None, [512, 2048, 8192])
    cfg.check()
    scripts = sorted(ex.rglob("*.sh"))
    assert len(scripts) >= 5
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, (s, r.stderr)
        assert "kvexport convert" in s.read_text() or "kvexport build-engine" in s.read_text()
