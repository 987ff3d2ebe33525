# SPDX-License-Identifier: Apache-2.0
"""Exported graphs with a quantized (or fp16) cache keep what the PyTorch quantized cache keeps (issue 18).

Reference: :func:`kvexport.generation.generate` with the same ``kv_dtype`` on the unpadded prompt, eager PyTorch
(the exported graphs are onnxruntime running the traced graphs, with a front-padded last chunk and host-side
buffers per cache field). Both are fed the same tokens. Checked per case: greedy tokens equal, the compaction
steps and the kept positions of every layer equal at each of them (the reference may follow onnxruntime's choice
where its own scores tie two candidates, :mod:`kvexport.export.ties`), logits within ``ATOL`` (both write the same
codes: the quantizer is exact float32 arithmetic; observed <= 2e-6 on these models, the bound leaves room for one
code that rounds the other way after a matmul's different summation order), and the export's own buffers, the
PyTorch cache's and the byte formula agree on the K/V and scale bytes. Tiny models of every family, GQA presses
and MLA (with and without a press), int8 and fp8 on each, fp16 once. An int8 / fp8 MLA export hands its uint8
latent to LatentAttention version 2 (onnxruntime runs the node's ONNX function body; the PyTorch cache dequantizes
with kvexport.cache.quant in eager PyTorch): the graph is checked to give the codes to nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.cache.memory import CacheShape
from kvexport.errors import BadUsage
from kvexport.export import export_model, open_onnxruntime, verify_manifest
from kvexport.export.reference import load_reference_model
from kvexport.export.ties import TieReferee
from kvexport.generation import generate
from kvexport.presses import make_press

ATOL = 1e-3
BUDGET, WINDOW, CHUNK, STEPS, PROMPT = 12, 4, 8, 9, 29  # 3 prefill and 2 decode compactions with a press
KW = {"snapkv": {"window_size": 4}, "expected_attention": {"n_future_positions": 16}}
#: (id, family, family kwargs, press or None, MLA, kv_dtype[, ops])
CASES = [
    ("llama-snapkv-int8", "llama", {}, "snapkv", False, "int8"),
    ("llama-snapkv-fp16", "llama", {}, "snapkv", False, "fp16"),
    ("qwen2-knorm-fp8", "qwen2", {}, "knorm", False, "fp8"),
    ("qwen3-expected-int8", "qwen3", {"head_dim": 32}, "expected_attention", False, "int8"),
    ("mistral-tova-fp8", "mistral", {}, "tova", False, "fp8"),
    # MLA on every family, int8 and fp8, with and without a press: LatentAttention version 2 reads the codes
    ("llama-mla-snapkv-int8", "llama", {}, "snapkv", True, "int8"),
    ("llama-mla-full-fp8", "llama", {}, None, True, "fp8"),
    ("qwen2-mla-tova-fp8", "qwen2", {}, "tova", True, "fp8"),
    ("qwen2-mla-full-int8", "qwen2", {}, None, True, "int8"),
    ("qwen3-mla-keydiff-fp8", "qwen3", {"head_dim": 32}, "keydiff", True, "fp8"),
    ("qwen3-mla-full-int8", "qwen3", {"head_dim": 32}, None, True, "int8"),
    ("mistral-mla-expected-int8", "mistral", {}, "expected_attention", True, "int8"),
    ("mistral-mla-full-fp8", "mistral", {}, None, True, "fp8"),
    ("llama-mla-full-int8", "llama", {}, None, True, "int8"),
    ("llama-mla-snapkv-fp8-standard", "llama", {}, "snapkv", True, "fp8", "standard"),
]


def _press(name):
    return None if name is None else make_press(name, budget=BUDGET, **KW.get(name, {}))


def _kept(snapshot) -> list:
    out = []
    for layer in snapshot:
        a = layer.numpy() if hasattr(layer, "numpy") else np.asarray(layer)
        out.append([[sorted(int(p) for p in a[b, h] if p >= 0) for h in range(a.shape[1])] for b in range(a.shape[0])])
    return out


@pytest.mark.parametrize(("family", "extra", "press", "mla", "kv_dtype", "ops"),
                         [pytest.param(*c[1:6], c[6] if len(c) > 6 else "custom", id=c[0]) for c in CASES])
def test_export_equals_pytorch_quantized_cache(tiny_models, tmp_path, family, extra, press, mla, kv_dtype, ops):
    hf = tiny_models(family, **extra)
    mla_kw = dict(mla_rank=16, rope_dim=4) if mla else {}
    size = {} if press is not None else dict(max_positions=64)
    out = export_model(hf, tmp_path / "x", press=_press(press), window=WINDOW, chunk=CHUNK, kv_dtype=kv_dtype,
                       ops=ops, **mla_kw, **size)
    s = verify_manifest(out)["settings"]
    assert s["kv_dtype"] == kv_dtype
    if mla:  # the rewrite equalizes the latent for an int8 cache (and the reference rebuilt below does too)
        assert s["mla"]["settings"]["equalize_latent"] == (kv_dtype == "int8")
    ids = np.random.default_rng(7).integers(3, 128, (1, PROMPT))
    gen = open_onnxruntime(out)
    got = gen.generate(ids, None, STEPS, keep_logits=True)
    referee = TieReferee(dict(zip(got.compaction_steps, got.kept_positions, strict=True)), 1e-5)
    dec = load_reference_model({"settings": s}, hf)
    ref = generate(dec, torch.from_numpy(ids), press=_press(press), window=WINDOW, chunk=CHUNK, max_new_tokens=STEPS,
                   forced_tokens=got.tokens, keep_logits=True, track_kept=True, tie_break=referee,
                   capacity=None if press is not None else s["capacities"][0], kv_dtype=kv_dtype)
    assert ref.compaction_steps == got.compaction_steps
    assert (len(got.compaction_steps) >= 5) == (press is not None)
    for step, a, b in zip(got.compaction_steps, ref.kept_positions, got.kept_positions, strict=True):
        assert _kept(a) == _kept(b), f"kept positions differ at {step}"
    assert referee.refused == 0
    ref_logits = np.stack([ref.prompt_logits.numpy()] + [x.numpy() for x in ref.step_logits])
    got_logits = np.stack([got.prompt_logits] + got.step_logits)
    np.testing.assert_allclose(got_logits, ref_logits, atol=ATOL, rtol=0)
    # tokens: the export's greedy tokens are the PyTorch quantized cache's argmax at every step
    n = min(len(ref_logits), STEPS)
    np.testing.assert_array_equal(ref_logits[:n].argmax(-1).T, got.tokens[:, :n])
    # bytes: the export's buffers == the PyTorch cache's == the formula (codes 1 byte, one fp16 scale per row)
    mine, theirs = gen.resident_bytes(), ref.resident_bytes
    formula = CacheShape.from_export(s).resident_bytes_at(PROMPT + STEPS)
    for kind in ("kv", "scales"):
        assert mine[kind] == theirs[kind] == formula[kind], kind
    assert (mine["scales"] > 0) == (kv_dtype in ("int8", "fp8"))
    elem = {"int8": 1, "fp8": 1, "fp16": 2}[kv_dtype]
    width = sum(ly["key_dim"] + ly["value_dim"] for ly in s["graphs"]["layers"])
    heads = s["graphs"]["layers"][0]["heads"]
    assert mine["kv"] == s["capacities"][0] * heads * width * elem
    if mla and kv_dtype in ("int8", "fp8") and ops == "custom":
        _assert_latent_codes_read_by_the_node(out, s, kv_dtype)
    if kv_dtype in ("int8", "fp8"):  # the step's new rows quantized in one chain per tensor, not one per layer
        import onnx

        assert s["num_layers"] >= 2
        for name in ("decode", "prefill"):
            g = onnx.load(str(out / s["graphs"][name]["file"]), load_external_data=False).graph
            rounds = [n for n in g.node if n.op_type == "Round"]
            assert 1 <= len(rounds) <= 2, (name, len(rounds))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_new_rows_encoded_together_equal_each_layer_encoded_alone(kv_dtype):
    """The graphs encode the layers' new rows of one width together (kvexport.export.graphs._CacheGraph.encode_rows):
    the codes and scales equal kvexport.cache.quant.encode of each layer's rows alone, bit for bit, for layers of
    different head counts and widths (an MLA rewrite's per-layer ranks) and width 0 (an MLA cache's values)."""
    from types import SimpleNamespace

    from kvexport.cache.formats import kv_format
    from kvexport.cache.quant import encode
    from kvexport.export.graphs import _CacheGraph

    g = torch.Generator().manual_seed(3)
    shapes = [(2, 16), (2, 24), (3, 16), (2, 0), (2, 16), (1, 24)]  # (heads, width) per layer
    rows = [torch.randn(2, h, 5, d, generator=g) * (i + 1) for i, (h, d) in enumerate(shapes)]
    rows[1][0, 1, 2] = 0.0  # an all-zero row
    fmt = kv_format(kv_dtype)
    got = _CacheGraph.encode_rows(SimpleNamespace(fmt=fmt), rows)
    for r, (codes, scale) in zip(rows, got, strict=True):
        want_codes, want_scale = encode(r, fmt)
        assert codes.shape == r.shape and torch.equal(codes, want_codes)
        assert (scale is None) == (want_scale is None) == (r.shape[-1] == 0)
        if scale is not None:
            assert torch.equal(scale, want_scale)


def _assert_latent_codes_read_by_the_node(out, settings, kv_dtype):
    """The decode and prefill graphs hand each layer's uint8 latent input, as it is, to a version-2 LatentAttention
    node with its float16 scales: nothing else reads the codes, so no Cast / DequantizeLinear / Gather makes a float
    copy of the cache outside the node."""
    import onnx
    from onnx import helper

    from kvexport.cache.formats import FORMATS

    for name in ("decode", "prefill"):
        g = onnx.load(str(out / settings["graphs"][name]["file"]), load_external_data=False).graph
        types = {i.name: i.type.tensor_type.elem_type for i in g.input}
        nodes = [n for n in g.node if n.domain == "kvexport" and n.op_type == "LatentAttention"]
        assert len(nodes) == settings["num_layers"]
        assert not [n for n in g.node if n.op_type in ("DequantizeLinear", "QuantizeLinear")]
        for i in range(settings["num_layers"]):
            assert types[f"k_{i}"] == onnx.TensorProto.UINT8 and types[f"ks_{i}"] == onnx.TensorProto.FLOAT16
            readers = [n for n in g.node if f"k_{i}" in n.input]
            assert len(readers) == 1 and readers[0] in nodes, [(n.op_type, n.name) for n in readers]
            node = readers[0]
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert list(node.input).index(f"k_{i}") == 1 and len(node.input) == 6
            assert attrs["plugin_version"] == b"2" and attrs["latent_format"] == FORMATS[kv_dtype].code


@pytest.mark.parametrize("bad", ["int4", "float8", "FP8", "e4m3", ""])
def test_export_refuses_bad_kv_dtype_in_one_line(tiny_models, tmp_path, bad):
    hf = tiny_models("llama")
    with pytest.raises(BadUsage) as e:
        export_model(hf, tmp_path / "x", press=_press("knorm"), window=WINDOW, chunk=CHUNK, kv_dtype=bad)
    msg = str(e.value)
    assert "\n" not in msg and repr(bad) in msg and "fp32, fp16, bf16, int8, fp8" in msg
    assert not (tmp_path / "x").exists()


def test_generate_refuses_bad_kv_dtype_in_one_line(tiny_models):
    from kvexport.models.decoder import Decoder

    dec = Decoder.from_hf(tiny_models("llama"))
    with pytest.raises(BadUsage) as e:
        generate(dec, torch.ones(1, 4, dtype=torch.long), kv_dtype="int4")
    assert "\n" not in str(e.value) and "'int4'" in str(e.value)


def test_quantized_growing_past_is_refused(tiny_models, tmp_path):
    """--dynamic-cache is the growing-past baseline in the export's dtype: a quantized cache needs a static one."""
    with pytest.raises(BadUsage, match="needs a static cache") as e:
        export_model(tiny_models("llama"), tmp_path / "x", dynamic_cache=True, kv_dtype="int8")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("latent_type", ["uint8", "float"])
def test_version_2_latent_attention_signature_is_checked_for_tensorrt(latent_type):
    """A LatentAttention reading a quantized latent itself (op version 2): op_support accepts uint8 codes with
    their float16 scales and names a node whose codes are typed as floats."""
    import onnx
    from onnx import TensorProto, helper

    from kvexport import ops
    from kvexport.tensorrt.op_support import check_model

    vi, F = helper.make_tensor_value_info, TensorProto.FLOAT
    lt = TensorProto.UINT8 if latent_type == "uint8" else F
    node = ops.make_node("LatentAttention", ["q", "latent", "qp", "lp", "new", "ls"], ["out"], name="planted_la",
                         rank=4, scale=0.5, latent_format=1)
    g = helper.make_graph([node], "g", [vi("q", F, [1, 2, 1, 6]), vi("latent", lt, [1, 5, 6]),
                                        vi("qp", TensorProto.INT64, [1, 1]), vi("lp", TensorProto.INT64, [1, 5]),
                                        vi("new", F, [1, 1, 6]), vi("ls", TensorProto.FLOAT16, [1, 5])],
                          [vi("out", F, [1, 2, 1, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ops.OPSET),
                                            helper.make_opsetid(ops.DOMAIN, ops.OP_VERSION)])
    m.functions.extend(ops.function_protos(m))
    ops.register_schemas()
    problems = check_model(m).problems
    if latent_type == "uint8":
        onnx.checker.check_model(m, full_check=True)
        assert problems == []
    else:
        assert problems and {p.node for p in problems} == {"planted_la"}
        assert all("uint8 codes go with latent_format 1 / 2" in p.reason for p in problems)


def test_validate_compares_a_quantized_export_with_the_same_format_and_reports_its_fp32_twin(tiny_models, tmp_path):
    """``validate`` runs the PyTorch reference in the export's kv_dtype (an fp32 reference would be ~1e-2 away) and,
    for a lossy format, adds the int8 cache against its fp32 twin (two independent generate runs)."""
    from kvexport.export.fidelity import FidelitySettings
    from kvexport.export.reference import reference_kwargs
    from kvexport.export.validation import validate

    hf = tiny_models("llama")
    out = export_model(hf, tmp_path / "x", press=_press("knorm"), window=WINDOW, chunk=CHUNK, kv_dtype="int8")
    s = verify_manifest(out)["settings"]
    assert reference_kwargs(s, _press("knorm"))["kv_dtype"] == "int8"
    rep = validate(out, prompts=[PROMPT], steps=STEPS, model=hf, write=False,
                   fidelity_settings=FidelitySettings(sequences=2, scored=8, prefix=2 * BUDGET, recall=0))
    pair = rep["pairs"]["pytorch~onnxruntime"]
    assert pair["passed"] and pair["max_abs_logit_error"] < ATOL
    tw = rep["twin"]
    assert tw["kv_dtype"] == "int8" and tw["windows"] == 2 and tw["scored_tokens"] == 16
    # the twin's figures from runs made here: fp32 greedy tokens forced into the int8 cache
    from kvexport.export.fidelity import _windows, eval_stream

    dec = load_reference_model({"settings": s}, hf)
    stream, _ = eval_stream(None, None, 0, int(s["vocab_size"]), 2 * BUDGET + 9)
    ids = torch.from_numpy(_windows(stream, 2, 2 * BUDGET + 9)[:, : 2 * BUDGET])
    kw = dict(window=WINDOW, chunk=CHUNK, max_new_tokens=8, keep_logits=True)
    la, lb = [], []
    for i in range(ids.shape[0]):  # one window at a time, as the twin runs them (a batch rounds differently)
        a = generate(dec, ids[i : i + 1], press=_press("knorm"), kv_dtype="fp32", **kw)
        b = generate(dec, ids[i : i + 1], press=_press("knorm"), kv_dtype="int8", forced_tokens=a.tokens, **kw)
        la.append(torch.stack([a.prompt_logits, *a.step_logits], 1))
        lb.append(torch.stack([b.prompt_logits, *b.step_logits], 1))
    la, lb = torch.cat(la), torch.cat(lb)
    assert tw["next_token_agreement"] == pytest.approx(float((la.argmax(-1) == lb.argmax(-1)).float().mean()))
    assert tw["max_abs_logit_diff"] == pytest.approx(float((la - lb).abs().max()), rel=1e-5)
    assert 0 < tw["max_abs_logit_diff"] and tw["cache_bytes"]["int8"] < tw["cache_bytes"]["fp32"]
    # fp32 / fp16-in-fp16 caches are lossless: no twin
    from kvexport.export.twin import is_lossy

    assert not is_lossy("fp32", "fp32") and not is_lossy("fp16", "fp16") and is_lossy("fp16", "fp32")
    assert is_lossy("int8", "fp16") and not is_lossy(None, "fp32")
