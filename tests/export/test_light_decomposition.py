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


@pytest.fixture
def full_passes(monkeypatch) -> list:
    """Each run of torch's full decomposition pass (what the light pass falls back to) appends to this list."""
    from torch.onnx._internal.exporter import _fx_passes

    original, calls = _fx_passes.decompose_with_registry, []
    monkeypatch.setattr(_fx_passes, "decompose_with_registry", lambda ep, reg: calls.append(1) or original(ep, reg))
    return calls


def _run(module, path, full_passes):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    y = torch.rand(3, 64, generator=torch.Generator().manual_seed(1))
    weights = onnx_graph.SharedWeights(path.parent)
    proto, used = onnx_graph._export_graph(module.eval(), (x, y), ["x", "y"], ["a", "b"], True, weights)
    weights.save(proto, path, used)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy(), "y": y.numpy()})
    with torch.no_grad():
        want = [t.numpy() for t in module(x, y)]
    return got, want, len(full_passes)


def test_the_rewrite_computes_what_pytorch_computes(tmp_path, full_passes):
    got, want, fell_back = _run(Rewritable(), tmp_path / "g.onnx", full_passes)
    assert fell_back == 0  # the full pass never ran
    assert got[1].dtype == np.int32 and np.array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-5)
    assert np.abs(want[0]).max() > 1  # real values, not zeros


def test_any_other_untranslated_op_takes_torchs_own_pass(tmp_path, full_passes):
    got, want, fell_back = _run(NeedsDecomposition(), tmp_path / "g.onnx", full_passes)
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


class SizeArithmetic(torch.nn.Module):
    """Sizes computed from two symbolic sizes (``past + seq`` slots, ``2 * n`` rows, a slice from the end), as the
    graphs with a dynamic capacity or a ragged last chunk compute them."""

    def forward(self, past, x):
        n = past.shape[2] + x.shape[2]
        k = torch.cat([past, x], dim=2)
        rows = torch.arange(n * 2).reshape(2, n).to(torch.float32)
        return k.reshape(k.shape[0], k.shape[1] * n, 4) * 2, rows[:, -x.shape[2]:].sum(-1)


def test_arithmetic_on_symbolic_sizes_is_translated_without_torchs_pass(tmp_path, full_passes):
    from torch.export import Dim
    module = SizeArithmetic().eval()
    weights = onnx_graph.SharedWeights(tmp_path)
    proto, used = onnx_graph._export_graph(module, (torch.randn(1, 3, 5, 4), torch.randn(1, 3, 7, 4)), ["past", "x"],
                                           ["k", "rows"], True, weights,
                                           dynamic_shapes={"past": {2: Dim("p", min=1, max=64)},
                                                           "x": {2: Dim("s", min=2, max=32)}})
    weights.save(proto, tmp_path / "g.onnx", used)
    assert full_passes == []
    sess = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    for p, s in ((5, 7), (9, 2), (1, 30), (64, 32)):
        past, x = torch.randn(1, 3, p, 4), torch.randn(1, 3, s, 4)
        got = sess.run(None, {"past": past.numpy(), "x": x.numpy()})
        want = module(past, x)
        assert got[0].shape == (1, 3 * (p + s), 4) and np.array_equal(got[0], want[0].numpy())
        assert np.array_equal(got[1], want[1].numpy())


def test_a_full_cache_export_takes_no_full_pass_and_decodes_what_transformers_decodes(tiny_models, tmp_path,
                                                                                      full_passes):
    """A full cache's graphs take their capacity (and the last chunk its width) as dynamic dimensions: each is
    translated without torch's pass, and the export decodes what transformers' greedy ``generate`` decodes, its
    prompt logits within fp32 rounding of transformers', for prompts inside one chunk, of one chunk and a ragged
    last chunk after full ones."""
    from kvexport.export import export_model
    from kvexport.runtime import generate, open_onnxruntime

    hf = tiny_models("qwen2")
    out = export_model(hf, tmp_path / "full", press=None, chunk=16, force=True)
    assert full_passes == []
    gen = open_onnxruntime(out)
    for n in (3, 16, 41):
        ids = torch.randint(3, hf.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        got = generate(gen, ids.numpy(), np.ones((1, n), np.int64), 6)
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        assert got.tokens[0].tolist() == want.sequences[0, n:].tolist(), n
        np.testing.assert_allclose(np.asarray(got.prompt_logits)[0], want.logits[0][0].numpy(), atol=1e-4, rtol=1e-4)


def test_a_growing_past_takes_torchs_own_pass(tiny_models, tmp_path, full_passes):
    """The growing-past graph's sizes go through ``pow`` and ``sym_not`` (shape checks of the attention mask),
    which the rewrite does not list (with them listed, onnxruntime refuses a Reshape of the translated graph): left
    to torch's pass, its export decodes what transformers' greedy ``generate`` decodes."""
    from kvexport.export import export_model
    from kvexport.runtime import open_onnxruntime

    hf = tiny_models("llama")
    out = export_model(hf, tmp_path / "grow", press=None, dynamic_cache=True, force=True)
    assert full_passes == [1]
    ids = torch.randint(3, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    got = open_onnxruntime(out).generate(ids.numpy(), np.ones((1, 40), np.int64), 6)
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 40:]
    assert got.tokens[0].tolist() == want.tolist()
