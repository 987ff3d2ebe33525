# SPDX-License-Identifier: Apache-2.0
"""kvexport's graphs skip torch.onnx's full decomposition pass when the few ATen ops torchlib does not translate
(``.to(dtype)``, ``&``, ``1 - x``) can be rewritten in place (kvexport.export.onnx_graph): the ONNX graph then
computes what PyTorch computes, eagerly (onnxruntime against the module itself), and a graph with any other such
op goes through torch's own pass, as before."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport.export import onnx_graph


class Rewritable(torch.nn.Module):
    """Each op the rewrite covers, on dtypes where a wrong rewrite would show: a float16 round trip, a boolean
    and, and ``c - x`` with a fractional c."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1.5, 2.5, 64 * 64).reshape(64, 64))

    def forward(self, x, y):
        both = (x > 0) & (y < 0.25)
        h = x.to(torch.float16).to(torch.float32) @ self.w
        return torch.where(both, 0.75 - h, h * 2), (1 - y).to(torch.int32)


class NeedsDecomposition(Rewritable):
    def forward(self, x, y):  # torch.square has no torchlib translation: only the full pass handles it
        a, b = super().forward(x, y)
        return torch.square(a), b


def _run(module, path, monkeypatch):
    calls = []
    from torch.onnx._internal.exporter import _fx_passes

    original = _fx_passes.decompose_with_registry

    def count(ep, registry):
        calls.append(1)
        return original(ep, registry)

    monkeypatch.setattr(_fx_passes, "decompose_with_registry", count)  # what the light pass falls back to
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    y = torch.rand(3, 64, generator=torch.Generator().manual_seed(1))
    weights = onnx_graph.SharedWeights(path.parent)
    proto, used = onnx_graph._export_graph(module.eval(), (x, y), ["x", "y"], ["a", "b"], True, weights)
    weights.save(proto, path, used)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy(), "y": y.numpy()})
    with torch.no_grad():
        want = [t.numpy() for t in module(x, y)]
    return got, want, len(calls)


def test_the_rewrite_computes_what_pytorch_computes(tmp_path, monkeypatch):
    got, want, fell_back = _run(Rewritable(), tmp_path / "g.onnx", monkeypatch)
    assert fell_back == 0  # the full pass never ran
    assert got[1].dtype == np.int32 and np.array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-5)
    assert np.abs(want[0]).max() > 1  # real values, not zeros


def test_any_other_untranslated_op_takes_torchs_own_pass(tmp_path, monkeypatch):
    got, want, fell_back = _run(NeedsDecomposition(), tmp_path / "g.onnx", monkeypatch)
    assert fell_back == 1
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("alpha", [1, 2])
def test_rsub_with_alpha_other_than_one_is_not_rewritten(alpha):
    from torch.onnx._internal.exporter import _decomp, _registration

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.rsub(x, 3.0, alpha=alpha)

    ep = torch.export.export(M(), (torch.randn(4),), strict=False)
    registered = set(_decomp.get_onnx_implemented_overloads(_registration.ONNXRegistry.from_torchlib()))
    assert onnx_graph._rewrite_to_registered(ep, registered) is (alpha == 1)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.rsub.Scalar in targets) is (alpha != 1)
    if alpha == 1:
        x = torch.randn(4)
        torch.testing.assert_close(ep.module()(x), 3.0 - x)


def test_a_growing_past_takes_torchs_own_pass(tiny_models, tmp_path, monkeypatch):
    """The growing-past graph computes its key length from two symbolic sizes (past + seq): left to torch's pass
    (the rewrite alone translated it as past, and onnxruntime refused the Reshape), its export decodes what
    transformers' greedy ``generate`` decodes."""
    from torch.onnx._internal.exporter import _fx_passes

    from kvexport.export import export_model
    from kvexport.runtime import open_onnxruntime

    original, calls = _fx_passes.decompose_with_registry, []
    monkeypatch.setattr(_fx_passes, "decompose_with_registry", lambda ep, reg: calls.append(1) or original(ep, reg))
    hf = tiny_models("llama")
    out = export_model(hf, tmp_path / "grow", press=None, dynamic_cache=True, force=True)
    assert calls == [1]
    ids = torch.randint(3, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    got = open_onnxruntime(out).generate(ids.numpy(), np.ones((1, 40), np.int64), 6)
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 40:]
    assert got.tokens[0].tolist() == want.tolist()
