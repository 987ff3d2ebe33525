# SPDX-License-Identifier: Apache-2.0
"""The SVD rewrite: exact latent at full rank, KL to the original bounded by the RoPE change alone,
error growing as r_kv shrinks, energy ranks, RoPE pair selection, every family."""

from __future__ import annotations

import copy

import pytest
import torch

from kvexport.mla import MLASettings, max_kv_rank, rewrite_to_mla
from kvexport.mla.rank import energy_rank
from kvexport.mla.rewrite import calibration_inputs, pair_norm_scores, xeco_pairs
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model
from tests.conftest import FAMILIES, FAMILY_IDS
from tests.mla.helpers import PartialRopeReference, kl

IDS = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(5))
POS = torch.arange(48).expand(2, 48)


def full_rank(spec, dr):
    return max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, dr)


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
def test_full_rank_latent_is_exact(tiny_models, family, kw):
    """At full rank the latent reproduces the original values (and, without k_norm, the no-RoPE keys) exactly."""
    dec = Decoder.from_hf(tiny_models(family, **kw))
    dr = 8
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=full_rank(dec.spec, dr), rope_dim=dr))
    h = torch.randn(2, 9, dec.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        for layer_o, layer_m in zip(dec.layers, mla.layers, strict=True):
            a, m = layer_o.self_attn, layer_m.self_attn
            G = a.num_heads // a.num_kv_heads
            _, _, v = a.project(h, pos)
            k_raw = a.k_proj(h).view(2, 9, a.num_kv_heads, a.head_dim).transpose(1, 2)
            keys, values = m.decompress(m.latent(h, pos)[:, 0])
            assert (values - v.repeat_interleave(G, 1)).abs().max().item() < 1e-5
            if not dec.spec.qk_norm:
                pairs = torch.tensor(m.plan.rope_pairs)
                pe = set(torch.cat([pairs, pairs + a.head_dim // 2]).tolist())
                nope = [i for i in range(a.head_dim) if i not in pe]
                ref = k_raw[..., nope].repeat_interleave(G, 1)
                assert (keys[..., : m.nope_dim] - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("family,kw", [f for f in FAMILIES if f[0] != "qwen3"],
                         ids=[i for f, i in zip(FAMILIES, FAMILY_IDS, strict=True) if f[0] != "qwen3"])
@pytest.mark.parametrize("rope_init", ["xeco", "norm"])
def test_full_rank_kl_is_the_rope_change_alone(tiny_models, family, kw, rope_init):
    """KL(original || MLA at full rank) is bounded by the KL of the partial-RoPE/shared-key change alone
    (computed from the original weights without any SVD) + 1e-4: the SVD adds nothing at full rank.
    The logits of both agree to 1e-4."""
    dec = Decoder.from_hf(tiny_models(family, **kw))
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=full_rank(dec.spec, 8), rope_dim=8, rope_init=rope_init))
    ref = copy.deepcopy(dec)
    for lr, lm in zip(ref.layers, mla.layers, strict=True):
        lr.self_attn = PartialRopeReference(lr.self_attn, lm.self_attn.plan.rope_pairs)
    with torch.no_grad():
        orig, got, want = dec(IDS, POS), mla(IDS, POS), ref(IDS, POS)
    assert (got - want).abs().max().item() < 1e-4
    assert kl(orig, got) <= kl(orig, want) + 1e-4


def test_mqa_with_full_rope_is_exact():
    """Where the method loses nothing (one KV head: the shared RoPE key *is* the key; d_rope = head_dim: no
    channel drops RoPE) the full-rank rewrite reproduces the original: KL < 1e-7 (fp32 rounding)."""
    dec = Decoder.from_hf(tiny_model("llama", kv_heads=1, seed=3))
    D = dec.spec.head_dim
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=full_rank(dec.spec, D), rope_dim=D))
    with torch.no_grad():
        orig, got = dec(IDS, POS), mla(IDS, POS)
    assert kl(orig, got) < 1e-7
    assert (orig - got).abs().max().item() < 1e-3


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
def test_error_grows_as_rank_shrinks(tiny_models, family, kw):
    dec = Decoder.from_hf(tiny_models(family, **kw))
    top = full_rank(dec.spec, 8)
    kls = []
    with torch.no_grad():
        orig = dec(IDS, POS)
        for r in (top, top // 2, 8, 2):
            kls.append(kl(orig, rewrite_to_mla(dec, MLASettings(kv_rank=r, rope_dim=8))(IDS, POS)))
    assert all(a < b for a, b in zip(kls, kls[1:], strict=False)), kls


def test_energy_rank():
    s = torch.tensor([3.0, 2.0, 1.0, 1.0] + [0.1] * 20)
    total = (s**2).sum().item()  # 15.2
    assert energy_rank(s, 0.5, multiple=1) == 1  # 9 / 15.2 = 0.59
    assert energy_rank(s, 0.6, multiple=1) == 2  # 13 / 15.2 = 0.855
    assert energy_rank(s, 13 / total, multiple=1) == 2
    assert energy_rank(s, 0.9, multiple=1) == 3  # 14 / 15.2 = 0.92
    assert energy_rank(s, 0.95, multiple=1) == 4  # 15 / 15.2 = 0.987
    assert energy_rank(s, 0.9) == 8  # rounded up to a multiple of 8
    assert energy_rank(s, 1.0) == 24  # full, capped at n


def test_energy_setting_picks_per_layer_ranks(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    lo = rewrite_to_mla(dec, MLASettings(energy=0.5, rope_dim=8))
    hi = rewrite_to_mla(dec, MLASettings(energy=1.0, rope_dim=8))
    assert all(p.kv_rank % 8 == 0 for p in lo.mla_plans)
    assert all(p.kv_rank == full_rank(dec.spec, 8) for p in hi.mla_plans)
    assert all(a.kv_rank < b.kv_rank for a, b in zip(lo.mla_plans, hi.mla_plans, strict=True))
    assert lo.layers[0].self_attn.key_dim == lo.mla_plans[0].kv_rank + 8


def test_rope_pair_selection():
    assert xeco_pairs(8, 4) == [0, 2, 4, 6]
    assert xeco_pairs(16, 16) == list(range(16))
    # 2-norm selection: pair 1 of head 0 and pair 3 of both heads dominate
    q = torch.zeros(10, 2, 8)
    k = torch.zeros(10, 1, 8)
    q[:, 0, 1], q[:, :, 3 + 4], k[:, 0, 1 + 4], k[:, 0, 3] = 5.0, 2.0, 1.0, 1.0
    assert torch.topk(pair_norm_scores(q, k), 2).indices.sort().values.tolist() == [1, 3]


def test_norm_init_uses_calibration(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    xs = calibration_inputs(dec, IDS)
    assert len(xs) == dec.spec.num_layers and xs[0].shape == (2 * 48, dec.spec.hidden_size)
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=16, rope_dim=4, rope_init="norm"), calibration_ids=IDS)
    a = dec.layers[0].self_attn
    with torch.no_grad():
        q = a.q_proj(xs[0]).view(-1, a.num_heads, a.head_dim)
        k = a.k_proj(xs[0]).view(-1, a.num_kv_heads, a.head_dim)
    expect = sorted(torch.topk(pair_norm_scores(q.double(), k.double()), 2).indices.tolist())
    assert mla.mla_plans[0].rope_pairs == expect
