# SPDX-License-Identifier: Apache-2.0
"""The exporter holds the weights once: its graphs' initializers are the module's own memory, and the weights
reach weights.data tensor by tensor without ever being serialized into a proto.

Structural checks on a tiny model (fast): every large initializer the exporter hands to :class:`SharedWeights`
lies inside a parameter's memory (the module's tensor or a transposed view of it, not a copy), every large
initializer is an external reference by the time the graph becomes a proto, and weights.data holds exactly the
parameters' bytes. A memory probe on a 285 MB model (slow) measures the high-water mark of ``export_model``
against the weight bytes, in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _param_ranges(dec) -> list[tuple[int, int]]:
    return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in dec.parameters()]


def _address(t) -> int:
    raw = t.raw
    return raw.data_ptr() if isinstance(raw, torch.Tensor) else int(raw.__array_interface__["data"][0])


def test_initializers_are_the_parameters_and_never_serialized(tiny_models, tmp_path, monkeypatch):
    import onnx
    import onnx_ir as ir

    from kvexport.export import export_model
    from kvexport.export import onnx_graph as ex
    from kvexport.models.decoder import Decoder

    dec = Decoder.from_hf(tiny_models("qwen3", head_dim=32))  # q/k norms, untied head
    ranges = _param_ranges(dec)
    handed: list[tuple[str, bool, bool]] = []  # (name, inside a parameter, floating point)
    serialized_large: list[str] = []
    externalize, serialize = ex.SharedWeights.externalize, ir.serde.serialize_model

    def spy_externalize(self, model):
        for name, v in model.graph.initializers.items():
            t = v.const_value
            if t is not None and t.nbytes >= ex.EXTERNAL_MIN_BYTES:
                a = _address(t)
                handed.append((name, any(lo <= a < hi for lo, hi in ranges), t.dtype.is_floating_point()))
        return externalize(self, model)

    def spy_serialize(model):
        serialized_large.extend(n for n, v in model.graph.initializers.items()
                                if v.const_value is not None and v.const_value.nbytes >= ex.EXTERNAL_MIN_BYTES
                                and not isinstance(v.const_value, ir.ExternalTensor))
        return serialize(model)

    monkeypatch.setattr(ex.SharedWeights, "externalize", spy_externalize)
    monkeypatch.setattr(ir.serde, "serialize_model", spy_serialize)
    out = export_model(dec, tmp_path / "x", max_positions=256)  # full static cache: prefill and decode
    floats = [h for h in handed if h[2]]
    # every weight matrix is a parameter (or a view of one), in both graphs
    assert len(floats) >= 2 * 7 * dec.spec.num_layers and all(inside for _, inside, _ in floats), \
        [n for n, inside, _ in floats if not inside]
    assert not serialized_large
    for g in ("prefill", "decode"):
        m = onnx.load(str(out / f"{g}.onnx"), load_external_data=False)
        assert all(len(t.raw_data) < ex.EXTERNAL_MIN_BYTES for t in m.graph.initializer)
    # the file holds each parameter's bytes once (weights as the graphs use them: transposed where MatMul reads them)
    params = {id(p): p for p in dec.parameters()}.values()
    big = sum(p.numel() * 4 for p in params if p.numel() * 4 >= ex.EXTERNAL_MIN_BYTES)
    stored = (out / ex.WEIGHTS_FILE).stat().st_size
    assert big <= stored <= big + ex.WEIGHT_ALIGN * len(floats) + 64 * 1024  # + a few computed constants


def test_mla_weights_are_stored_in_the_shape_they_are_read(tiny_models, tmp_path):
    """MLA reshapes ``kv_b_proj`` per head and slices it into its key and value halves: the export stores the
    halves (the same bytes, once), so that no graph reshapes or slices a stored weight, which onnxruntime would fold
    into a copy of its own in every session."""
    import onnx

    from kvexport.export import export_model
    from kvexport.export import onnx_graph as ex
    from kvexport.mla.config import MLASettings
    from kvexport.mla.rewrite import rewrite_to_mla
    from kvexport.models.decoder import Decoder

    dec = rewrite_to_mla(Decoder.from_hf(tiny_models("qwen3", head_dim=32)), MLASettings(kv_rank=16, rope_dim=4))
    out = export_model(dec, tmp_path / "x", chunk=8, max_positions=128)
    for g in ("prefill", "decode"):
        m = onnx.load(str(out / f"{g}.onnx"), load_external_data=False)
        stored = {t.name for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
        # no weight-only Reshape or Slice left, which onnxruntime would fold into a per-session copy
        assert not [n.name for n in m.graph.node if n.op_type in ("Reshape", "Slice") and n.input[0] in stored]
    params = [p for p in {id(p): p for p in dec.parameters()}.values() if p.numel() * 4 >= ex.EXTERNAL_MIN_BYTES]
    big = sum(p.numel() * 4 for p in params)
    kv_b = sum(layer.self_attn.kv_b_proj.weight.numel() * 4 for layer in dec.layers)
    stored = (out / ex.WEIGHTS_FILE).stat().st_size
    # kv_b_proj once, not twice; at most a few small unused parameters left out, a few computed constants added
    assert big - 4096 <= stored <= big + ex.WEIGHT_ALIGN * len(params) + 4096 < big + kv_b // 2, (stored, big, kv_b)


def test_tensor_bytes_are_what_onnx_stores():
    """The bytes written for a tensor (a view of its memory where possible) equal onnx_ir's own serialization."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter._core import TorchTensor

    from kvexport.export.onnx_graph import _tensor_bytes

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g)
    cases = [TorchTensor(w), TorchTensor(w.to(torch.bfloat16)), TorchTensor(w.half()),
             ir.tensor(w.numpy().T),  # a folded transpose: a non-contiguous view
             ir.tensor(np.arange(300, dtype=np.int64)), ir.tensor(np.arange(300) % 3 == 0)]
    for t in cases:
        assert bytes(_tensor_bytes(t)) == t.tobytes()
    view = _tensor_bytes(cases[0])
    assert np.frombuffer(view, np.float32).ctypes.data == w.data_ptr()  # no copy of a contiguous parameter


PROBE = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from kvexport.models.tiny import tiny_model
    from kvexport.models.decoder import Decoder
    from kvexport.export import export_model

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    # the exporter's own state (torch.export, onnxscript's torchlib registry: ~60 MB however large the model) is
    # built once by a first export of a tiny model, so that what is measured is what grows with the weights
    export_model(Decoder.from_hf(tiny_model("llama")), sys.argv[1] + "-warm", max_positions=64, chunk=16)
    dec = Decoder.from_hf(tiny_model("llama", vocab_size=8192, hidden_size=1024, layers=4, heads=8, kv_heads=4,
                                     intermediate_size=4096, tie_word_embeddings=True))
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in dec.parameters()}.values())
    largest = max(p.numel() * p.element_size() for p in dec.parameters())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    before = status("VmRSS")
    export_model(dec, sys.argv[1], max_positions=512)
    print(json.dumps({"weights": weights, "largest": largest, "before": before, "peak": status("VmHWM")}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_export_peak_memory_is_bounded_by_the_weights(tmp_path):
    """A 71M-parameter model (285 MB fp32, 4 layers): export_model's high-water mark above the RSS it starts from
    (the model already in memory, the exporter's libraries warmed up) stays under 0.25 x the weight bytes: a
    tensor made contiguous at a time (the largest: the tied embedding the head reads transposed, 34 MB = 0.12 x)
    plus the tracer's state and what the allocator keeps, never a second copy of the weights (the proto-based
    exporter this replaced peaked at 4.5 x above it; measured 2026-12-01: 0.18 x)."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["weights"] > 250e6 and m["largest"] < 0.15 * m["weights"]
    assert (m["peak"] - m["before"]) < 0.25 * m["weights"], m
