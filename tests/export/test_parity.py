# SPDX-License-Identifier: Apache-2.0
"""Every family x {full cache, a press, MLA, MLA + press}: export -> onnxruntime generate -> validate.

fp32 tolerances: max abs logit error <= 1e-4 (and Polygraphy's elementwise atol 1e-4 / rtol 1e-3), 100 %
greedy-token agreement and 100 % kept-index agreement over 64 decode steps, on prompts below, at and
above the budget and over several chunks, for every family (CI runs the whole matrix) and fp16.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import FAMILIES, FAMILY_IDS

STEPS = 20  # validated decode steps per prompt: 5 decode compactions with window 4 (64 adds time, not coverage)
CONFIGS = {
    "full": dict(dynamic_cache=True),
    "press": dict(press="snapkv", budget=12, window=4, chunk=8),
    "mla": dict(mla_rank=16, rope_dim=4, chunk=8, max_positions=128),
    "mla+press": dict(press="snapkv", budget=12, window=4, chunk=8, mla_rank=16, rope_dim=4),
}


def _press(kw):
    kw = dict(kw)
    if kw.get("press") == "snapkv":
        from kvexport.presses import make_press

        kw["press"] = make_press("snapkv", budget=kw.pop("budget"), window_size=4)
    return kw


def _cases():
    out = []
    for (family, extra), fid in zip(FAMILIES, FAMILY_IDS, strict=False):
        for name in CONFIGS:
            out.append(pytest.param(family, extra, name, id=f"{fid}-{name}"))
    return out


@pytest.mark.parametrize("family,extra,config", _cases())
def test_export_generate_validate(tiny_models, tmp_path, family, extra, config):
    from kvexport.export import export_model, open_onnxruntime, validate, verify_manifest
    from kvexport.export.reference import reference_generate
    from kvexport.export.source import press_from_dict

    hf = tiny_models(family, **extra)
    out = export_model(hf, tmp_path / "x", **_press(CONFIGS[config]))
    man = verify_manifest(out)
    s = man["settings"]
    # generate: onnxruntime greedy == PyTorch greedy on a prompt over several chunks
    ids = np.random.default_rng(1).integers(3, 128, (1, 29))
    gen = open_onnxruntime(out)
    res = gen.generate(ids, None, 20, keep_logits=True)
    dec_ref = _reference_decoder(hf, s)
    ref = reference_generate(dec_ref, s, press_from_dict(s["press"]), ids, np.ones_like(ids), 20)
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    assert res.compactions == ref.compactions
    if s["press"] is not None:
        assert res.compactions > 0
    # validate: writes parity.json, passes with the fp32 tolerances
    rep = validate(out, steps=STEPS, model=hf)  # window 4: a decode compaction every 4 steps
    pair = rep["pairs"]["pytorch~onnxruntime"]
    assert pair["max_abs_logit_error"] <= 1e-4, pair["per_step_max_abs_logit_error"]
    assert pair["token_agreement"] == 1.0 and pair["index_agreement"] == 1.0
    assert pair["passed"] and pair["steps"] == STEPS
    saved = json.loads((out / "parity.json").read_text())
    assert saved["pairs"]["pytorch~onnxruntime"]["passed"] is True
    verify_manifest(out)  # parity.json is an allowed report, not a foreign file
    if "mla" in config:
        import onnx

        kinds = {n.op_type for n in onnx.load(str(out / "decode.onnx"), load_external_data=False).graph.node
                 if n.domain == "kvexport"}
        assert "LatentAttention" in kinds


def _reference_decoder(hf, s):
    from kvexport.export.reference import load_reference_model

    return load_reference_model({"settings": s}, hf)


@pytest.mark.parametrize("dtype,ops", [("fp32", "standard"), ("fp16", "custom")])
def test_standard_ops_and_fp16(tiny_models, tmp_path, dtype, ops):
    """--ops standard: plain opset-18 ONNX (functions inlined), same parity; fp16 within its tolerances."""
    import onnx

    from kvexport.export import export_model, validate
    from kvexport.export.parity import TOLERANCES

    hf = tiny_models("llama")
    out = export_model(hf, tmp_path / "x", dtype=dtype, ops=ops, mla_rank=16, rope_dim=4,
                       **_press(CONFIGS["press"]))
    for g in ("prefill", "decode", "compact"):
        m = onnx.load(str(out / f"{g}.onnx"))
        domains = {n.domain for n in m.graph.node} | {o.domain for o in m.opset_import}
        assert ("kvexport" in domains) == (ops == "custom")
        onnx.checker.check_model(m, full_check=True)
    pair = validate(out, steps=STEPS, model=hf)["pairs"]["pytorch~onnxruntime"]
    atol, _, min_tok, min_idx = TOLERANCES[dtype]
    assert pair["max_abs_logit_error"] <= atol
    assert pair["token_agreement"] >= min_tok and pair["index_agreement"] >= min_idx and pair["passed"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_weights_are_stored_once(tiny_models, tmp_path, dtype):
    """Every graph's weights live in one weights.data, each tensor once, in the export's dtype: its size is the
    model's parameter bytes (+ alignment), though prefill and decode both use every weight; no graph holds a large
    tensor of its own. In memory the sessions get one copy each tensor (add_initializer), with the same results as
    unshared sessions and the PyTorch reference."""
    import onnx

    from kvexport.export import export_model, open_onnxruntime, verify_manifest
    from kvexport.export.onnx_graph import EXTERNAL_MIN_BYTES
    from kvexport.export.reference import reference_generate
    from kvexport.export.source import press_from_dict

    hf = tiny_models("llama")
    out = export_model(hf, tmp_path / "x", dtype=dtype, **_press(CONFIGS["press"]))
    params = {id(p): p for p in hf.parameters()}.values()  # tied weights counted once
    itemsize = 4 if dtype == "fp32" else 2
    big = sum(p.numel() * itemsize for p in params if p.numel() * itemsize >= EXTERNAL_MIN_BYTES)
    stored = (out / "weights.data").stat().st_size
    assert big <= stored <= big + 64 * 64  # each tensor once, 64-byte aligned
    referenced = 0
    for g in ("prefill", "decode", "compact_prefill", "compact"):
        m = onnx.load(str(out / f"{g}.onnx"), load_external_data=False)
        assert all(len(t.raw_data) < EXTERNAL_MIN_BYTES for t in m.graph.initializer)
        referenced += sum(int({e.key: e.value for e in t.external_data}["length"]) for t in m.graph.initializer
                          if t.data_location == onnx.TensorProto.EXTERNAL)
    assert referenced >= 2 * big  # prefill and decode both read every weight, from the one file
    assert not list(out.glob("*.onnx.data"))
    s = verify_manifest(out)["settings"]
    ids = np.random.default_rng(2).integers(3, 128, (1, 21))
    shared, plain = open_onnxruntime(out), open_onnxruntime(out, share_weights=False)
    assert shared.graphs._shared and not plain.graphs._shared
    a, b = shared.generate(ids, None, 30, keep_logits=True), plain.generate(ids, None, 30, keep_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    if dtype == "fp32":
        ref = reference_generate(_reference_decoder(hf, s), s, press_from_dict(s["press"]), ids, np.ones_like(ids), 30)
        np.testing.assert_array_equal(a.tokens, ref.tokens.numpy())
        np.testing.assert_allclose(np.stack(a.step_logits), np.stack([x.numpy() for x in ref.step_logits]), atol=1e-4)
