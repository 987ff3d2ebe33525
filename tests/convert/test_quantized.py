# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert --kv-dtype int8`` on a tiny model: the export stores int8 codes, parity compares it with the
PyTorch cache in int8, and validate reports the int8 cache against its fp32 twin; the twin figures are checked
against runs of :func:`kvexport.generation.generate` made here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvexport.cli import main
from kvexport.convert.config import ConvertConfig
from kvexport.errors import BadUsage

ARGS = ["--press", "knorm", "--budget", "16", "--window", "4", "--chunk", "8", "--mla-rank", "16", "--rope-dim", "8",
        "--no-profile", "--no-baseline", "--validate-steps", "8", "--kv-dtype", "int8"]


@pytest.fixture(scope="module")
def converted(tiny_hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert-q") / "tiny-int8"
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out), *ARGS])
    return out, rc


def test_export_is_int8_and_parity_is_against_the_int8_cache(converted):
    out, rc = converted
    assert rc == 0
    cj = json.loads((out / "convert.json").read_text())
    assert cj["settings"]["kv_dtype"] == "int8"
    manifest = json.loads((out / "onnx" / "manifest.json").read_text())
    assert manifest["settings"]["kv_dtype"] == "int8"
    # the MLA rewrite equalized the latent for the int8 cache (MLASettings.equalize_latent), recorded with it
    assert json.loads((out / "mla" / "kvexport_mla.json").read_text())["settings"]["equalize_latent"] is True
    parity = json.loads((out / "parity.json").read_text())
    pair = parity["pairs"]["pytorch~onnxruntime"]
    # same codes on both sides: the export equals the int8 PyTorch cache (an fp32 reference would differ by ~1e-2)
    assert pair["passed"] and pair["token_agreement"] == 1.0 and pair["max_abs_logit_error"] < 1e-3


def test_twin_figures_equal_an_independent_computation(converted):
    from kvexport.export.fidelity import _windows, eval_stream
    from kvexport.generation import generate
    from kvexport.mla.io import load_mla
    from kvexport.models.loading import load_tokenizer
    from kvexport.presses import make_press

    out, _ = converted
    tw = json.loads((out / "parity.json").read_text())["twin"]
    assert tw["kv_dtype"] == "int8" and tw["label"] == "int8 cache vs its fp32 twin"
    P, n_win = tw["prefix_tokens"], tw["windows"]
    T = tw["scored_tokens"] // n_win
    dec = load_mla(out / "mla")
    tok = load_tokenizer(out / "onnx" / "tokenizer")
    stream, _ = eval_stream(tok, None, 0, dec.spec.vocab_size, P + T + 1)
    ids = torch.from_numpy(_windows(stream, n_win, P + T + 1)[:, :P])
    kw = dict(window=4, chunk=8, max_new_tokens=T, keep_logits=True)
    a, b = [], []
    for i in range(ids.shape[0]):  # one window at a time, as the twin runs them (a batch rounds differently)
        ref = generate(dec, ids[i : i + 1], press=make_press("knorm", budget=16), kv_dtype="fp32", **kw)
        got = generate(dec, ids[i : i + 1], press=make_press("knorm", budget=16), kv_dtype="int8",
                       forced_tokens=ref.tokens, **kw)
        a.append(torch.stack([ref.prompt_logits, *ref.step_logits], 1)[:, :T].double())
        b.append(torch.stack([got.prompt_logits, *got.step_logits], 1)[:, :T].double())
    a, b = torch.cat(a), torch.cat(b)
    assert tw["next_token_agreement"] == pytest.approx(float((a.argmax(-1) == b.argmax(-1)).double().mean()))
    assert tw["max_abs_logit_diff"] == pytest.approx(float((a - b).abs().max()), rel=1e-6)
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    assert tw["mean_kl"] == pytest.approx(float((la.exp() * (la - lb)).sum(-1).mean()), rel=1e-6, abs=1e-12)
    assert tw["max_abs_logit_diff"] > 0  # int8 is lossy: the twin is a different run, not the same one
    # resident bytes of both, and the int8 rows are a quarter of fp32's plus one fp16 scale per row
    cb = tw["cache_bytes"]
    assert cb["fp32"] == ref.resident_bytes["kv"] and cb["int8"] == got.resident_bytes["kv"] + got.resident_bytes["scales"]
    assert got.resident_bytes["kv"] * 4 == ref.resident_bytes["kv"]
    assert got.resident_bytes["scales"] == ref.resident_bytes["kv"] // 4 // (16 + 8) * 2


def test_report_shows_the_twin(converted):
    out, _ = converted
    rep = json.loads((out / "report.json").read_text())
    assert rep["twin"]["next_token_agreement"] == json.loads((out / "parity.json").read_text())["twin"][
        "next_token_agreement"]
    for f in ("report.html", "report.md"):
        text = (out / f).read_text()
        assert "int8 cache vs its fp32 twin" in text and "resident bytes (int8 / fp32)" in text, f


def test_config_file_key(tmp_path):
    cfg = ConvertConfig.from_mapping({"kv_dtype": "fp8"})
    assert cfg.kv_dtype == "fp8"
    cfg.check()
    with pytest.raises(BadUsage, match=r"^--kv-dtype 'int4' unknown; accepted: fp32, fp16, bf16, int8, fp8$"):
        ConvertConfig.from_mapping({"kv_dtype": "int4"}).check()
    np.testing.assert_equal(ConvertConfig().kv_dtype, None)
