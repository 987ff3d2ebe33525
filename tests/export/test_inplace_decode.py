# SPDX-License-Identifier: Apache-2.0
"""The in-place decode graph (``--inplace-decode``, ``decode_inplace.ort.onnx``): onnxruntime's GroupQueryAttention
writing the token's slot of the cache buffers the runtime binds as both input and output.

Parity is against the PyTorch library path (the Decoder with its StaticCache, ``reference_generate``) and against
the same export's standard decode graph: tokens and kept positions equal, logits within 1e-4, for every family,
a press, a sliding window, batch 2 with left padding, and the bucketed full cache. The in-place claim is checked on
the buffers (only the token's slot changes) and on the graph (every capacity-sized output is declared aliased to
its input; the rest do not grow with the capacity)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kvexport.errors import BadUsage
from kvexport.export import export_model, open_onnxruntime, validate, verify_manifest
from kvexport.export.reference import load_reference_model, reference_generate
from kvexport.export.source import press_from_dict
from kvexport.presses import make_press
from kvexport.runtime import Stream
from tests.conftest import FAMILIES, FAMILY_IDS

STEPS = 20


def _snapkv(budget=12):
    return make_press("snapkv", budget=budget, window_size=4)


def _both(out, ids, mask=None, steps=STEPS):
    """The export run with its in-place graph and with its standard decode graph."""
    a = open_onnxruntime(out, providers=["CPUExecutionProvider"])
    b = open_onnxruntime(out, providers=["CPUExecutionProvider"], inplace=False)
    assert a.inplace and not b.inplace and a.decode_graph == "decode_inplace"
    return a.generate(ids, mask, steps, keep_logits=True), b.generate(ids, mask, steps, keep_logits=True)


def _same(x, y, atol=1e-4):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    assert x.compactions == y.compactions
    assert max(np.abs(p - q).max() for p, q in zip(x.step_logits, y.step_logits, strict=True)) <= atol
    for kx, ky in zip(x.kept_positions, y.kept_positions, strict=True):
        for lx, ly in zip(kx, ky, strict=True):
            np.testing.assert_array_equal(lx, ly)


CASES = [pytest.param(f, e, id=i) for (f, e), i in zip(FAMILIES, FAMILY_IDS, strict=True)] + [
    pytest.param("mistral", {"sliding_window": 10}, id="mistral-window10"),
    pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1},
                 id="qwen2-window-layer1"),
]


@pytest.mark.parametrize("family,extra", CASES)
def test_inplace_decode_matches_pytorch_and_the_standard_graph(tiny_models, tmp_path, family, extra):
    hf = tiny_models(family, **extra)
    out = export_model(hf, tmp_path / "x", press=_snapkv(), window=4, chunk=8, inplace_decode=True)
    s = verify_manifest(out)["settings"]
    assert s["inplace_decode"] and (out / "decode_inplace.ort.onnx").is_file()
    ids = np.random.default_rng(1).integers(3, 128, (1, 29))
    inpl, std = _both(out, ids)
    assert inpl.compactions > 0
    _same(inpl, std)
    ref = reference_generate(load_reference_model({"settings": s}, hf), s, press_from_dict(s["press"]), ids,
                             np.ones_like(ids), STEPS)
    np.testing.assert_array_equal(inpl.tokens, ref.tokens.numpy())
    assert inpl.compactions == ref.compactions
    # validate (PyTorch vs the export as OrtGenerator runs it: the in-place graph) passes its fp32 tolerances
    pair = validate(out, steps=STEPS, model=hf)["pairs"]["pytorch~onnxruntime"]
    assert pair["passed"] and pair["max_abs_logit_error"] <= 1e-4
    assert pair["token_agreement"] == 1.0 and pair["index_agreement"] == 1.0


def test_batch_with_left_padding_and_full_cache(tiny_models, tmp_path):
    """Padding slots (position -1 inside [0, fill)) are masked by the bias; the bucketed full cache (dynamic
    capacity axis) decodes in place and grows its bucket."""
    hf = tiny_models("llama")
    ids = np.random.default_rng(2).integers(3, 128, (2, 21))
    mask = np.ones_like(ids)
    mask[1, :7] = 0
    out = export_model(hf, tmp_path / "p", press=_snapkv(), window=4, chunk=8, batch=2, inplace_decode=True)
    _same(*_both(out, ids, mask))
    full = export_model(hf, tmp_path / "f", press="none", chunk=8, max_positions=600, inplace_decode=True)
    assert verify_manifest(full)["settings"]["dynamic_capacity"]
    long = np.random.default_rng(3).integers(3, 128, (1, 250))
    inpl, std = _both(full, long, steps=12)  # 250 + 12 tokens: the 256-slot bucket doubles to 512
    _same(inpl, std)
    g = open_onnxruntime(full, providers=["CPUExecutionProvider"])
    g.generate(long, None, 12)
    assert g.cache["k_0"].shape[2] == 512


def test_the_step_writes_one_slot_and_outputs_are_declared_aliases(tiny_models, tmp_path):
    hf = tiny_models("qwen3", head_dim=32)
    shapes = {}
    for budget in (12, 40):
        out = export_model(hf, tmp_path / f"b{budget}", press=_snapkv(budget), window=4, chunk=8,
                           inplace_decode=True)
        g = verify_manifest(out)["settings"]["graphs"]["decode_inplace"]
        m = onnx.load(str(out / g["file"]), load_external_data=False)
        dims = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in m.graph.output}
        ins = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
        assert set(g["in_place"]) == {n for n in dims if "_present_" in n}
        for o, i in g["in_place"].items():
            assert dims[o] == ins[i]  # the present output is its input's buffer
        shapes[budget] = {n: d for n, d in dims.items() if n not in g["in_place"]}
        assert {n.op_type for n in m.graph.node if n.domain == "com.microsoft"} == {"GroupQueryAttention"}
    assert shapes[12] == shapes[40]  # what is not written in place does not grow with the capacity

    gen = open_onnxruntime(out, providers=["CPUExecutionProvider"])
    stream = Stream(gen, np.random.default_rng(4).integers(3, 128, (1, 20)))
    stream.prefill()
    before = {n: a.copy() for n, a in gen.cache.items()}
    slots = list(gen.state.fills)
    stream.decode(5)
    for i, slot in enumerate(slots):
        for f in ("k", "v", "pos"):
            now, was = gen.cache[f"{f}_{i}"], before[f"{f}_{i}"]
            assert not np.array_equal(now[:, :, slot], was[:, :, slot])
            np.testing.assert_array_equal(np.delete(now, slot, axis=2), np.delete(was, slot, axis=2))
    assert "k_new_0" not in gen.step_out  # no step buffer for rows written in place (memory as held)
    from kvexport.cache.memory import CacheShape

    shape = CacheShape.from_export(verify_manifest(out)["settings"])
    assert gen.resident_bytes() == shape.resident_bytes_at(21, in_place=True)
    std = open_onnxruntime(out, providers=["CPUExecutionProvider"], inplace=False)
    std_stream = Stream(std, np.random.default_rng(4).integers(3, 128, (1, 20)))
    std_stream.prefill()
    assert std.resident_bytes() == shape.resident_bytes_at(21)
    assert shape.resident_bytes_at(21)["total"] - gen.resident_bytes()["total"] == shape.step_bytes(1, 1) - \
        shape.step_bytes(1, 1, rows=False) > 0


def test_fp16(tiny_models, tmp_path):
    hf = tiny_models("qwen2")
    out = export_model(hf, tmp_path / "h", press=_snapkv(), window=4, chunk=8, dtype="fp16", inplace_decode=True)
    pair = validate(out, steps=STEPS, model=hf)["pairs"]["pytorch~onnxruntime"]
    assert pair["passed"]
    inpl, std = _both(out, np.random.default_rng(5).integers(3, 128, (1, 29)))
    _same(inpl, std, atol=2e-2)


def test_refusals(tiny_models, tmp_path):
    hf = tiny_models("llama")
    cases = [(dict(mla_rank=16, rope_dim=4), "grouped-query attention"),
             (dict(kv_dtype="int8"), "--kv-dtype int8"),
             (dict(press="none", dynamic_cache=True), "--dynamic-cache")]
    for kw, what in cases:
        kw = {"press": _snapkv(), "window": 4, "chunk": 8, **kw}
        with pytest.raises(BadUsage, match=what) as e:
            export_model(hf, tmp_path / "r", inplace_decode=True, **kw)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "r").exists()
    plain = export_model(hf, tmp_path / "plain", press=_snapkv(), window=4, chunk=8)
    assert not open_onnxruntime(plain, providers=["CPUExecutionProvider"]).inplace
    with pytest.raises(BadUsage, match="--inplace-decode"):
        open_onnxruntime(plain, providers=["CPUExecutionProvider"], inplace=True)


def test_tensorrt_skips_the_onnxruntime_only_graph(tiny_models, tmp_path):
    from kvexport.tensorrt.engine import find_onnx_graphs

    out = export_model(tiny_models("llama"), tmp_path / "x", press=_snapkv(), window=4, chunk=8, inplace_decode=True)
    names = [p.name for p in find_onnx_graphs(out)]
    assert "decode.onnx" in names and "decode_inplace.ort.onnx" not in names
