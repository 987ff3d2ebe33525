# SPDX-License-Identifier: Apache-2.0
"""The GQA -> MLA rewrite: exact against HF at the GQA cache size (three families x four GQA ratios, and
Qwen3), the meaning of a partial RoPE plan against a complex-number reference, RoRoPE's concentration,
X-EcoMLA's init against a reference built from the original weights, error growing as r_kv shrinks."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kvexport.generation import generate
from kvexport.mla import MLASettings, max_kv_rank, rewrite_to_mla, set_absorb
from kvexport.mla.rank import energy_rank
from kvexport.mla.rewrite import calibration_inputs
from kvexport.mla.rope_plan import component_mixes, mean_rotation, pair_norm_scores, xeco_pairs
from kvexport.models.decoder import Decoder
from kvexport.models.rope import Rotary
from kvexport.models.tiny import tiny_model
from tests.conftest import FAMILIES, FAMILY_IDS
from tests.mla.helpers import PartialRopeReference, kl

IDS = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(5))
POS = torch.arange(48).expand(2, 48)
#: (query heads, KV heads): 1, 2, 4 and 8 query heads per KV head, hidden 64
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]


def exact_settings(spec, **kw) -> MLASettings:
    """d_rope = n_kv · D (every key channel keeps RoPE), r_kv = the values' rank: the GQA cache, rewritten."""
    dr = spec.num_kv_heads * spec.head_dim
    return MLASettings(kv_rank=max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, dr, spec.qk_norm),
                       rope_dim=dr, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("heads,kv_heads", GQA, ids=[f"gqa{h // k}" for h, k in GQA])
def test_exact_at_the_gqa_cache_size(family, heads, kv_heads):
    """Logits of both attention paths within 1e-4 of HF's (fp32), the MLA cache row as large as the GQA
    cache (2 n_kv D), and greedy decoding through the latent cache gives HF's tokens."""
    hf = tiny_model(family, heads=heads, kv_heads=kv_heads, seed=heads + kv_heads)
    dec = Decoder.from_hf(hf)
    mla = rewrite_to_mla(dec, exact_settings(dec.spec))
    attn = mla.layers[0].self_attn
    assert attn.key_dim == 2 * kv_heads * dec.spec.head_dim
    with torch.no_grad():
        want = hf(IDS).logits
        for absorb in (True, False):
            set_absorb(mla, absorb)
            assert (mla(IDS, POS) - want).abs().max().item() < 1e-4
        seq = IDS[:, :16]
        for _ in range(12):  # HF greedy, no cache, no stopping token
            seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        ref = seq[:, 16:]
    set_absorb(mla, True)
    got = generate(mla, IDS[:, :16], max_new_tokens=12).tokens
    assert torch.equal(got, ref)


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=[f"gqa{h // k}" for h, k in GQA])
def test_qwen3_k_norm_is_exact(heads, kv_heads):
    """Qwen3's per-head k_norm runs inside the module, so the rewrite stays exact (its tiny head_dim is 128, so
    n_kv · D > hidden and the exact row is n_kv · D + hidden, below the GQA cache)."""
    hf = tiny_model("qwen3", heads=heads, kv_heads=kv_heads, seed=2)
    dec = Decoder.from_hf(hf)
    mla = rewrite_to_mla(dec, exact_settings(dec.spec))
    with torch.no_grad():
        assert (mla(IDS, POS) - hf(IDS).logits).abs().max().item() < 1e-4


def test_exact_below_the_gqa_size_when_values_have_lower_rank():
    """n_kv · D > hidden (Qwen3, 4 KV heads x 32 > 64): the values have rank 64, so the exact row is
    128 + 64 elements instead of the GQA cache's 256."""
    hf = tiny_model("qwen3", head_dim=32, kv_heads=4)
    dec = Decoder.from_hf(hf)
    mla = rewrite_to_mla(dec, exact_settings(dec.spec, rope_init="perhead"))
    assert mla.layers[0].self_attn.key_dim == 192
    with torch.no_grad():
        assert (mla(IDS, POS) - hf(IDS).logits).abs().max().item() < 1e-4


def test_mean_rotation_is_the_average_rope_logit():
    """Re(q conj(k) z) with z = E_Δ e^{iθΔ} equals the RoPE logit averaged over Δ = 0 .. L-1, computed by rotating
    q to position Δ and k to position 0 with the model's Rotary."""
    inv = torch.tensor([0.9, 0.05])
    L = 37
    z = mean_rotation(inv, L)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    rot = Rotary(inv)
    qs = rot.apply(q.float().expand(1, 1, L, 4), torch.arange(L)[None]).double()[0, 0]  # (L, 4)
    want = (qs @ k).mean().item()
    qc, kc = torch.complex(q[:2], q[2:]), torch.complex(k[:2], k[2:])
    got = (qc * kc.conj() * torch.complex(z[:, 0], z[:, 1])).real.sum().item()
    assert got == pytest.approx(want, abs=1e-5)


def _reference_attention(attn, plan_pairs_components, x, positions, rule_z):
    """One layer's attention output from the original GQA weights, written with complex numbers: per
    frequency f, key components k̃_{f,m} = Σ_g M[f,m,g] k_{g,f}; a kept (f, m) is rotated by RoPE, a dropped
    one enters as Re(q̃ conj(k̃) z_f) (rule 'mean'). Values and o_proj as in the original."""
    B, T, _ = x.shape
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    G, half = Hq // Hkv, D // 2
    q = attn.q_proj(x).view(B, T, Hq, D).double()
    k = attn.k_proj(x).view(B, T, Hkv, D).double()
    v = attn.v_proj(x).view(B, T, Hkv, D).double()
    M, kept, z = plan_pairs_components
    qc = torch.complex(q[..., :half], q[..., half:])  # (B, T, Hq, F)
    kc = torch.complex(k[..., :half], k[..., half:])  # (B, T, Hkv, F)
    kt = torch.einsum("fmg,btgf->btmf", M.to(kc.dtype), kc)  # (B, T, m, F)
    qt = torch.einsum("fmh,bthf->bthmf", M[:, :, torch.arange(Hq) // G].to(qc.dtype), qc)  # (B, T, Hq, m, F)
    theta = attn.rotary.inv_freq.double()
    dpos = (positions[:, :, None] - positions[:, None, :]).double()  # (B, T, S)
    phase = torch.exp(1j * dpos[..., None] * theta)  # (B, T, S, F)
    keep = torch.zeros(Hkv, half, dtype=torch.bool)
    for f, m in kept:
        keep[m, f] = True
    zc = torch.complex(z[:, 0], z[:, 1])
    prod = torch.einsum("bthmf,bsmf->bhtsmf", qt, kt.conj())  # (B, Hq, T, S, m, F)
    fac = torch.where(keep[None, None, None, None], phase[:, None, :, :, None, :], zc[None, None, None, None, None])
    logits = (prod * fac).real.sum((-1, -2)) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhts,bshd->bthd", p, v[:, :, torch.arange(Hq) // G])
    return attn.o_proj(out.reshape(B, T, Hq * D).float())


@pytest.mark.parametrize("rope_init", ["rorope", "perhead"])
def test_partial_rope_plan_means_what_it_says(rope_init):
    """Full latent rank, d_rope = a quarter of n_kv · D: the MLA layer equals the complex-number reference
    of the plan it chose (its mixes recomputed from the calibration keys), on fresh inputs."""
    hf = tiny_model("llama", heads=4, kv_heads=2, seed=7)
    dec = Decoder.from_hf(hf)
    spec = dec.spec
    dr = spec.num_kv_heads * spec.head_dim // 4
    settings = MLASettings(kv_rank=max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, dr), rope_dim=dr,
                           rope_init=rope_init, rope_horizon=64)
    mla = rewrite_to_mla(dec, settings, IDS)
    xs = calibration_inputs(dec, IDS)
    a, m = dec.layers[0].self_attn, mla.layers[0].self_attn
    with torch.no_grad():
        k_cal = a.k_proj(xs[0].float()).view(-1, a.num_kv_heads, a.head_dim).double()
        M, _ = component_mixes(k_cal, rotate=rope_init == "rorope")
        # which components were kept: the plan lists their frequencies; the mix rows identify the components
        kr = m.k_rope_proj.weight.double() @ torch.linalg.pinv(a.k_proj.weight.double())  # (dr, n_kv D)
        kept = []
        half = a.head_dim // 2
        for p, f in enumerate(m.plan.rope_pairs):
            row = kr[p].view(a.num_kv_heads, a.head_dim)[:, f]
            mm = int(torch.argmax((M[f] @ row).abs()))
            kept.append((f, mm))
        assert len(set(kept)) == dr // 2 and all(0 <= f < half for f, _ in kept)
        x = torch.randn(2, 20, spec.hidden_size, generator=torch.Generator().manual_seed(3))
        pos = torch.arange(20).expand(2, 20)
        e = torch.zeros(2, 1, 0, m.key_dim)
        got, *_ = m(x, pos, e, torch.zeros(2, 1, 0, 0), torch.zeros(2, 1, 0, dtype=torch.long))
        want = _reference_attention(a, (M, kept, mean_rotation(a.rotary.inv_freq, 64)), x, pos, None)
    assert (got - want).abs().max().item() < 1e-4


def test_rorope_concentrates_correlated_heads():
    """KV head 1's keys are 2 x head 0's: one component per frequency holds all the positional energy, so
    RoRoPE with d_rope = D (one head's worth) stays exact while per-head partial RoPE cannot."""
    hf = tiny_model("llama", heads=4, kv_heads=2, seed=4)
    D = hf.config.hidden_size // 4
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.self_attn.k_proj.weight
            w[D:] = 2 * w[:D]
    dec = Decoder.from_hf(hf)
    H = dec.spec.hidden_size
    with torch.no_grad():
        want = hf(IDS).logits
        errs = {}
        for init in ("rorope", "perhead"):
            mla = rewrite_to_mla(dec, MLASettings(kv_rank=max_kv_rank(H, 2, D, D), rope_dim=D, rope_init=init), IDS)
            errs[init] = (mla(IDS, POS) - want).abs().max().item()
    assert errs["rorope"] < 1e-4 < errs["perhead"], errs


@pytest.mark.parametrize("family,kw", [f for f in FAMILIES if f[0] != "qwen3"],
                         ids=[i for f, i in zip(FAMILIES, FAMILY_IDS, strict=True) if f[0] != "qwen3"])
@pytest.mark.parametrize("rope_init", ["xeco", "norm"])
def test_xeco_init_at_full_rank_is_the_shared_key_change_alone(tiny_models, family, kw, rope_init):
    """X-EcoMLA's init (head-averaged RoPE key, partial RoPE) at full latent rank equals the partial-RoPE/shared-key
    attention computed from the original weights without any factorisation (logits within 1e-4)."""
    dec = Decoder.from_hf(tiny_models(family, **kw))
    s = dec.spec
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=max_kv_rank(s.hidden_size, s.num_kv_heads, s.head_dim, 8),
                                          rope_dim=8, rope_init=rope_init))
    ref = copy.deepcopy(dec)
    for lr, lm in zip(ref.layers, mla.layers, strict=True):
        lr.self_attn = PartialRopeReference(lr.self_attn, lm.self_attn.plan.rope_pairs)
    with torch.no_grad():
        assert (mla(IDS, POS) - ref(IDS, POS)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
def test_error_grows_as_rank_shrinks(tiny_models, family, kw):
    dec = Decoder.from_hf(tiny_models(family, **kw))
    s = dec.spec
    top = max_kv_rank(s.hidden_size, s.num_kv_heads, s.head_dim, 8, s.qk_norm)
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
        q = a.q_proj(xs[0].float()).view(-1, a.num_heads, a.head_dim)
        k = a.k_proj(xs[0].float()).view(-1, a.num_kv_heads, a.head_dim)
    expect = sorted(torch.topk(pair_norm_scores(q.double(), k.double()), 2).indices.tolist())
    assert mla.mla_plans[0].rope_pairs == expect


def test_rewrite_reports_each_layer():
    """progress sees one "rewrite: layer i/L" per layer, in order, before its factorisation (convert's ETA)."""
    seen = []
    model = tiny_model("llama", num_hidden_layers=3)
    rewrite_to_mla(model, MLASettings(kv_rank=16, rope_dim=8), progress=seen.append)
    assert seen == ["rewrite: layer 1/3", "rewrite: layer 2/3", "rewrite: layer 3/3"]
