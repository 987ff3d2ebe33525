# SPDX-License-Identifier: Apache-2.0
"""MLA's per-head products (absorbed queries, RoPE queries, absorbed output) are plain MatMuls over weights stored
in the layout they are read in (issue 20: onnxruntime's Einsum permuted the weight on every call, 56 % of a 385M
model's decode step), and they equal the products written out in NumPy from the module's own weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from kvexport.export import export_model
from kvexport.export import onnx_graph as ex
from kvexport.mla.config import MLASettings
from kvexport.mla.rewrite import rewrite_to_mla
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model


def _mla(family: str):
    torch.manual_seed(0)
    dec = Decoder.from_hf(tiny_model(family, vocab_size=256, hidden_size=128, intermediate_size=128, heads=4,
                                     kv_heads=2, head_dim=32))
    return rewrite_to_mla(dec, MLASettings(kv_rank=40, rope_dim=16), inplace=True)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_products_equal_numpy(family):
    dec = _mla(family)
    attn = dec.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    q_pre = torch.randn(2, attn.num_heads, 3, attn.head_dim, generator=g)
    o_lat = torch.randn(2, attn.num_heads, 3, attn.kv_rank, generator=g)
    w = attn.kv_b_proj.weight.detach().numpy().reshape(attn.num_heads, 2 * attn.head_dim, attn.kv_rank)
    w_uk, w_uv = w[:, : attn.head_dim], w[:, attn.head_dim :]
    q, o = q_pre.numpy().astype(np.float64), o_lat.numpy().astype(np.float64)
    want_q = np.concatenate([np.einsum("bhtd,hdr->bhtr", q, w_uk),
                             np.einsum("bhtd,hpd->bhtp", q, attn.q_rope.detach().numpy())], axis=-1)
    want_o = np.einsum("bhtr,hdr->bhtd", o, w_uv)
    if attn.kv_b_proj.bias is not None:
        want_o = want_o + attn.kv_b_proj.bias.detach().numpy().reshape(attn.num_heads, 2, attn.head_dim)[None, :, 1, None]
    with torch.no_grad():
        np.testing.assert_allclose(attn.score_queries(q_pre).numpy(), want_q, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(attn.absorbed_out(o_lat).numpy(), want_o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("press", [None, "snapkv"])
def test_exported_products_are_matmuls_over_stored_weights(tmp_path, press):
    dec = _mla("qwen3")
    kw = dict(press=press, budget=96, window=8) if press else {}
    out = export_model(dec, tmp_path / "x", chunk=8, max_positions=256, **kw)
    w_uv_t = [ly.self_attn.w_uv().detach().transpose(-1, -2).numpy() for ly in dec.layers]
    for name in ("prefill", "decode"):
        m = onnx.load(str(out / f"{name}.onnx"))  # with its external data: the bytes weights.data holds
        inits = {t.name: t for t in m.graph.initializer}
        big = {n for n, t in inits.items() if numpy_helper.to_array(t).nbytes >= ex.EXTERNAL_MIN_BYTES}
        ops = [n.op_type for n in m.graph.node]
        assert "Einsum" not in ops, name
        for n in m.graph.node:  # nothing reshapes, slices or transposes a stored weight at run time
            if n.op_type in ("Transpose", "Reshape", "Slice", "Expand"):
                assert n.input[0] not in big, (name, n.op_type, n.input[0])
        read = [numpy_helper.to_array(inits[i]) for n in m.graph.node if n.op_type == "MatMul" for i in n.input
                if i in big]
        for i, want in enumerate(w_uv_t):  # each layer's W_UV is read as (Hq, r_kv, D), stored so, bit for bit
            assert any(a.shape == want.shape and np.array_equal(a, want) for a in read), (name, i)
