# SPDX-License-Identifier: Apache-2.0
"""Rewrite a GQA/MHA decoder into MLA by SVD (X-EcoMLA, Li et al., 2025; RoPE choice after MHA2MLA, Ji et al., 2025).

Per layer, with D = head_dim, d_rope = 2·|pairs|, d_nope = D - d_rope:

1. RoPE pairs: d_rope/2 of the D/2 frequency pairs (f, f + D/2) of HF's half-split layout keep RoPE,
   with their original frequencies. ``rope_init="xeco"``: evenly spaced pairs f = ⌊k·(D/2)/(d_rope/2)⌋,
   the spectrum X-EcoMLA's fresh d_rope-wide RoPE covers; ``"norm"``: MHA2MLA's 2-norm rule, the pairs with
   the largest Σ_heads mean‖q_f‖·mean‖k_f‖ on calibration text (one set per layer, since k_pe is shared).
   Every other channel drops RoPE (partial RoPE).
2. Queries: W_Q's rows permuted per head to ``[nope ; pe]`` (bias and q_norm weight likewise); with r_q,
   W_Q = U_r (Σ_r V_rᵀ) -> q_b_proj, q_a_proj (the bias stays on q_b_proj). q_norm stays exact.
3. Latent: GQA K-nope and V rows repeated to all query heads, stacked ``[W_K,nope; W_V]`` and factored by
   one SVD: kv_a_proj = Σ_r V_rᵀ (r_kv × H), kv_b_proj = U_r regrouped per head as [K-nope ; V].
   Fixed r_kv, or per-layer energy δ (:func:`kvexport.mla.rank.energy_rank`). K/V biases become kv_b_proj's
   bias (exact: the latent carries no constant, see :mod:`kvexport.mla.attention`). Only the K rows the
   latent must reproduce (nope channels) are stacked; the RoPE key has its own projection.
4. Shared RoPE key: k_rope_proj = the head average of the pe rows of W_K (and of b_K), X-EcoMLA's init.
5. o_proj, MLP, norms, embeddings copied. RoPE attention_scaling s (YaRN/LongRoPE) multiplied every rope
   logit by s²; the nope part keeps that factor through s² folded into kv_b_proj's K rows.

Qwen3's k_norm (per-head RMSNorm on pre-RoPE keys) is not linear, so it cannot live inside a shared latent:
it is folded as ``diag(w_k) · W_K,h · E[1/rms(W_K,h x)]``, the per-head mean inverse RMS measured on
calibration inputs (norm-then-SVD approximation). The rewrite is then lossy even at full rank; distillation
repairs it. Calibration inputs default to 2×64 random token ids (seeded) when no text is given.
"""

from __future__ import annotations

import copy

import torch

from kvexport.errors import BadModel
from kvexport.mla.attention import MLAAttention
from kvexport.mla.config import MLALayerPlan, MLASettings
from kvexport.mla.rank import energy_rank, singular_values, truncated_svd
from kvexport.models.attention import GQAAttention
from kvexport.models.decoder import Decoder


def xeco_pairs(n_pairs: int, n_keep: int) -> list[int]:
    """Evenly spaced pair indices over [0, n_pairs): the frequencies a fresh 2·n_keep-wide RoPE would use."""
    return sorted({(k * n_pairs) // n_keep for k in range(n_keep)})


def pair_norm_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (N, Hq, D), k (N, Hkv, D) calibration queries/keys -> (D/2,) Σ_heads mean‖q_f‖ · mean‖k_f‖ (MHA2MLA)."""
    half = q.shape[-1] // 2
    qn = (q[..., :half].pow(2) + q[..., half:].pow(2)).sqrt().mean(0)  # (Hq, D/2)
    kn = (k[..., :half].pow(2) + k[..., half:].pow(2)).sqrt().mean(0)  # (Hkv, D/2)
    G = q.shape[1] // k.shape[1]
    return (qn * kn.repeat_interleave(G, dim=0)).sum(0)


@torch.no_grad()
def calibration_inputs(dec: Decoder, ids: torch.Tensor) -> list[torch.Tensor]:
    """ids (B, T) -> per layer the attention inputs (B·T, H) (after input_layernorm), from the original model."""
    caught: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: caught.append(a[0].reshape(-1, a[0].shape[-1])))
             for layer in dec.layers]
    try:
        B, T = ids.shape
        dec(ids, torch.arange(T).expand(B, T))
    finally:
        for hk in hooks:
            hk.remove()
    return [c.float() for c in caught]


def _rows(lin: torch.nn.Linear):
    return lin.weight.detach().double(), (lin.bias.detach().double() if lin.bias is not None else None)


@torch.no_grad()
def plan_layer(attn: GQAAttention, settings: MLASettings, x: torch.Tensor | None) -> tuple[MLALayerPlan, dict]:
    """Resolve one layer's plan and compute its MLA weights (float64 dict keyed like MLAAttention's params)."""
    spec = attn.spec
    Hq, Hkv, D, H = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    G, dr = Hq // Hkv, settings.rope_dim
    dn, half, n_keep = D - dr, D // 2, dr // 2
    Wq, bq = _rows(attn.q_proj)
    Wk, bk = _rows(attn.k_proj)
    Wv, bv = _rows(attn.v_proj)
    Wk, Wv, Wq = Wk.view(Hkv, D, H), Wv.view(Hkv, D, H), Wq.view(Hq, D, H)
    bk = bk.view(Hkv, D) if bk is not None else None
    bv = bv.view(Hkv, D) if bv is not None else None
    if spec.qk_norm:  # fold k_norm: weight and the calibrated mean inverse RMS per kv head
        k_raw = torch.einsum("nh,gdh->ngd", x.double(), Wk)  # (N, Hkv, D)
        inv_rms = torch.rsqrt(k_raw.pow(2).mean(-1) + spec.rms_norm_eps).mean(0)  # (Hkv,)
        Wk = Wk * (attn.k_norm.weight.double()[None, :, None] * inv_rms[:, None, None])
    # ---- 1. RoPE pairs
    if settings.rope_init == "xeco":
        pairs = xeco_pairs(half, n_keep)
    else:
        q = torch.einsum("nh,qdh->nqd", x.double(), Wq) + (bq.view(1, Hq, D) if bq is not None else 0)
        if spec.qk_norm:
            q = attn.q_norm(q.float()).double()
        k = torch.einsum("nh,gdh->ngd", x.double(), Wk) + (bk[None] if bk is not None else 0)
        scores = pair_norm_scores(q, k)
        pairs = sorted(torch.topk(scores, n_keep).indices.tolist())
    pt = torch.tensor(pairs, dtype=torch.long)
    pe_idx = torch.cat([pt, pt + half])  # pe channels in half-split order
    mask = torch.ones(D, dtype=torch.bool)
    mask[pe_idx] = False
    perm = torch.cat([torch.arange(D)[mask], pe_idx])  # [nope ; pe]
    out: dict[str, torch.Tensor] = {}
    # ---- 2. queries
    Wq_p = Wq[:, perm].reshape(Hq * D, H)
    bq_p = bq.view(Hq, D)[:, perm].reshape(-1) if bq is not None else None
    q_rank = settings.q_rank
    if q_rank is None:
        out["q_proj.weight"] = Wq_p
    else:
        up, down = truncated_svd(Wq_p, q_rank)
        out["q_a_proj.weight"], out["q_b_proj.weight"] = down, up
    if bq_p is not None:
        out["q_proj.bias" if q_rank is None else "q_b_proj.bias"] = bq_p
    if spec.qk_norm:
        out["q_norm.weight"] = attn.q_norm.weight.detach().double()[perm]
    # ---- 3. latent: stacked [K-nope ; V], repeated to all query heads
    nope = perm[:dn]
    Kn = Wk[:, nope].repeat_interleave(G, dim=0)  # (Hq, dn, H)
    Vr = Wv.repeat_interleave(G, dim=0)  # (Hq, D, H)
    stacked = torch.cat([Kn.reshape(Hq * dn, H), Vr.reshape(Hq * D, H)])
    if settings.kv_rank is not None:
        r = int(settings.kv_rank)
    else:
        r = energy_rank(singular_values(stacked), float(settings.energy))
    r = min(r, min(H, Hkv * (dn + D)))
    up, down = truncated_svd(stacked, r)  # (Hq*(dn+D), r), (r, H)
    s2 = attn.rotary.scaling**2
    U_k = up[: Hq * dn].view(Hq, dn, r) * s2
    U_v = up[Hq * dn :].view(Hq, D, r)
    out["kv_a_proj.weight"] = down
    out["kv_b_proj.weight"] = torch.cat([U_k, U_v], dim=1).reshape(Hq * (dn + D), r)
    if bk is not None:
        bkn = bk[:, nope].repeat_interleave(G, dim=0) * s2  # (Hq, dn)
        bvr = bv.repeat_interleave(G, dim=0)  # (Hq, D)
        out["kv_b_proj.bias"] = torch.cat([bkn, bvr], dim=1).reshape(-1)
    # ---- 4. shared RoPE key = head average of the pe rows
    out["k_rope_proj.weight"] = Wk[:, pe_idx].mean(0)
    if bk is not None:
        out["k_rope_proj.bias"] = bk[:, pe_idx].mean(0)
    out["o_proj.weight"] = attn.o_proj.weight.detach().double()
    if attn.o_proj.bias is not None:
        out["o_proj.bias"] = attn.o_proj.bias.detach().double()
    return MLALayerPlan(kv_rank=r, rope_pairs=pairs, q_rank=q_rank), out


@torch.no_grad()
def rewrite_to_mla(model, settings: MLASettings, calibration_ids: torch.Tensor | None = None) -> Decoder:
    """A Decoder (or HF ``*ForCausalLM``) -> a new Decoder whose attention layers are :class:`MLAAttention`.

    calibration_ids (B, T): text for ``rope_init="norm"`` and Qwen3's k_norm folding (default: seeded random ids).
    Raises :class:`~kvexport.errors.BadUsage` for settings the model cannot take, :class:`BadModel` for a
    model that is not a kvexport GQA decoder with RoPE.
    """
    dec = model if isinstance(model, Decoder) else Decoder.from_hf(model)
    if not all(isinstance(layer.self_attn, GQAAttention) for layer in dec.layers):
        raise BadModel("the model is already MLA or has an attention kvexport cannot rewrite (expected GQA/MHA)")
    if getattr(dec, "rotary", None) is None or dec.rotary.inv_freq.numel() == 0:
        raise BadModel("the model has no RoPE; MLA's decoupled RoPE key needs a RoPE model")
    spec = dec.spec
    settings.check_model(spec.head_dim, spec.hidden_size, spec.num_kv_heads)
    xs: list = [None] * spec.num_layers
    if settings.rope_init == "norm" or spec.qk_norm:
        if calibration_ids is None:
            calibration_ids = torch.randint(0, spec.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        xs = calibration_inputs(dec, calibration_ids.to(next(dec.parameters()).device))
    p = next(dec.parameters())
    new = copy.deepcopy(dec)
    plans = []
    for i, layer in enumerate(new.layers):
        plan, weights = plan_layer(dec.layers[i].self_attn, settings, xs[i])
        attn = MLAAttention(spec, plan, dec.rotary, absorb=settings.absorb)
        state = {k: v.to(p.dtype) for k, v in weights.items()}
        state.update({k: v for k, v in attn.state_dict().items() if k.endswith("inv_freq")})
        attn.load_state_dict(state, strict=True)
        layer.self_attn = attn.to(device=p.device, dtype=p.dtype)
        plans.append(plan)
    if not isinstance(model, Decoder):
        import json

        new.hf_config = json.loads(model.config.to_json_string())  # type: ignore[attr-defined]
    new.mla_settings = settings  # type: ignore[attr-defined]
    new.mla_plans = plans  # type: ignore[attr-defined]
    return new.eval()


def set_absorb(dec: Decoder, absorb: bool) -> Decoder:
    """Switch every MLA layer to the absorbed (True) or naive (False) path; returns dec."""
    for layer in dec.layers:
        if isinstance(layer.self_attn, MLAAttention):
            layer.self_attn.absorb = absorb
    return dec
