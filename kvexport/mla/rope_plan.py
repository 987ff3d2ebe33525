# SPDX-License-Identifier: Apache-2.0
"""Which key components keep RoPE in the latent row, and how queries and the no-RoPE key see them.

The GQA keys of one token, pre-RoPE, are ``k = [k_0 ; ... ; k_{n_kv-1}]`` (n_kv · D, head-major, HF's
half-split layout per head: frequency f rotates channels f and f + D/2). A :class:`RopePlan` is linear in k:

    k_pe       = key_rows @ k          (d_rope)       the RoPE part of the latent row, pair p = (p, p + d_rope/2)
    q_pe,i     = q_maps[i] @ q_i       (d_rope)       head i's query in that frame
    k_nope,g   = nope_maps[g] @ k      (D)            what group g's queries dot without RoPE

and the attention logit of head i (group g) becomes ``RoPE(q_pe,i)·RoPE(k_pe) + q_i·k_nope,g``.

Methods (``MLASettings.rope_init``):

- ``rorope`` (TransMLA, Meng et al. 2025): per frequency f, the n_kv 2-vectors k_{g,f} are mixed by the
  orthogonal matrix M_f of their principal axes on calibration keys. A mix across heads commutes with the
  2-D rotation of frequency f, so the query of head i takes ``M_f[:, g]`` (M_f⁻ᵀ = M_f) and nothing changes
  while every component keeps RoPE. Component m of frequency f then carries energy λ_{f,m}.
- ``perhead`` (MHA2MLA's per-head partial RoPE, Ji et al. 2025, with the same scoring): M_f = identity.
- ``xeco`` / ``norm`` (X-EcoMLA, Li et al. 2025; MHA2MLA's 2-norm pair choice): d_rope/2 frequency pairs,
  the RoPE key is the head average of those pairs, every other channel of each head loses RoPE.

For rorope/perhead the d_rope/2 components (f, m) kept are those whose loss would cost most:
``λ_{f,m} · E‖q̃_{f,m}‖² · w_f``, with w_f the mean squared error of the rule that replaces RoPE for a dropped
component over relative distances Δ uniform in [0, horizon): a component that barely rotates over the
horizon (low frequency) is nearly free to drop. The rules (``dropped_rope``), with z_f = E_Δ[e^{iθ_f Δ}]:
``mean``: the key is multiplied by conj(z_f) (the least-squares position-free stand-in, w_f = 1 − |z_f|²);
``none``: RoPE simply removed (w_f = 2 − 2 Re z_f, MHA2MLA/TransMLA); ``zero``: the component is dropped (w_f = 1).
At d_rope = n_kv · D nothing is dropped and the plan is exact (tested against HF).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RopePlan:
    """pairs: frequency index of each latent RoPE pair (d_rope/2); key_rows (d_rope, n_kv D); q_maps (Hq, d_rope, D);
    nope_maps (n_kv, D, n_kv D); all float64."""

    pairs: list[int]
    key_rows: torch.Tensor
    q_maps: torch.Tensor
    nope_maps: torch.Tensor


def mean_rotation(inv_freq: torch.Tensor, horizon: int) -> torch.Tensor:
    """inv_freq (F,) -> z (F, 2) = (Re, Im) of E_Δ[exp(i θ Δ)] for Δ uniform over 0 .. horizon - 1 (float64)."""
    d = torch.arange(horizon, dtype=torch.float64)
    ang = inv_freq.double()[:, None] * d[None]
    return torch.stack([ang.cos().mean(1), ang.sin().mean(1)], dim=-1)


def dropped_weight(z: torch.Tensor, rule: str) -> torch.Tensor:
    """z (F, 2) mean rotations -> (F,) mean squared error factor of replacing RoPE by ``rule`` (see module doc)."""
    if rule == "mean":
        return 1.0 - z.pow(2).sum(-1)
    if rule == "none":
        return 2.0 - 2.0 * z[:, 0]
    return torch.ones(z.shape[0], dtype=z.dtype)


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


def _pair_energy(x: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) -> (H, D/2) mean squared norm of each frequency pair."""
    half = x.shape[-1] // 2
    return (x[..., :half].pow(2) + x[..., half:].pow(2)).mean(0)


def component_mixes(k: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """k (N, n_kv, D) calibration keys -> mixes M (D/2, n_kv, n_kv) (row m = component m, orthogonal) and their
    energies λ (D/2, n_kv) = E‖Σ_g M[m, g] k_{g,f}‖², descending per frequency (identity mixes if not ``rotate``)."""
    N, n_kv, D = k.shape
    half = D // 2
    kf = torch.stack([k[..., :half], k[..., half:]], dim=-1)  # (N, n_kv, D/2, 2)
    C = torch.einsum("ngfc,nhfc->fgh", kf, kf) / N  # (D/2, n_kv, n_kv)
    if not rotate:
        eye = torch.eye(n_kv, dtype=k.dtype).expand(half, n_kv, n_kv).clone()
        return eye, torch.diagonal(C, dim1=-2, dim2=-1).clone()
    lam, vec = torch.linalg.eigh(C)  # ascending
    return vec.flip(-1).transpose(-1, -2).contiguous(), lam.flip(-1).clamp(min=0.0)


def mixed_plan(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, rotate: bool, rule: str,
               horizon: int) -> RopePlan:
    """rorope (``rotate``) or perhead plan from calibration queries q (N, Hq, D) and keys k (N, n_kv, D)."""
    N, Hq, D = q.shape
    n_kv, half = k.shape[1], D // 2
    G, n_keep = Hq // n_kv, rope_dim // 2
    M, lam = component_mixes(k, rotate)  # (F, m, g), (F, m)
    qe = _pair_energy(q).T.reshape(half, n_kv, G).sum(-1)  # (F, g): Σ_{i in g} E‖q_{i,f}‖²
    q_energy = torch.einsum("fmg,fg->fm", M.pow(2), qe)  # E‖q̃_{f,m}‖² summed over heads
    z = mean_rotation(inv_freq, horizon)  # (F, 2)
    cost = lam * q_energy * dropped_weight(z, rule)[:, None]  # (F, m)
    order = torch.argsort(cost.reshape(-1), descending=True, stable=True)[:n_keep]
    kept = sorted((int(i) // n_kv, int(i) % n_kv) for i in order)  # (f, m), by frequency
    key_rows = torch.zeros(rope_dim, n_kv * D, dtype=torch.float64)
    q_maps = torch.zeros(Hq, rope_dim, D, dtype=torch.float64)
    heads = torch.arange(Hq) // G
    for p, (f, m) in enumerate(kept):
        for c, ch in enumerate((f, f + half)):
            key_rows[p + c * n_keep, torch.arange(n_kv) * D + ch] = M[f, m]
            q_maps[:, p + c * n_keep, ch] = M[f, m, heads]
    # dropped components: group g's no-RoPE key at pair f = Σ_m M[f, m, g] · conj(z_f)-rule(k̃_{f,m})
    a, b = (z[:, 0], z[:, 1]) if rule == "mean" else (torch.ones(half, dtype=torch.float64),
                                                       torch.zeros(half, dtype=torch.float64))
    keep = set(kept)
    nope_maps = torch.zeros(n_kv, D, n_kv * D, dtype=torch.float64)
    if rule != "zero":
        for f in range(half):
            drop = [m for m in range(n_kv) if (f, m) not in keep]
            if not drop:
                continue
            Md = M[f, drop]  # (d, n_kv)
            P = Md.T @ Md  # (g, g'): projection onto the dropped components, in head coordinates
            cols_re, cols_im = torch.arange(n_kv) * D + f, torch.arange(n_kv) * D + f + half
            for g in range(n_kv):
                # k' = k̃ · conj(z): re' = a re + b im, im' = a im - b re
                nope_maps[g, f, cols_re] += a[f] * P[g]
                nope_maps[g, f, cols_im] += b[f] * P[g]
                nope_maps[g, f + half, cols_im] += a[f] * P[g]
                nope_maps[g, f + half, cols_re] -= b[f] * P[g]
    pairs = [f for f, _ in kept]
    return RopePlan(pairs=pairs, key_rows=key_rows, q_maps=q_maps, nope_maps=nope_maps)


def shared_key_plan(q: torch.Tensor, k: torch.Tensor, rope_dim: int, by_norm: bool) -> RopePlan:
    """X-EcoMLA's plan (evenly spaced pairs, ``by_norm``: MHA2MLA's 2-norm pairs): RoPE key = head average of
    the chosen pairs, queries keep their own channels of those pairs, every other channel loses RoPE."""
    N, Hq, D = q.shape
    n_kv, half, n_keep = k.shape[1], D // 2, rope_dim // 2
    if by_norm:
        pairs = sorted(torch.topk(pair_norm_scores(q, k), n_keep).indices.tolist())
    else:
        pairs = xeco_pairs(half, n_keep)
    key_rows = torch.zeros(rope_dim, n_kv * D, dtype=torch.float64)
    q_maps = torch.zeros(Hq, rope_dim, D, dtype=torch.float64)
    pe = set()
    for p, f in enumerate(pairs):
        for c, ch in enumerate((f, f + half)):
            key_rows[p + c * n_keep, torch.arange(n_kv) * D + ch] = 1.0 / n_kv
            q_maps[:, p + c * n_keep, ch] = 1.0
            pe.add(ch)
    nope_maps = torch.zeros(n_kv, D, n_kv * D, dtype=torch.float64)
    for g in range(n_kv):
        for ch in range(D):
            if ch not in pe:
                nope_maps[g, ch, g * D + ch] = 1.0
    return RopePlan(pairs=pairs, key_rows=key_rows, q_maps=q_maps, nope_maps=nope_maps)


def rope_plan(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, settings) -> RopePlan:
    """Dispatch on ``settings.rope_init``; q (N, Hq, D), k (N, n_kv, D) float64 calibration queries/keys (pre-RoPE)."""
    init = settings.rope_init
    if init in ("xeco", "norm"):
        return shared_key_plan(q, k, settings.rope_dim, by_norm=init == "norm")
    return mixed_plan(q, k, inv_freq, settings.rope_dim, rotate=init == "rorope", rule=settings.dropped_rope,
                      horizon=settings.rope_horizon)
