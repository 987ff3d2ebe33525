# SPDX-License-Identifier: Apache-2.0
"""A decode step reads an int8 / fp8 cache by its codes (kvexport.models.attention.reads_codes): the rows' scales
go onto the logits and the probabilities, not onto every key and value. Checked against the softmax written out
in NumPy (float64) over the dequantized cache, and in the exported decode graph, which must carry no
per-element scale multiplication of the cache while the prefill graph still does."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from kvexport.cache.formats import kv_format
from kvexport.cache.quant import QuantizedRows, dequantize, quantize
from kvexport.models.attention import attention, reads_codes


def _numpy_attention(q, k, v, pos_k, q_pos, scaling):
    """Grouped softmax attention in float64 over keys visible by the position rule (0 <= pos_k <= pos_q)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, T, D = q.shape
    Hc = k.shape[1]
    out = np.zeros((B, Hq, T, v.shape[-1]))
    for b in range(B):
        for h in range(Hq):
            c = h // (Hq // Hc)
            for t in range(T):
                seen = (pos_k[b, c] >= 0) & (pos_k[b, c] <= q_pos[b, t])
                lg = k[b, c][seen] @ q[b, h, t] * scaling
                p = np.exp(lg - lg.max())
                out[b, h, t] = p @ v[b, c][seen] / p.sum()
    return out


def _case(fmt_name, S=700, T=1, Hq=6, Hc=2, D=64, seed=0, B=1):
    """B rows; with B > 1 each row has its own fill (rows of a server's bank: the later ones shorter, their tail
    slots empty) and its own position."""
    g = torch.Generator().manual_seed(seed)
    fmt = kv_format(fmt_name)
    k_f, v_f = torch.randn(B, Hc, S, D, generator=g) * 2, torch.randn(B, Hc, S, D, generator=g)
    (kc, ks), (vc, vs) = quantize(k_f, fmt), quantize(v_f, fmt)
    pos = torch.arange(S).expand(B, Hc, S).clone()
    fills = [S - 7 - 150 * b for b in range(B)]
    for b, f in enumerate(fills):
        pos[b, :, f:] = -1  # empty slots
    q = torch.randn(B, Hq, T, D, generator=g)
    k_new, v_new = torch.randn(B, Hc, T, D, generator=g), torch.randn(B, Hc, T, D, generator=g)
    q_pos = torch.stack([torch.arange(f, f + T) for f in fills])
    pos_new = q_pos[:, None, :].expand(B, Hc, T)
    return fmt, q, (kc, ks), (vc, vs), pos, k_new, v_new, pos_new, q_pos


@pytest.mark.parametrize("fmt_name", ["int8", "fp8"])
@pytest.mark.parametrize("Hq, Hc, D, B", [(6, 2, 64, 1), (8, 1, 64, 1), (4, 4, 128, 1), (9, 3, 64, 3)],
                         ids=["gqa", "mqa", "mha-d128", "batch3"])
def test_decode_reads_codes_and_matches_the_dequantized_softmax(fmt_name, Hq, Hc, D, B):
    fmt, q, (kc, ks), (vc, vs), pos, k_new, v_new, pos_new, q_pos = _case(fmt_name, Hq=Hq, Hc=Hc, D=D, B=B)
    kq, vq = QuantizedRows(kc, ks, fmt), QuantizedRows(vc, vs, fmt)
    assert reads_codes(q, kq, vq, k_new)
    scaling = D**-0.5
    with torch.no_grad():
        got = attention(q, kq, vq, pos, k_new, v_new, pos_new, q_pos, scaling)
    k_all = torch.cat([dequantize(kc, ks, fmt, torch.float32), k_new], 2)
    v_all = torch.cat([dequantize(vc, vs, fmt, torch.float32), v_new], 2)
    want = _numpy_attention(q, k_all, v_all, torch.cat([pos, pos_new], 2).numpy(), q_pos.numpy(), scaling)
    # int8 takes its offset off after the products (q . c - 128 sum(q)): float32 cancellation, measured 3.9e-6 on
    # outputs of magnitude ~0.3 (the codes' own rounding is 1/254 of a row's largest value)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5)


def test_prefill_and_fp16_dequantize_first():
    """A chunk's queries (G x T >= D) and a float16 model read the dequantized cache, as before: the same values
    as attention handed the dequantized tensors, bit for bit."""
    fmt, q, (kc, ks), (vc, vs), pos, k_new, v_new, pos_new, q_pos = _case("int8", T=40)
    kq, vq = QuantizedRows(kc, ks, fmt), QuantizedRows(vc, vs, fmt)
    assert not reads_codes(q, kq, vq, k_new)
    with torch.no_grad():
        got = attention(q, kq, vq, pos, k_new, v_new, pos_new, q_pos, 0.125)
        want = attention(q, kq.dequantize(torch.float32), vq.dequantize(torch.float32), pos, k_new, v_new, pos_new,
                         q_pos, 0.125)
    assert torch.equal(got, want)
    fmt, q, (kc, ks), (vc, vs), pos, k_new, v_new, pos_new, q_pos = _case("int8")
    assert not reads_codes(q.half(), QuantizedRows(kc, ks, fmt), QuantizedRows(vc, vs, fmt), k_new.half())


def _dequant_muls(path) -> int:
    """Mul nodes that scale a cache input's codes element by element (Cast -> Sub -> Mul, or Cast -> Gather ->
    Mul for fp8) in an exported graph."""
    m = onnx.load(str(path), load_external_data=False)
    cache_inputs = {i.name for i in m.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.UINT8}
    made = {o: n for n in m.graph.node for o in n.output}

    def from_codes(name, depth=0):
        n = made.get(name)
        if n is None:
            return name in cache_inputs
        return depth < 3 and n.op_type in ("Cast", "Sub", "Gather", "Reshape") and any(
            from_codes(i, depth + 1) for i in n.input)

    return sum(1 for n in m.graph.node if n.op_type == "Mul" and any(from_codes(i) for i in n.input))


def test_exported_decode_graph_multiplies_no_cached_value(tmp_path):
    """The decode graph of an int8-cache export carries no per-element scale multiplication of the cache (the
    pass it saves per step), the prefill graph keeps one per layer and K / V; and onnxruntime's greedy tokens and
    logits equal the PyTorch library path's (the same arithmetic)."""
    from kvexport.export import export_model
    from kvexport.models.decoder import Decoder
    from kvexport.models.tiny import tiny_model
    from kvexport.presses import make_press
    from kvexport.runtime import open_onnxruntime

    dec = Decoder.from_hf(tiny_model("llama", vocab_size=512, hidden_size=256, intermediate_size=256, heads=4,
                                     kv_heads=2, layers=2))
    out = export_model(dec, tmp_path / "x", press=make_press("snapkv", budget=1100), window=16, chunk=32,
                       kv_dtype="int8")
    assert _dequant_muls(out / "decode.onnx") == 0
    assert _dequant_muls(out / "prefill.onnx") == 2 * len(dec.layers)
    ids = np.random.default_rng(3).integers(3, 500, size=(1, 150))
    got = open_onnxruntime(out, threads=1).generate(ids, np.ones_like(ids), 12)
    from kvexport.generation import generate

    want = generate(dec, torch.as_tensor(ids), max_new_tokens=12, press=make_press("snapkv", budget=1100),
                    window=16, chunk=32, kv_dtype="int8")
    assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
