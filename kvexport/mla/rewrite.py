# SPDX-License-Identifier: Apache-2.0
"""Rewrite a GQA/MHA decoder into MLA: exact at the GQA cache size, graceful below it.

Per layer (D = head_dim, u = the latent inputs: h, and for Qwen3 also the normed keys; see
:mod:`kvexport.mla.attention`):

1. Calibration statistics. The original layer's queries q (after q_norm), pre-RoPE keys k (after k_norm)
   and values v on calibration inputs (text, or seeded random token ids when none is given).
2. RoPE part (:mod:`kvexport.mla.rope_plan`): which d_rope key components keep RoPE (TransMLA's RoRoPE by
   default), each head's query in their frame, and the no-RoPE key each query group sees instead of the rest.
3. Latent: one PCA of the stacked targets ``y = [α · no-RoPE keys of every group ; values]``
   (2 n_kv D rows, rank <= 2 n_kv D − d_rope) on the calibration inputs (``kv_fit="pca"``, TransMLA; the
   second moment of u gets a small ridge so that it is positive definite), or of the weights alone
   (``"svd"``, X-EcoMLA). α balances the energy of the two blocks (TransMLA's balanced KV PCA).
   kv_a_proj = V_rᵀ T (T: u -> y), kv_b_proj = V_r split per head as [K-nope ; V], biases of y to kv_b_proj's.
   Fixed r_kv, or per-layer energy δ of the PCA spectrum (:func:`kvexport.mla.rank.energy_rank`).
4. Queries keep W_Q (and q_norm); with r_q, W_Q = U_r (Σ_r V_rᵀ) -> q_b_proj, q_a_proj. o_proj, MLP, norms,
   embeddings copied. RoPE attention_scaling s (YaRN/LongRoPE) multiplies every RoPE logit by s²; the
   no-RoPE key keeps that factor through s² folded into kv_b_proj's K rows.

Exact (logits equal to fp32 rounding, tested against HF for Llama, Qwen2, Qwen3 and Mistral at 1-8 query
heads per KV head): ``kv_rank = d_rope = n_kv · D`` with rorope or perhead, for every family including
Qwen3 (its k_norm runs inside the module). Below that, the loss is the dropped RoPE components (scored on
the calibration queries and keys) plus the PCA residual of the latent.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import replace

import torch

from kvexport.errors import BadModel, BadUsage
from kvexport.mla.attention import MLAAttention
from kvexport.mla.calibration import calibration_inputs
from kvexport.mla.config import MLALayerPlan, MLASettings
from kvexport.mla.rank import energy_rank, truncated_svd
from kvexport.mla.rope_plan import rope_plan
from kvexport.models.attention import GQAAttention
from kvexport.models.decoder import Decoder
from kvexport.models.release import drop_file_pages

#: ridge added to the calibration second moment of u, relative to its mean diagonal
RIDGE = 1e-6


def _lin(lin: torch.nn.Linear):
    return lin.weight.detach().double().cpu(), (lin.bias.detach().double().cpu() if lin.bias is not None else None)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def latent_inputs(attn: GQAAttention, x: torch.Tensor) -> torch.Tensor:
    """x (N, H) float64 attention inputs -> u (N, U) float64, the MLA latent projections' inputs: x, and for a q/k-norm
    model (Qwen3) also its normed keys (see :mod:`kvexport.mla.attention`)."""
    spec = attn.spec
    if not spec.qk_norm:
        return x
    Wk, bk = _lin(attn.k_proj)
    k = (x @ Wk.T + (bk if bk is not None else 0)).view(x.shape[0], spec.num_kv_heads, spec.head_dim)
    k = _rms(k, attn.k_norm.weight.detach().double().cpu(), spec.rms_norm_eps)
    return torch.cat([x, k.reshape(x.shape[0], -1)], dim=1)  # (N, H + KV)


@torch.no_grad()
def plan_layer(attn: GQAAttention, settings: MLASettings, x: torch.Tensor | None) -> tuple[MLALayerPlan, dict]:
    """One layer's plan and MLA weights (float64 dict keyed like MLAAttention's parameters).

    x (N, H): calibration attention inputs; None uses 256 seeded standard-normal rows (weights-only statistics).
    """
    spec = attn.spec
    Hq, Hkv, D, H = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    G, KV = Hq // Hkv, Hkv * D
    if x is None:
        x = torch.randn(256, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.double().cpu()
    N = x.shape[0]
    Wq, bq = _lin(attn.q_proj)
    Wk, bk = _lin(attn.k_proj)
    Wv, bv = _lin(attn.v_proj)
    # ---- 1. calibration queries, keys (pre-RoPE) and the latent inputs u with their linear maps to k and v
    q = (x @ Wq.T + (bq if bq is not None else 0)).view(N, Hq, D)
    u = latent_inputs(attn, x)
    zeros_b = torch.zeros(KV, dtype=torch.float64)
    if spec.qk_norm:
        q = _rms(q, attn.q_norm.weight.detach().double().cpu(), spec.rms_norm_eps)
        k = u[:, H:].reshape(N, Hkv, D).contiguous()
        W_ku = torch.cat([torch.zeros(KV, H, dtype=torch.float64), torch.eye(KV, dtype=torch.float64)], dim=1)
        b_ku = zeros_b
        W_vu = torch.cat([Wv, torch.zeros(KV, KV, dtype=torch.float64)], dim=1)
    else:
        k = (x @ Wk.T + (bk if bk is not None else 0)).view(N, Hkv, D)
        W_ku, b_ku, W_vu = Wk, (bk if bk is not None else zeros_b), Wv
    b_v = bv if bv is not None else zeros_b
    # ---- 2. RoPE part
    rp = rope_plan(q, k, attn.rotary.inv_freq.double().cpu(), settings)
    nope = rp.nope_maps.reshape(KV, KV)  # all groups' no-RoPE keys from k
    # ---- 3. latent: PCA of [α · no-RoPE keys ; values]
    Tk, Tv = nope @ W_ku, W_vu
    bias_y = torch.cat([nope @ b_ku, b_v])  # (2 KV,) the targets' constant part
    if settings.kv_fit == "svd":
        Sigma, mean_u = torch.eye(u.shape[1], dtype=torch.float64), torch.zeros(u.shape[1], dtype=torch.float64)
    else:  # centred: the mean goes to kv_b_proj's bias, where it is exact and costs no rank
        mean_u = u.mean(0)
        Sigma = (u - mean_u).T @ (u - mean_u) / N
    Sigma = Sigma + RIDGE * Sigma.diagonal().mean() * torch.eye(u.shape[1], dtype=torch.float64)
    Wk_w, Wv_w = _block_weights(settings.kv_fit, q, attn, G)
    Tk, Tv = Wk_w @ Tk, Wv_w @ Tv
    ek, ev = torch.trace(Tk @ Sigma @ Tk.T), torch.trace(Tv @ Sigma @ Tv.T)
    alpha = float((ev / ek).sqrt()) if ek > 1e-12 * max(float(ev), 1e-30) else 1.0
    T = torch.cat([alpha * Tk, Tv])  # (2 KV, U), weighted
    lam, vec = torch.linalg.eigh(T @ Sigma @ T.T)
    lam, vec = lam.flip(0).clamp(min=0.0), vec.flip(1)
    if settings.kv_rank is not None:
        r = int(settings.kv_rank)
    else:
        r = energy_rank(lam.sqrt(), float(settings.energy))
    Vr = vec[:, :r]  # (2 KV, r)
    unw = torch.block_diag(torch.linalg.inv(Wk_w) / alpha, torch.linalg.inv(Wv_w))  # weighted -> target units
    up = unw @ Vr  # (2 KV, r): c -> y
    bias_y = bias_y + unw @ (T @ mean_u - Vr @ (Vr.T @ (T @ mean_u)))
    s2 = attn.rotary.scaling**2
    out: dict[str, torch.Tensor] = {}
    out["kv_a_proj.weight"] = Vr.T @ T
    U_k = (up[:KV] * s2).view(Hkv, D, r).repeat_interleave(G, dim=0)  # (Hq, D, r)
    U_v = up[KV:].view(Hkv, D, r).repeat_interleave(G, dim=0)
    out["kv_b_proj.weight"] = torch.cat([U_k, U_v], dim=1).reshape(Hq * 2 * D, r)
    bkn = (bias_y[:KV] * s2).view(Hkv, D).repeat_interleave(G, dim=0)
    out["kv_b_proj.bias"] = torch.cat([bkn, bias_y[KV:].view(Hkv, D).repeat_interleave(G, dim=0)], dim=1).reshape(-1)
    if spec.qkv_bias:
        out["k_rope_proj.bias"] = rp.key_rows @ b_ku
    out["k_rope_proj.weight"] = rp.key_rows @ W_ku
    out["q_rope"] = rp.q_maps
    # ---- 4. queries, o_proj, Qwen3's norms
    if settings.q_rank is None:
        out["q_proj.weight"] = Wq
    else:
        up, down = truncated_svd(Wq, settings.q_rank)
        out["q_a_proj.weight"], out["q_b_proj.weight"] = down, up
    if bq is not None:
        out["q_proj.bias" if settings.q_rank is None else "q_b_proj.bias"] = bq
    if spec.qk_norm:
        out["q_norm.weight"] = attn.q_norm.weight.detach().double().cpu()
        out["k_norm.weight"] = attn.k_norm.weight.detach().double().cpu()
        out["k_proj.weight"] = Wk
        if bk is not None:
            out["k_proj.bias"] = bk
    out["o_proj.weight"], ob = _lin(attn.o_proj)
    if ob is not None:
        out["o_proj.bias"] = ob
    if settings.equalize_latent:
        equalize_latent(out, u)
    return MLALayerPlan(kv_rank=r, rope_pairs=rp.pairs, q_rank=settings.q_rank), out


def equalize_latent(w: dict[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    """Rescale one layer's latent row ``[c_kv ; k_pe]`` in place of its weights ``w`` (plan_layer's dict): channel j
    of c_kv is divided by m_j = max |c_j| over the calibration inputs u (N, U), and RoPE pair p of k_pe (channels
    p and p + d_rope / 2, which RoPE rotates together) by the largest norm of the pair, which RoPE leaves unchanged;
    kv_b_proj's columns and q_rope's rows are multiplied by the same m, so every logit, value and output is
    unchanged (up to rounding), and so are the scores of the presses that read keys through queries (SnapKV, TOVA,
    ExpectedAttention, PyramidKV); KNorm and KeyDiff read the rescaled rows.

    Why: an int8 row shares one scale, absmax(row) / 127, among channels whose magnitudes differ by up to 20x
    (the PCA spectrum, and RoPE pairs that carry most of the positional attention), so the small channels were
    rounded with a step of a tenth of their size. -> m (r_kv + d_rope,) float64.
    """
    r = w["kv_a_proj.weight"].shape[0]
    c = u @ w["kv_a_proj.weight"].T  # (N, r)
    k_pe = u @ w["k_rope_proj.weight"].T + (w["k_rope_proj.bias"] if "k_rope_proj.bias" in w else 0)
    half = k_pe.shape[1] // 2
    pair = (k_pe[:, :half].square() + k_pe[:, half:].square()).sqrt().amax(0)
    m = torch.cat([c.abs().amax(0), pair, pair])
    top = float(m.max())
    # a channel below 1e-4 of the largest is rounded to 0 by any row scale: floored there, not blown up; all dead: 1
    m = m.clamp(min=1e-4 * top) if top > 0 else torch.ones_like(m)
    w["kv_a_proj.weight"] = w["kv_a_proj.weight"] / m[:r, None]
    w["kv_b_proj.weight"] = w["kv_b_proj.weight"] * m[None, :r]
    w["k_rope_proj.weight"] = w["k_rope_proj.weight"] / m[r:, None]
    if "k_rope_proj.bias" in w:
        w["k_rope_proj.bias"] = w["k_rope_proj.bias"] / m[r:]
    w["q_rope"] = w["q_rope"] * m[None, r:, None]  # (Hq, d_rope, D): q_pe_j = q_rope[:, j] · q
    return m


def _block_weights(kv_fit: str, q: torch.Tensor, attn, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Metric of the latent fit per block: identity, or (``wpca``) per group g the square roots of
    Σ_{i in g} E[q_i q_iᵀ] for the keys (errors in logit units) and Σ_{i in g} W_O,iᵀ W_O,i for the values
    (errors in output units), each with a small ridge. -> (KV, KV), (KV, KV) block-diagonal."""
    N, Hq, D = q.shape
    KV = Hq // G * D
    eye = torch.eye(KV, dtype=torch.float64)
    if kv_fit != "wpca":
        return eye, eye
    Wo = attn.o_proj.weight.detach().double().cpu().view(-1, Hq, D)  # (H, Hq, D)

    def root(c: torch.Tensor) -> torch.Tensor:
        c = c + 1e-3 * c.diagonal().mean() * torch.eye(D, dtype=torch.float64)
        lam, vec = torch.linalg.eigh(c)
        return vec @ torch.diag(lam.clamp(min=0).sqrt()) @ vec.T

    kb, vb = [], []
    for g in range(Hq // G):
        qs = q[:, g * G : (g + 1) * G].reshape(-1, D)
        kb.append(root(qs.T @ qs / N))
        wo = Wo[:, g * G : (g + 1) * G]  # (H, G, D)
        vb.append(root(torch.einsum("hgd,hge->de", wo, wo)))
    return torch.block_diag(*kb), torch.block_diag(*vb)


def default_calibration(spec, device=None) -> torch.Tensor:
    """Seeded random token ids (2, 64): the calibration when no text is given."""
    return torch.randint(0, spec.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)


@torch.no_grad()
def rewrite_to_mla(model, settings: MLASettings, calibration_ids: torch.Tensor | None = None,
                   progress=None, inplace: bool = False, refit=None) -> Decoder:
    """A Decoder (or HF ``*ForCausalLM``) -> a new Decoder whose attention layers are :class:`MLAAttention`.

    calibration_ids (B, T): text for the statistics of every init (default: :func:`default_calibration`).
    inplace: False (default) leaves ``model`` as it was and returns a deep copy (the whole model, embeddings and
    MLPs included, is held twice for a while); True rewrites ``model``'s Decoder itself, one layer at a time,
    each GQA attention (its q/k/v/o projections) dropped as soon as its MLA replacement is in place, so the peak is
    the model plus one layer's factorisation. The calibration inputs of every layer are computed from the original
    model first (activations, B·T·H floats a layer). With an HF model, in place means the Decoder that shares its
    tensors: the HF model keeps its own references, so a caller that wants the memory back drops it too (as
    ``kvexport convert`` does before its rewrite).
    progress: called with ``"rewrite: layer i/L"`` before each layer's factorisation (convert shows it with an ETA).
    refit: a :class:`~kvexport.mla.refit.RefitSettings`: each new layer's projections are then fitted to the original
    attention's outputs on the calibration inputs (:func:`kvexport.mla.refit.refit_layer`) before the next layer is
    rewritten, and int8 equalization (``settings.equalize_latent``) applies to the fitted weights; the per-layer
    results are kept as ``new.refit_summary``. Needs ``calibration_ids`` (text: the fit learns what they show).
    Raises :class:`~kvexport.errors.BadUsage` for settings the model cannot take, :class:`BadModel` for a
    model that is not a kvexport GQA decoder with RoPE, or whose layers use a sliding window (MLA attention
    attends to every cached token).
    """
    dec = model if isinstance(model, Decoder) else Decoder.from_hf(model)
    if not all(isinstance(layer.self_attn, GQAAttention) for layer in dec.layers):
        raise BadModel("the model is already MLA or has an attention kvexport cannot rewrite (expected GQA/MHA)")
    if getattr(dec, "rotary", None) is None or dec.rotary.inv_freq.numel() == 0:
        raise BadModel("the model has no RoPE; MLA's decoupled RoPE key needs a RoPE model")
    spec = dec.spec
    windowed = [i for i in range(spec.num_layers) if spec.sliding_window_of(i) is not None]
    if windowed:
        raise BadModel(f"layers {windowed[0]}..{windowed[-1]} ({len(windowed)} of {spec.num_layers}) use sliding_window "
                       f"attention (window {spec.sliding_window_of(windowed[0])}), which kvexport's MLA attention does "
                       "not apply; rewrite a model without sliding_window (Mistral sliding_window: null, Qwen "
                       "use_sliding_window: false)")
    settings.check_model(spec.head_dim, spec.hidden_size, spec.num_kv_heads, spec.qk_norm)
    p = next(dec.parameters())
    if calibration_ids is None:
        if refit is not None:
            raise BadUsage("an MLA refit needs calibration text (calibration_ids)")
        calibration_ids = default_calibration(spec)
    xs = calibration_inputs(dec, calibration_ids.to(p.device))
    B, T = calibration_ids.shape
    plan_settings = replace(settings, equalize_latent=False) if refit is not None else settings
    fits = []
    new = dec if inplace else copy.deepcopy(dec)
    del p  # no reference to a parameter survives the loop (in place, the first layer's q_proj would)
    param = next(new.parameters())
    dtype, device = param.dtype, param.device
    del param
    plans = []
    t0 = time.perf_counter()
    for i, layer in enumerate(new.layers):
        if progress is not None and refit is None:
            progress(f"rewrite: layer {i + 1}/{len(new.layers)}")
        elif progress is not None:  # a refit takes minutes: the time left, from the layers done so far
            left = (time.perf_counter() - t0) / i * (len(new.layers) - i) if i else None
            progress(f"rewrite + refit: layer {i + 1}/{len(new.layers)}"
                     + (f", about {left / 60:.0f} min left" if left is not None else ""))
        original = dec.layers[i].self_attn
        plan, weights = plan_layer(original, plan_settings, xs[i])
        attn = MLAAttention(spec, plan, dec.rotary, absorb=settings.absorb)
        state = {k: v.to(dtype) for k, v in weights.items()}
        del weights
        state.update({k: v for k, v in attn.state_dict().items() if k.endswith("inv_freq")})
        attn.load_state_dict(state, strict=True)
        del state
        if refit is not None:
            fits.append(_refit(original, attn.to(device=device, dtype=dtype), xs[i].view(B, T, -1), settings, refit))
        xs[i] = None  # type: ignore[call-overload]  # this layer's activations are not read again
        del original
        if inplace:  # the GQA projections are not read again: their checkpoint pages leave the RSS with them
            drop_file_pages(list(layer.self_attn.parameters()))
        layer.self_attn = attn.to(device=device, dtype=dtype)  # in place: the GQA projections lose their last reference
        plans.append(plan)
        if inplace:
            gc.collect()
    if not isinstance(model, Decoder):
        import json

        new.hf_config = json.loads(model.config.to_json_string())  # type: ignore[attr-defined]
    src = getattr(dec, "source_dir", None) or getattr(model, "name_or_path", None)
    new.source_model = str(src) if src else None  # type: ignore[attr-defined]  # recorded by save_mla
    new.mla_settings = settings  # type: ignore[attr-defined]
    new.mla_plans = plans  # type: ignore[attr-defined]
    if refit is not None:
        from kvexport.mla.refit import summary

        new.refit_summary = summary(fits, refit, B * T)  # type: ignore[attr-defined]
    return new.eval()


def _refit(original: GQAAttention, attn: MLAAttention, x: torch.Tensor, settings: MLASettings, refit) -> dict:
    """Fit one new layer (kvexport.mla.refit), then equalize its latent (int8) from the fitted weights."""
    from kvexport.mla.refit import refit_layer

    x = x.to(device=next(attn.parameters()).device, dtype=next(attn.parameters()).dtype)
    got = refit_layer(original, attn, x, refit)
    if settings.equalize_latent:
        w = {k: v.detach().double().cpu() for k, v in attn.state_dict().items() if not k.endswith("inv_freq")}
        equalize_latent(w, latent_inputs(original, x.reshape(-1, x.shape[-1]).double().cpu()))
        for k, v in w.items():
            attn.state_dict()[k].copy_(v)
    return got


def set_absorb(dec: Decoder, absorb: bool) -> Decoder:
    """Switch every MLA layer to the absorbed (True) or naive (False) path; returns dec."""
    for layer in dec.layers:
        if isinstance(layer.self_attn, MLAAttention):
            layer.self_attn.absorb = absorb
    return dec
