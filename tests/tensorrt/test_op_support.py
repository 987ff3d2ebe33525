# SPDX-License-Identifier: Apache-2.0
"""Every graph kvexport's exporter writes is TensorRT-parseable by construction: kvexport.tensorrt.op_support checks
each node against the ONNX-TensorRT parser's published support matrix (TensorRT 10.3 and the newest tag) and the
kvexport plugin nodes against what the plugins accept. Fresh exports of a tiny model for every exportable press,
MLA, fp16, --ops standard and the dynamic-cache baseline (so the test follows the exporter, no node list is pinned);
planted unsupported ops, types and attributes must be rejected by name."""

from __future__ import annotations

import dataclasses

import onnx
import pytest
from onnx import TensorProto, helper

from kvexport.errors import BadArtifact, BadUsage
from kvexport.export.exporter import export_model
from kvexport.presses import PRESSES, make_press
from kvexport.tensorrt import op_support
from kvexport.tensorrt.op_support import check_export_dir, check_model

_EXPORTS: dict[str, object] = {}


@pytest.fixture(scope="module")
def tiny_hf():
    from kvexport.models.tiny import tiny_model

    return tiny_model("llama", layers=1, hidden_size=32, heads=2, kv_heads=1, intermediate_size=64, vocab_size=64,
                      max_positions=256)


def small_press(name: str):
    """The press with budget 16 and, where it has one, an observation window of 4 (it must fit in the budget)."""
    fields = {f.name for f in dataclasses.fields(PRESSES[name])}
    return make_press(name, budget=16, **({"window_size": 4} if "window_size" in fields else {}))


PRESS_NAMES = list(PRESSES)
#: dtype / ops spread over the presses so every combination is covered without exporting each press four times
VARIANTS = [dict(dtype="fp16" if i % 2 else "fp32", ops="standard" if i % 3 == 2 else "custom")
            for i in range(len(PRESS_NAMES))]
EXTRA = {
    "mla-knorm-fp32": dict(mla_rank=8, rope_dim=4, press="knorm"),
    "mla-snapkv-fp16": dict(mla_rank=8, rope_dim=4, press="snapkv", dtype="fp16"),
    "mla-full-cache-standard": dict(mla_rank=8, rope_dim=4, ops="standard", max_positions=64),
    "dynamic-cache": dict(dynamic_cache=True, max_positions=64),
    # quantized caches (docs/quantized.md): uint8 codes only reach TopKGather, LatentAttention version 2 and Cast
    "mla-knorm-int8": dict(mla_rank=8, rope_dim=4, press="knorm", kv_dtype="int8"),
    "mla-snapkv-fp8-fp16": dict(mla_rank=8, rope_dim=4, press="snapkv", kv_dtype="fp8", dtype="fp16"),
    "mla-full-cache-int8": dict(mla_rank=8, rope_dim=4, max_positions=64, kv_dtype="int8"),
    "mla-tova-fp8-standard": dict(mla_rank=8, rope_dim=4, press="tova", kv_dtype="fp8", ops="standard"),
    "snapkv-int8": dict(press="snapkv", kv_dtype="int8"),
    "expected-attention-fp8-fp16": dict(press="expected_attention", kv_dtype="fp8", dtype="fp16"),
}
KNOWN: dict[str, str] = {}  # exporter graphs that fail the check today, with why (strict xfail: a fix shows as XPASS)


def _export(tiny_hf, tmp_path_factory, key: str, kw: dict):
    if key not in _EXPORTS:
        kw = dict(kw)
        press = kw.pop("press", None)
        if isinstance(press, str):
            press = small_press(press)
        try:
            _EXPORTS[key] = export_model(tiny_hf, tmp_path_factory.mktemp(key) / "x", press=press, window=4, chunk=8,
                                         **kw)
        except BadUsage as e:
            _EXPORTS[key] = e
    if isinstance(_EXPORTS[key], BadUsage):
        pytest.skip(str(_EXPORTS[key]))
    return _EXPORTS[key]


def _assert_parseable(out):
    reports = check_export_dir(out)
    assert reports, f"no graphs in {out}"
    for r in reports:
        assert not r.untyped, f"{r.graph}: tensors without a type: {r.untyped[:5]}"
        assert r.ok, "\n".join(map(str, r.problems))
    return reports


@pytest.mark.parametrize("name,variant", [
    pytest.param(n, v, id=f"{n}-{v['dtype']}-{v['ops']}",
                 marks=[pytest.mark.xfail(strict=True, reason=KNOWN[n])] if n in KNOWN else [])
    for n, v in zip(PRESS_NAMES, VARIANTS, strict=True)])
def test_press_export_is_parseable(tiny_hf, tmp_path_factory, name, variant):
    out = _export(tiny_hf, tmp_path_factory, f"{name}-{variant['dtype']}-{variant['ops']}", dict(press=name, **variant))
    reports = _assert_parseable(out)
    plugin_nodes = sum(sum(r.plugin_nodes.values()) for r in reports)
    assert plugin_nodes > 0 if variant["ops"] == "custom" else plugin_nodes == 0


@pytest.mark.parametrize("key", list(EXTRA))
def test_other_exports_are_parseable(tiny_hf, tmp_path_factory, key):
    out = _export(tiny_hf, tmp_path_factory, key, EXTRA[key])
    reports = _assert_parseable(out)
    if key.startswith("mla") and EXTRA[key].get("ops", "custom") == "custom":
        assert any(r.plugin_nodes.get("LatentAttention") for r in reports)
        _assert_latent_versions(out, EXTRA[key].get("kv_dtype"))
    if EXTRA[key].get("kv_dtype") and EXTRA[key].get("press") and EXTRA[key].get("ops", "custom") == "custom":
        assert all(r.plugin_nodes.get("TopKGather") == 1 for r in reports if r.graph.startswith("compact"))


def _assert_latent_versions(out, kv_dtype):
    """A float cache keeps the version-1 node (four inputs); an int8 / fp8 one gets version 2 (six inputs)."""
    from kvexport.cache.formats import FORMATS

    quantized = kv_dtype in ("int8", "fp8")
    for name in ("decode.onnx", "prefill.onnx"):
        nodes = [n for n in onnx.load(str(out / name), load_external_data=False).graph.node
                 if n.op_type == "LatentAttention"]
        assert nodes
        for n in nodes:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["plugin_version"] == (b"2" if quantized else b"1"), name
            assert len(n.input) == (6 if quantized else 4), name
            assert attrs.get("latent_format", 0) == (FORMATS[kv_dtype].code if quantized else 0), name


# ------------------------------------------------------------------------------------------------ planted problems
@pytest.fixture(scope="module")
def decode_model(tiny_hf, tmp_path_factory):
    variant = VARIANTS[PRESS_NAMES.index("knorm")]  # reuses that test's export
    out = _export(tiny_hf, tmp_path_factory, f"knorm-{variant['dtype']}-{variant['ops']}", dict(press="knorm", **variant))
    return onnx.load(str(out / "decode.onnx"))


def _with(model, node, value_infos=()):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node.append(node)
    m.graph.value_info.extend(value_infos)
    return m


def _float_tensor(model) -> str:
    """The name of some float tensor of the graph (the output of its first MatMul)."""
    return next(n.output[0] for n in model.graph.node if n.op_type == "MatMul")


def test_planted_unsupported_op_is_named(decode_model):
    x = _float_tensor(decode_model)
    bad = _with(decode_model, helper.make_node("Unique", [x], ["planted_y"], name="planted_unique"))
    report = check_model(bad, name="decode.onnx")
    assert {(p.node, p.op) for p in report.problems} == {("planted_unique", "Unique")}
    assert {p.version for p in report.problems} == set(op_support.MATRICES)
    with pytest.raises(BadArtifact, match=r"node 'planted_unique' \(Unique\) for TensorRT 10\.3: not in the parser"):
        report.raise_if_any()


def test_planted_unsupported_type_is_named(decode_model):
    x = _float_tensor(decode_model)
    bad = _with(decode_model, helper.make_node("Cast", [x], ["planted_f64"], name="planted_cast", to=TensorProto.DOUBLE))
    problems = check_model(bad).problems
    assert problems and all(p.node == "planted_cast" for p in problems)
    assert any("output 0 (planted_f64) is f64" in p.reason for p in problems)


def test_planted_uint8_cast_to_int64_is_named(decode_model):
    """TensorRT converts uint8 only from and to float32 / float16: f32 -> u8 passes, u8 -> i64 is named."""
    x = _float_tensor(decode_model)
    m = _with(decode_model, helper.make_node("Cast", [x], ["planted_u8"], name="planted_to_u8", to=TensorProto.UINT8))
    m.graph.node.append(helper.make_node("Cast", ["planted_u8"], ["planted_i64"], name="planted_u8_to_i64",
                                         to=TensorProto.INT64))
    problems = check_model(m).problems
    assert problems and {p.node for p in problems} == {"planted_u8_to_i64"}
    assert all("casts u8 to i64: TensorRT converts uint8 only from / to f32, f16" in p.reason for p in problems)


def test_planted_restrictions_are_named(decode_model):
    x = _float_tensor(decode_model)
    k = helper.make_tensor("planted_k", TensorProto.INT64, [1], [4096])
    m = _with(decode_model, helper.make_node("TopK", [x, "planted_k"], ["v", "i"], name="planted_topk", sorted=0))
    m.graph.initializer.append(k)
    reasons = {p.reason for p in check_model(m, versions=("10.3",)).problems if p.node == "planted_topk"}
    assert reasons == {"attribute sorted = 0 (TensorRT needs 1)", "input 1 = 4096 must be below 3840"}
    axes = helper.make_node("Shape", [x], ["planted_axes"], name="shape_of_x")
    m2 = _with(decode_model, axes)
    m2.graph.node.append(helper.make_node("ReduceSum", [x, "planted_axes"], ["r"], name="planted_reduce"))
    assert any(p.node == "planted_reduce" and "must be an initializer" in p.reason for p in check_model(m2).problems)


def test_planted_plugin_type_is_named():
    """A TopKGather fed fp16 scores: the plugin takes FP32 scores only."""
    from kvexport import ops

    vi = helper.make_tensor_value_info
    node = ops.make_node("TopKGather", ["scores", "keys", "values", "positions"],
                         ["kk", "kv", "kp", "ki"], name="planted_topk_gather", k=2)
    g = helper.make_graph([node], "g", [vi("scores", TensorProto.FLOAT16, [1, 1, 4]),
                                        vi("keys", TensorProto.FLOAT16, [1, 1, 4, 2]),
                                        vi("values", TensorProto.FLOAT16, [1, 1, 4, 2]),
                                        vi("positions", TensorProto.INT64, [1, 1, 4])],
                          [vi("kk", TensorProto.FLOAT16, [1, 1, 2, 2]), vi("kv", TensorProto.FLOAT16, [1, 1, 2, 2]),
                           vi("kp", TensorProto.INT64, [1, 1, 2]), vi("ki", TensorProto.INT64, [1, 1, 2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ops.OPSET), helper.make_opsetid(ops.DOMAIN, 1)],
                          functions=ops.function_protos())
    problems = check_model(m).problems
    assert problems and {p.node for p in problems} == {"planted_topk_gather"}
    assert any("input scores (scores) is f16; the plugin takes f32" in p.reason for p in problems)
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    assert check_model(m).ok


def test_matrices_cover_the_oldest_and_newest_release():
    assert list(op_support.MATRICES) == ["10.3", "11.1"]
    for v in op_support.MATRICES:
        m = op_support.matrix(v)
        assert m.opset[0] <= 18 <= m.opset[1] and {"MatMul", "Softmax", "TopK", "Gather"} <= set(m.ops)
    assert "Attention" in op_support.matrix("11.1").ops and "Attention" not in op_support.matrix("10.3").ops


def _latent_model(latent_type, n_inputs: int, latent_format: int):
    """One LatentAttention node: q fp16 (1, 2, 1, 12), latent (1, 8, 12) of ``latent_type``, then the first
    ``n_inputs`` of (q_positions, latent_positions, new_latent, latent_scale)."""
    from kvexport import ops

    vi = helper.make_tensor_value_info
    decl = [vi("q", TensorProto.FLOAT16, [1, 2, 1, 12]), vi("latent", latent_type, [1, 8, 12]),
            vi("qp", TensorProto.INT64, [1, 1]), vi("lp", TensorProto.INT64, [1, 8]),
            vi("new", TensorProto.FLOAT16, [1, 1, 12]), vi("scale", TensorProto.FLOAT16, [1, 8])][:n_inputs]
    node = ops.make_node("LatentAttention", [d.name for d in decl], ["out"], name="planted_latent", rank=8,
                         scale=0.25, **({"latent_format": latent_format} if latent_format else {}))
    g = helper.make_graph([node], "g", decl, [vi("out", TensorProto.FLOAT16, [1, 2, 1, 8])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", ops.OPSET),
                                               helper.make_opsetid(ops.DOMAIN, ops.OP_VERSION)])


def test_latent_attention_version_2_signatures():
    """plugin_version "2" nodes (plugins/latent_attention: this step's rows, a quantized latent) pass; a quantized
    latent without its scales, or codes typed as floats, are named."""
    assert check_model(_latent_model(TensorProto.FLOAT16, 4, 0)).ok  # version 1
    assert check_model(_latent_model(TensorProto.FLOAT16, 5, 0)).ok  # float cache + new_latent
    for fmt in (1, 2):  # int8 / fp8 codes + new_latent + latent_scale
        report = check_model(_latent_model(TensorProto.UINT8, 6, fmt))
        assert report.ok, [p.reason for p in report.problems]
    no_scale = {p.reason for p in check_model(_latent_model(TensorProto.UINT8, 5, 1)).problems}
    assert any("latent_format 1 (a quantized latent) needs all 6 inputs" in r for r in no_scale), no_scale
    float_codes = {p.reason for p in check_model(_latent_model(TensorProto.FLOAT16, 6, 1)).problems}
    assert any("uint8 codes go with latent_format 1 / 2" in r for r in float_codes), float_codes
    bad_fmt = {p.reason for p in check_model(_latent_model(TensorProto.UINT8, 6, 3)).problems}
    assert any("latent_format = 3 must be an integer in [0, 2]" in r for r in bad_fmt), bad_fmt
