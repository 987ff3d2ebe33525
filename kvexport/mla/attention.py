# SPDX-License-Identifier: Apache-2.0
"""Multi-head latent attention (DeepSeek-V2, 2024) over a latent cache, in the form a GQA model rewrites into
exactly (TransMLA, Meng et al. 2025; X-EcoMLA, Li et al. 2025, as one initialisation of it).

Per token the cache holds one latent row ``[c_kv ; RoPE(k_pe)]`` of ``r_kv + d_rope`` elements, shared by
all heads (cache_heads = 1, value_dim = 0: values are up-projected from ``c_kv = key[..., :r_kv]``).

Head i keeps the original model's query ``q_i`` (D = head_dim channels, after Qwen3's q_norm); two maps
take it to the latent's frames (u = the latent inputs: h, and for Qwen3 also the normed GQA keys):

    c_kv   = W_DKV u                        (r_kv)        kv_a_proj, no bias
    k_pe   = W_KR u + b_KR                  (d_rope)      k_rope_proj, one row shared by every head
    q_pe,i = W_QR,i q_i                     (d_rope)      q_rope (Hq, d_rope, D)
    [k_nope,i ; v_i] = W_UKV,i c_kv + b     (D + D)       kv_b_proj: rows per head [K-nope ; V]
    score_ij = (q_i · k_nope,ij + RoPE(q_pe,i) · RoPE(k_pe,j)) / sqrt(D)

The d_rope RoPE channels are frequency pairs in half-split layout (pair p = channels p and p + d_rope/2)
with the frequencies ``inv_freq[plan.rope_pairs]``; a frequency may appear several times (one pair per
KV head, or per rotated component, see :mod:`kvexport.mla.rope_plan`). With d_rope = n_kv · D and
r_kv = n_kv · D the cache is the GQA cache (keys in the RoPE part, values in the latent) and the module
reproduces the GQA attention exactly.

Two paths, selectable per module with ``absorb``:
- naive (decompressed): up-project every cached latent to per-head [k_nope ; RoPE(k_pe)] and v, attend.
- absorbed: ``q̃_i = [W_UK,iᵀ q_i ; W_QR,i q_i]`` so the score is ``[q̃_i ; RoPE(.)] · [c_j ; RoPE(k_pe,j)]``;
  attention runs over the latent directly (:func:`kvexport.ops.latent_attention.latent_attention`, the
  LatentAttention custom op of docs/custom_ops.md), then ``o_i = W_UV,i Σ_j p_ij c_j + b_V,i``.

Biases: the K-nope bias adds ``q_i · b_K,i`` to every logit of a query, a constant the softmax removes, so
the absorbed path drops it exactly; the V bias passes through the convex combination (Σ_j p_ij = 1) and
is added after W_UV. Both paths are therefore equal (to rounding).

Qwen3 (q_norm, k_norm): q_norm stays on the query path. k_norm is per KV head and nonlinear, so the
module keeps the GQA key projection and k_norm and feeds the normed keys to the latent projections
(u = [h ; k_norm(W_K h)]): the cached row is still one latent row per token, and the rewrite stays exact.
"""

from __future__ import annotations

import torch
from torch import nn

from kvexport.cache.quant import QuantizedRows
from kvexport.mla.config import MLALayerPlan
from kvexport.models.attention import RMSNorm, grouped_attention, reads_in_parts
from kvexport.models.rope import Rotary
from kvexport.models.spec import ModelSpec
from kvexport.ops.latent_attention import latent_attention


def latent_input_dim(spec: ModelSpec) -> int:
    """Width of u, the latent projections' input: H, plus the n_kv · D normed keys for q/k-norm models."""
    return spec.hidden_size + (spec.num_kv_heads * spec.head_dim if spec.qk_norm else 0)


class MLAAttention(nn.Module):
    """MLA attention module with the decoder's attention contract (see kvexport.models.attention).

    forward(h (B, T, H), positions (B, T), past_k (B, 1, S, r_kv + d_rope), past_v (B, 1, S, 0), past_pos (B, 1, S))
    -> out (B, T, H), k_new = latent rows (B, 1, T, r_kv + d_rope) post-RoPE, v_new (B, 1, T, 0), q_pre
    (B, Hq, T, D) = the per-head queries before RoPE (after q_norm); :meth:`score_queries` absorbs them.
    """

    def __init__(self, spec: ModelSpec, plan: MLALayerPlan, base_rotary: Rotary, absorb: bool = True):
        super().__init__()
        self.spec, self.plan, self.absorb = spec, plan, absorb
        H, D, Hq = spec.hidden_size, spec.head_dim, spec.num_heads
        self.num_heads, self.head_dim = Hq, D
        self.kv_rank, self.rope_dim = plan.kv_rank, plan.rope_dim
        if plan.q_rank is None:
            self.q_proj = nn.Linear(H, Hq * D, bias=spec.qkv_bias)
        else:
            self.q_a_proj = nn.Linear(H, plan.q_rank, bias=False)
            self.q_b_proj = nn.Linear(plan.q_rank, Hq * D, bias=spec.qkv_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(D, spec.rms_norm_eps)
            self.k_proj = nn.Linear(H, spec.num_kv_heads * D, bias=spec.qkv_bias)
            self.k_norm = RMSNorm(D, spec.rms_norm_eps)
        U = latent_input_dim(spec)
        self.q_rope = nn.Parameter(torch.zeros(Hq, self.rope_dim, D))
        self.kv_a_proj = nn.Linear(U, self.kv_rank, bias=False)
        self.k_rope_proj = nn.Linear(U, self.rope_dim, bias=spec.qkv_bias)
        self.kv_b_proj = nn.Linear(self.kv_rank, Hq * 2 * D, bias=True)  # the targets' mean (see rewrite)
        self.o_proj = nn.Linear(Hq * D, H, bias=spec.o_bias)
        inv = base_rotary.inv_freq[torch.tensor(plan.rope_pairs, dtype=torch.long)]
        self.rotary = Rotary(inv, base_rotary.scaling, offset=D)  # channels of a [q ; q_pe] head (naive path)
        self.score_rotary = Rotary(inv, base_rotary.scaling, offset=self.kv_rank)  # channels of a latent row
        self.scaling = D**-0.5

    cache_heads = property(lambda self: 1)
    #: the absorbed path reads an int8 / fp8 cache itself (:class:`~kvexport.cache.quant.QuantizedRows` handed by the
    #: PyTorch cache and the graphs; LatentAttention version 2 dequantizes on load, no float copy of the cache)
    reads_quantized = property(lambda self: self.absorb)
    key_dim = property(lambda self: self.kv_rank + self.rope_dim)
    value_dim = property(lambda self: 0)
    score_dim = property(lambda self: self.kv_rank + self.rope_dim)

    # ------------------------------------------------------------------ weights viewed per head
    def _w_ukv(self) -> torch.Tensor:
        """(Hq, 2 D, r_kv)"""
        return self.kv_b_proj.weight.view(self.num_heads, 2 * self.head_dim, self.kv_rank)

    def w_uk(self) -> torch.Tensor:
        """(Hq, D, r_kv): latent -> per-head no-RoPE key."""
        return self._w_ukv()[:, : self.head_dim]

    def w_uv(self) -> torch.Tensor:
        """(Hq, D, r_kv): latent -> per-head value."""
        return self._w_ukv()[:, self.head_dim :]

    def b_uv(self) -> torch.Tensor | None:
        """(Hq, D) value bias, or None."""
        b = self.kv_b_proj.bias
        if b is None:
            return None
        return b.view(self.num_heads, 2 * self.head_dim)[:, self.head_dim :]

    # ------------------------------------------------------------------ pieces
    def queries(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, H) -> q_pre (B, Hq, T, D) per head, before RoPE, after q_norm."""
        B, T, _ = h.shape
        q = self.q_proj(h) if self.plan.q_rank is None else self.q_b_proj(self.q_a_proj(h))
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        return self.q_norm(q) if self.spec.qk_norm else q

    def latent_inputs(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, H) -> u (B, T, U): h, and for q/k-norm models the normed GQA keys (B, T, n_kv · D) after it."""
        if not self.spec.qk_norm:
            return h
        B, T, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(B, T, self.spec.num_kv_heads, self.head_dim))
        return torch.cat([h, k.reshape(B, T, -1)], dim=-1)

    def latent(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """h (B, T, H), positions (B, T) -> cache rows (B, 1, T, r_kv + d_rope) = [c_kv ; RoPE(k_pe)]."""
        u = self.latent_inputs(h)
        row = torch.cat([self.kv_a_proj(u), self.k_rope_proj(u)], dim=-1)[:, None]
        return self.score_rotary.apply(row, positions)

    def rope_queries(self, q_pre: torch.Tensor) -> torch.Tensor:
        """q_pre (B, Hq, T, D) -> q_pe (B, Hq, T, d_rope), before RoPE."""
        return torch.matmul(q_pre, self.q_rope.transpose(-1, -2))  # (Hq, D, d_rope): the weight as MatMul reads it

    def score_queries(self, q_pre: torch.Tensor) -> torch.Tensor:
        """q_pre (B, Hq, T, D) -> absorbed pre-RoPE queries (B, Hq, T, r_kv + d_rope) = [W_UK,iᵀ q_i ; W_QR,i q_i]."""
        q_lat = torch.matmul(q_pre, self.w_uk())  # (B, Hq, T, D) @ (Hq, D, r_kv)
        return torch.cat([q_lat, self.rope_queries(q_pre)], dim=-1)

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (B, S, r_kv + d_rope) -> keys (B, Hq, S, D + d_rope) = [k_nope ; RoPE(k_pe)], values (B, Hq, S, D)."""
        B, S, _ = latent.shape
        D = self.head_dim
        kv = self.kv_b_proj(latent[..., : self.kv_rank]).view(B, S, self.num_heads, 2 * D).transpose(1, 2)
        k_pe = latent[:, None, :, self.kv_rank :].expand(B, self.num_heads, S, self.rope_dim)
        return torch.cat([kv[..., :D], k_pe], dim=-1), kv[..., D:]

    def absorbed_out(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat (B, Hq, T, R), the attention-weighted latent -> per-head outputs (B, Hq, T, D) = W_UV,i o + b_V,i."""
        # matmul, not einsum, here and in the queries: onnxruntime's Einsum permutes the weight on every call (MLA's
        # three per-head products took 56 % of a 385M model's decode step); the exporter stores the transposed
        # weight once (kvexport.export.onnx_graph._fold_weight_reshapes), so each is a plain MatMul
        out = torch.matmul(o_lat, self.w_uv().transpose(-1, -2))  # (B, Hq, T, r_kv) @ (Hq, r_kv, D)
        b = self.b_uv()
        return out if b is None else out + b[None, :, None, :]

    # ------------------------------------------------------------------ forward
    def forward(self, h, positions, past_k, past_v, past_pos):
        """Attend over [past latent slots ; this step's tokens]; past_* may have S = 0 slots. past_k: float rows, or
        (absorbed path) :class:`~kvexport.cache.quant.QuantizedRows` of an int8 / fp8 cache."""
        B, T, _ = h.shape
        q_pre = self.queries(h)
        lat_new = self.latent(h, positions)  # (B, 1, T, R + Dr)
        if isinstance(past_k, QuantizedRows):  # the codes go to the op as they are: (B, 1, S, R + Dr) uint8
            q = self.score_rotary.apply(self.score_queries(q_pre), positions)  # (B, Hq, T, R + Dr)
            o_lat = latent_attention(q, past_k.codes, positions, past_pos.squeeze(1), self.kv_rank, self.scaling,
                                     lat_new[:, 0], past_k.scale.squeeze(1), past_k.format_code)  # (B, Hq, T, R)
            out = self.absorbed_out(o_lat)
            out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
            return self.o_proj(out), lat_new, lat_new.new_zeros(B, 1, T, 0), q_pre
        if self.absorb and reads_in_parts(past_k, past_v):  # a large or bucketed cache: no copy of it per step
            # the cache buffer goes to the op as it is, (B, 1, S, R + Dr), and its positions squeezed (a view): an
            # index past_k[:, 0] is exported as a Gather, which copies the whole cache
            q = self.score_rotary.apply(self.score_queries(q_pre), positions)
            o_lat = latent_attention(q, past_k, positions, past_pos.squeeze(1), self.kv_rank, self.scaling,
                                     lat_new[:, 0])
            out = self.absorbed_out(o_lat).transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
            return self.o_proj(out), lat_new, lat_new.new_zeros(B, 1, T, 0), q_pre
        lat = torch.cat([past_k, lat_new], dim=2)[:, 0]  # (B, S, R + Dr)
        pos = torch.cat([past_pos, positions[:, None, :]], dim=2)[:, 0]  # (B, S)
        if self.absorb:
            q = self.score_rotary.apply(self.score_queries(q_pre), positions)  # (B, Hq, T, R + Dr)
            o_lat = latent_attention(q, lat, positions, pos, self.kv_rank, self.scaling)  # (B, Hq, T, R)
            out = self.absorbed_out(o_lat)
        else:
            k, v = self.decompress(lat)
            q = self.rotary.apply(torch.cat([q_pre, self.rope_queries(q_pre)], dim=-1), positions)
            k_pos = pos[:, None, :].expand(B, self.num_heads, pos.shape[-1])
            out, _ = grouped_attention(q, k, v, positions, k_pos, self.scaling)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out), lat_new, lat_new.new_zeros(B, 1, T, 0), q_pre

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, r_kv={self.kv_rank}, d_rope={self.rope_dim}, "
                f"r_q={self.plan.q_rank}, absorb={self.absorb}")
