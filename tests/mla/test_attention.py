# SPDX-License-Identifier: Apache-2.0
"""latent_attention against a NumPy loop (the LatentAttention contract), and absorbed == naive on every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.mla import MLASettings, latent_attention, rewrite_to_mla, set_absorb
from kvexport.models.decoder import Decoder
from tests.conftest import FAMILIES, FAMILY_IDS


def numpy_latent_attention(q, lat, qp, lp, R, scale):
    B, H, T, _ = q.shape
    S = lat.shape[1]
    out = np.zeros((B, H, T, R))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                logit = np.array([q[b, h, t] @ lat[b, j] * scale for j in range(S)], dtype=np.float64)
                vis = np.array([0 <= lp[b, j] <= qp[b, t] for j in range(S)])
                logit = np.where(vis, logit, np.finfo(np.float32).min)
                p = np.exp(logit - logit.max())
                p /= p.sum()
                out[b, h, t] = p @ lat[b, :, :R]
    return out


def test_latent_attention_matches_numpy():
    g = torch.Generator().manual_seed(0)
    B, H, T, S, R, Dr = 2, 3, 4, 7, 5, 4
    q = torch.randn(B, H, T, R + Dr, generator=g, dtype=torch.float64)
    lat = torch.randn(B, S, R + Dr, generator=g, dtype=torch.float64)
    qp = torch.tensor([[3, 4, 5, 6], [-1, 2, 3, 4]])
    lp = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [-1, -1, 0, 1, 2, 3, -1]])  # padding and an empty slot
    out = latent_attention(q, lat, qp, lp, R, 0.3)
    ref_out = numpy_latent_attention(q.numpy(), lat.numpy(), qp.numpy(), lp.numpy(), R, 0.3)
    assert out.shape == (B, H, T, R)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-6)  # softmax runs in float32


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("q_rank", [None, 32])
def test_absorbed_equals_naive(tiny_models, family, kw, q_rank):
    """fp32, whole prompt and chunked through a cache: logits of both paths agree to 1e-5."""
    dec = Decoder.from_hf(tiny_models(family, **kw))
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=24, rope_dim=8, q_rank=q_rank))
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(30).expand(2, 30).clone()
    pos[1, :5] = -1  # left padding on row 1
    with torch.no_grad():
        outs = {}
        for absorb in (True, False):
            set_absorb(mla, absorb)
            cache = mla.new_cache(2, None, 40, 4)
            chunked = torch.cat([mla(ids[:, s : s + 10], pos[:, s : s + 10], cache) for s in (0, 10, 20)], 1)
            outs[absorb] = (mla(ids, pos), chunked)
    for i in range(2):
        assert (outs[True][i] - outs[False][i]).abs().max().item() < 1e-5
    # chunked through the latent cache == whole prompt (padding queries are never read)
    real = pos >= 0
    assert (outs[True][0][real] - outs[True][1][real]).abs().max().item() < 1e-4


def test_score_queries_shape_and_cache_layout(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=16, rope_dim=8))
    attn = mla.layers[0].self_attn
    assert (attn.cache_heads, attn.key_dim, attn.value_dim, attn.score_dim) == (1, 24, 0, 24)
    assert attn.score_rotary.offset == 16 and attn.score_rotary.dim == 8
    cache = mla.new_cache(1, None, 8, 2)
    assert cache.layers[0].k.shape == (1, 1, 10, 24) and cache.layers[0].v.shape == (1, 1, 10, 0)
    # absorbed score == naive score: [W_UKᵀ q ; W_QR q]·[c ; k_pe] equals q·k_nope + q_pe·k_pe up to the per-query
    # constant q·b_K (the K-nope bias, which the softmax removes)
    h = torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        q_pre = attn.queries(h)
        lat = attn.latent(h, pos)[:, 0]
        k, _ = attn.decompress(lat)
        s_abs = attn.score_rotary.apply(attn.score_queries(q_pre), pos) @ lat[:, None].transpose(-1, -2)
        q_full = attn.rotary.apply(torch.cat([q_pre, attn.rope_queries(q_pre)], -1), pos)
        s_naive = q_full @ k.transpose(-1, -2)
        b_k = attn.kv_b_proj.bias.view(attn.num_heads, 2 * attn.head_dim)[:, : attn.head_dim]
        const = torch.einsum("bhtd,hd->bht", q_pre, b_k)[..., None]
    assert (s_abs + const - s_naive).abs().max().item() < 1e-4
