# SPDX-License-Identifier: Apache-2.0
"""Grouped-query attention over an explicit cache, written for export (no data-dependent control flow).

Causality and padding come from positions, not from a triangular mask: query t may see key j iff
``0 <= pos_k[j] <= pos_q[t]`` (and ``pos_q[t] - pos_k[j] < sliding_window`` where the layer has one, HF's
``sliding_window_overlay``). That one rule (:func:`visible`) covers the prompt, a chunk after a compacted
cache, a decode step, left padding (position -1), and the presses' attention estimates.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kvexport.cache.quant import QuantizedRows
from kvexport.cache.visibility import visible
from kvexport.models.rope import Rotary
from kvexport.models.spec import ModelSpec


class RMSNorm(nn.Module):
    """RMSNorm as Llama computes it: in fp32, weight applied in the input dtype.

    Written ``x / sqrt(mean(x^2) + eps)`` (HF multiplies by ``rsqrt``: the same to one rounding step) because that
    is the form onnxruntime fuses into one SimplifiedLayerNormalization kernel, and TensorRT into its norm layer."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """q_pos (B, T), k_pos (B, Hc, S) -> bool (B, Hc, 1, T, S) (:func:`visible` with a group axis)."""
    return visible(q_pos, k_pos, sliding_window)[:, :, None]


def mask_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """The position rule (:func:`visible`) as an additive float32 bias (B, Hc, 1, T, S): 0 where a key is visible,
    ``finfo.min`` where not. Added to the logits it gives :func:`torch.where`'s masked logits bit for bit (a logit
    of magnitude below 1e31 added to ``finfo.min`` rounds to ``finfo.min``; ``x + 0`` is ``x``), and a graph then
    selects over one copy per KV head and adds with a broadcast over the G query heads, instead of a broadcast
    Where over every query head's logits (onnxruntime's broadcasting Where was 16 % of SmolLM2's prefill on a CPU,
    2026-12-06)."""
    return torch.where(visibility_mask(q_pos, k_pos, sliding_window), 0.0, torch.finfo(torch.float32).min)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scaling: float,
    return_probs: bool = False,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of grouped queries over per-KV-head keys, masked by positions.

    q (B, Hq, T, Dk), k (B, Hc, S, Dk), v (B, Hc, S, Dv), q_pos (B, T), k_pos (B, Hc, S) with
    Hq = Hc * G. Returns out (B, Hq, T, Dv) and, if asked, probs (B, Hq, T, S).
    A query that sees no key (a padding query) gets a uniform average: harmless, never read.
    """
    B, Hq, T, Dk = q.shape
    Hc, S = k.shape[1], k.shape[2]
    G = Hq // Hc
    qg = q.reshape(B, Hc, G * T, Dk)
    logits = torch.matmul(qg, k.transpose(-1, -2)).reshape(B, Hc, G, T, S) * scaling
    logits = logits.float() + mask_bias(q_pos, k_pos, sliding_window)
    probs = torch.softmax(logits, dim=-1).to(v.dtype)  # (B, Hc, G, T, S)
    out = torch.matmul(probs.reshape(B, Hc, G * T, S), v).reshape(B, Hq, T, v.shape[-1])
    return out, (probs.reshape(B, Hq, T, S) if return_probs else None)


#: above this many bytes of cached keys + values per layer, attention reads the cache and the new tokens as two
#: parts instead of concatenating them: a concatenation copies the cache (about 2 us per 32 KiB on a CPU), the
#: two-part merge costs a fixed ~20 small ops more (about 50 us on onnxruntime's CPU kernels)
CONCAT_LIMIT_BYTES = 512 << 10


def reads_in_parts(k_past: torch.Tensor, v_past: torch.Tensor) -> bool:
    """Whether attention reads the cache and this step's tokens as two parts (True) or concatenates them (False):
    a cache of a symbolic length (a bucketed full cache), or one above :data:`CONCAT_LIMIT_BYTES` per sequence. The
    one rule for GQA (:func:`attention`) and MLA (LatentAttention's ``new_latent``)."""
    if isinstance(k_past.shape[2], torch.SymInt):
        return True
    cached = k_past[0].numel() * k_past.element_size() + v_past[0].numel() * v_past.element_size()
    return cached * k_past.shape[0] > CONCAT_LIMIT_BYTES


def reads_codes(q: torch.Tensor, k_past, v_past, k_new: torch.Tensor) -> bool:
    """Whether :func:`attention` reads a quantized past (:class:`~kvexport.cache.quant.QuantizedRows` keys and
    values) by its codes, with the rows' scales multiplied into the logits and the probabilities instead of into
    every key and value (read as two parts, :func:`attention_over_parts`, whatever the cache's size): float32
    attention whose every past slot meets fewer queries (G x T, T a static width) than it has channels, which is a
    decode step (G x T = 3 against 64 on SmolLM2). The exported decode graph then makes one pass less over the
    cache per step. Else the past is dequantized first. Shapes and dtypes only, so the eager library path and a
    traced graph take the same arithmetic (an int8 cache turns a rounding difference into a code apart)."""
    if not (isinstance(k_past, QuantizedRows) and isinstance(v_past, QuantizedRows)) or q.dtype != torch.float32:
        return False
    if (_FUSED_EAGER and _eager()) or (not isinstance(k_past.shape[2], torch.SymInt) and k_past.shape[2] == 0):
        return False
    if isinstance(q.shape[2], torch.SymInt):  # a last chunk of dynamic width (plan rule 2b): no guard on its width
        return False
    gt = (q.shape[1] // k_new.shape[1]) * q.shape[2]
    return gt < min(k_past.shape[-1], v_past.shape[-1])


def attention(q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos, scaling: float,
              sliding_window: int | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, T, Dk) over the past (B, Hc, S, .) and this step's tokens (B, Hc, T, .).

    Small caches are concatenated with the new tokens (one softmax, :func:`grouped_attention`); large ones are
    read as two parts (:func:`attention_over_parts`, no copy of the cache). The rule depends on shapes only
    (:data:`CONCAT_LIMIT_BYTES`), so an exported graph carries one of the two, and both are the same softmax. A
    cache whose length is a symbolic dimension (a bucketed full cache, traced with a dynamic capacity axis) is
    read as two parts: its size is not known when the graph is made. A quantized past
    (:class:`~kvexport.cache.quant.QuantizedRows`) is read by its codes where :func:`reads_codes` says so, else
    dequantized here first.
    """
    if isinstance(k_past, QuantizedRows) or isinstance(v_past, QuantizedRows):
        if reads_codes(q, k_past, v_past, k_new):
            return attention_over_parts(q, [(k_past, v_past, pos_past), (k_new, v_new, pos_new)], q_pos, scaling,
                                        sliding_window)
        k_past, v_past = (x.dequantize(k_new.dtype) if isinstance(x, QuantizedRows) else x for x in (k_past, v_past))
    if _FUSED_EAGER and _eager() and q.dtype == torch.float32 and k_past.dtype == q.dtype:
        return _attention_eager(q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos, scaling, sliding_window)
    if not isinstance(k_past.shape[2], torch.SymInt) and k_past.shape[2] == 0:
        return attention_over_parts(q, [(k_new, v_new, pos_new)], q_pos, scaling, sliding_window)
    if reads_in_parts(k_past, v_past):
        return attention_over_parts(q, [(k_past, v_past, pos_past), (k_new, v_new, pos_new)], q_pos, scaling,
                                    sliding_window)
    out, _ = grouped_attention(q, torch.cat([k_past, k_new], dim=2), torch.cat([v_past, v_new], dim=2), q_pos,
                               torch.cat([pos_past, pos_new], dim=2), scaling, sliding_window=sliding_window)
    return out


#: whether eager float32 attention runs through torch's fused kernel (:func:`fused_eager_attention`); off by default
_FUSED_EAGER = False


@contextlib.contextmanager
def fused_eager_attention(on: bool = True):
    """Within this block, eager float32 attention runs through ``scaled_dot_product_attention``
    (:func:`_attention_eager`): 2-3x faster on a CPU at 4k-token caches, equal to the traced forms to rounding
    (1e-7), but not bit for bit. The studies and the sweep turn it on; the library path, the validation reference
    and everything compared with an export keep the traced forms, whose rounding the exports share (a cache stored
    in int8 turns a 1e-7 difference into a code apart, and at a near tie into another kept token)."""
    global _FUSED_EAGER
    before, _FUSED_EAGER = _FUSED_EAGER, bool(on)
    try:
        yield
    finally:
        _FUSED_EAGER = before


def _eager() -> bool:
    """Not being traced or exported (the graphs carry the two forms of :func:`attention` above)."""
    return not (torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting())


def _attention_eager(q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos, scaling, sliding_window):
    """:func:`attention` run eagerly (the library path, studies, the validation reference): the same softmax by
    torch's fused ``scaled_dot_product_attention``, the rule of :func:`visible` as an additive bias of
    ``finfo.min`` (so a query that sees no key averages uniformly, as :func:`grouped_attention` does). 2-3x faster
    on a CPU at 4k-token caches; equal to the traced forms to rounding (1e-7)."""
    B, Hq, T, Dk = q.shape
    Hc = k_new.shape[1]
    k = torch.cat([k_past, k_new], dim=2)
    v = torch.cat([v_past, v_new], dim=2)
    S = k.shape[2]
    bias = mask_bias(q_pos, torch.cat([pos_past, pos_new], dim=2), sliding_window)[:, :, 0]  # (B, Hc, T, S)
    # one (batch, KV head) per SDPA batch entry, its G query heads sharing one key head and one bias: no G copies
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(B * Hc, Hq // Hc, T, Dk), k.reshape(B * Hc, 1, S, Dk), v.reshape(B * Hc, 1, S, v.shape[-1]),
        attn_mask=bias.reshape(B * Hc, 1, T, S), scale=scaling, enable_gqa=Hq != Hc)
    return out.reshape(B, Hq, T, v.shape[-1])


def attention_over_parts(q, parts, q_pos, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
    """:func:`grouped_attention` over the union of several key/value parts, without concatenating them.

    q (B, Hq, T, Dk); parts: [(k (B, Hc, S_p, Dk), v (B, Hc, S_p, Dv), k_pos (B, Hc, S_p)), ...] (e.g. the cache
    and this step's tokens). A decode step (T = 1) puts the parts' few masked logits side by side for one softmax
    (a graph's single Softmax node where the merge below takes fifteen per layer: SmolLM2's step 38.4 -> 35.0 ms);
    a chunk's logits are many, so each part is exponentiated against one shared maximum and the parts'
    numerators and denominators summed (the log-sum-exp merge of split-KV attention; one softmax over them made
    a 2k-token prefill 8 % slower). Either is the softmax over the concatenation, to rounding, reading each part's
    rows once and copying none. A query that sees no key averages every entry uniformly, as
    :func:`grouped_attention` does. -> out (B, Hq, T, Dv).
    """
    B, Hq, T, Dk = q.shape
    Hc = parts[0][0].shape[1]
    G = Hq // Hc
    qg = q.reshape(B, Hc, G * T, Dk)
    fmin = torch.finfo(torch.float32).min
    # eager and without gradients, the (B, Hc, G, T, S) logits are scaled, masked and exponentiated where they lie:
    # the same values, a third less time than a new tensor for each step (traced graphs keep the plain forms)
    floats = [t for t in (q, *sum(parts, ())) if not isinstance(t, QuantizedRows)]
    inplace = _eager() and not (torch.is_grad_enabled() and any(t.requires_grad for t in floats))
    out_dtype = next((v.dtype for _, v, _ in parts if not isinstance(v, QuantizedRows)), q.dtype)
    logits = []
    for k, _, k_pos in parts:
        if isinstance(k, QuantizedRows):  # codes: q . (c s) = (q . c) s, one product per slot and query (float32)
            kx, shift = k.shifted()  # int8: q . (c - 128) = q . c - 128 sum(q), per query, not per code
            lg = torch.matmul(qg, kx.transpose(-1, -2))
            if shift:
                lg = lg - shift * qg.sum(-1, keepdim=True)
            lg = lg.reshape(B, Hc, G, T, k.shape[2])
            per_slot = (k.scale.float() * scaling).reshape(B, Hc, 1, 1, -1)
            lg = lg.mul_(per_slot) if inplace else lg * per_slot
        else:
            lg = torch.matmul(qg, k.transpose(-1, -2)).reshape(B, Hc, G, T, k.shape[2])
            lg = (lg.mul_(scaling) if inplace else lg * scaling).float()
        if inplace:
            logits.append(lg.masked_fill_(~visibility_mask(q_pos, k_pos, sliding_window), fmin))
        else:
            logits.append(lg + mask_bias(q_pos, k_pos, sliding_window))
    # masked entries get exp(min - max) = 0, unless nothing is visible (then every entry the same weight)
    if isinstance(T, int) and T == 1:  # a decode step: one softmax over the parts' few logits side by side
        shares = torch.softmax(torch.cat(logits, dim=-1), dim=-1).split([lg.shape[-1] for lg in logits], dim=-1)
        den = None
    else:  # a chunk's many logits are not copied: each part exponentiated against the shared maximum, then summed
        m = torch.stack([lg.amax(-1) for lg in logits]).amax(0)[..., None]  # (B, Hc, G, T, 1)
        shares = [lg.sub_(m).exp_() if inplace else torch.exp(lg - m) for lg in logits]
        den = shares[0].sum(-1)
        for e in shares[1:]:
            den = den + e.sum(-1)
        den = den.reshape(B, Hc, G * T, 1)
    out = None
    for pr, (_, v, _) in zip(shares, parts, strict=True):
        if isinstance(v, QuantizedRows):  # sum_j p_j (c_j s_j) = sum_j (p_j s_j) c_j
            w = (pr * v.scale.float().reshape(B, Hc, 1, 1, -1)).reshape(B, Hc, G * T, -1)
            vx, shift = v.shifted()  # int8: sum_j w_j (c_j - 128) = sum_j w_j c_j - 128 sum_j w_j
            n = torch.matmul(w, vx)
            if shift:
                n = n - shift * w.sum(-1, keepdim=True)
        else:
            n = torch.matmul(pr.to(v.dtype).reshape(B, Hc, G * T, -1), v).float()
        out = n if out is None else out + n
    return (out if den is None else out / den).to(out_dtype).reshape(B, Hq, T, -1)


class GQAAttention(nn.Module):
    """The attention of Llama / Qwen2 (q/k/v bias) / Qwen3 (q_norm, k_norm) / Mistral.

    forward(h (B, T, H), positions (B, T), past k/v/pos) -> out (B, T, H) and this step's
    k_new, v_new (B, Hkv, T, D), keys post-RoPE, and q_pre (B, Hq, T, D), queries before RoPE
    (after q_norm), which the presses score with.
    """

    def __init__(self, spec: ModelSpec, rotary: Rotary, layer_idx: int = 0):
        super().__init__()
        self.spec = spec
        self.sliding_window = spec.sliding_window_of(layer_idx)
        H, D = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.q_proj = nn.Linear(H, spec.num_heads * D, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(H, spec.num_kv_heads * D, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(H, spec.num_kv_heads * D, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * D, H, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(D, spec.rms_norm_eps)
            self.k_norm = RMSNorm(D, spec.rms_norm_eps)
        self.rotary = rotary
        self.scaling = D**-0.5
        #: set only while the in-place decode graph is traced (kvexport.export.graphs.InPlaceDecodeStep): the slot
        #: (B,) int32 this step's token goes to; attention then writes it into the cache and returns the cache
        self.step_slots: torch.Tensor | None = None

    # The cache stores what these return; an MLA attention returns a latent instead (same contract).
    cache_heads = property(lambda self: self.num_kv_heads)
    #: an int8 / fp8 cache is handed as codes (:class:`~kvexport.cache.quant.QuantizedRows`), keys and values:
    #: :func:`attention` reads a decode step's past by its codes (:func:`reads_codes`) and dequantizes otherwise
    reads_quantized = reads_quantized_values = True
    key_dim = property(lambda self: self.head_dim)
    value_dim = property(lambda self: self.head_dim)

    def project(self, h: torch.Tensor, positions: torch.Tensor):
        """h (B, T, H) -> q_pre (B, Hq, T, D), k (B, Hkv, T, D) post-RoPE, v (B, Hkv, T, D)."""
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, self.rotary.apply(k, positions), v

    def score_queries(self, q_pre: torch.Tensor) -> torch.Tensor:
        """Queries in the space the cached keys live in (identity here; MLA absorbs W_UK)."""
        return q_pre

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        past_pos: torch.Tensor,
    ):
        """Attend over the past slots and this step's tokens (without copying the past). past_* may have S = 0."""
        if self.step_slots is not None:  # one decode token written into the cache in place (onnxruntime graph)
            return self._step_in_place(h, positions, past_k, past_v, past_pos)
        B, T, _ = h.shape
        q_pre, k_new, v_new = self.project(h, positions)
        q = self.rotary.apply(q_pre, positions)
        new_pos = positions[:, None, :].expand(B, self.num_kv_heads, T)
        out = attention(q, past_k, past_v, past_pos, k_new, v_new, new_pos, positions, self.scaling,
                        self.sliding_window)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out), k_new, v_new, q_pre

    def _step_in_place(self, h, positions, past_k, past_v, past_pos):
        """The in-place decode graph's layer step (T = 1): the projections in (B, 1, H * D) layout, rotated, written
        into the cache at ``step_slots`` and attended by one :func:`kvexport.ops.cache_step_attention.cache_step_attention`
        (onnxruntime's GroupQueryAttention). -> out (B, 1, H), the updated k / v cache, q_pre (B, Hq, 1, D) for the
        query ring. The same arithmetic as :meth:`forward`; only the layout and the one fused op differ."""
        from kvexport import ops

        B, T, _ = h.shape
        Hq, Hc, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if self.spec.qk_norm:
            q = self.q_norm(q.view(B, T, Hq, D)).view(B, T, Hq * D)
            k = self.k_norm(k.view(B, T, Hc, D)).view(B, T, Hc * D)
        cos, sin = self.rotary.cos_sin(positions, q.dtype)  # (B, 1, D), halves repeated
        half = self.rotary.dim // 2
        # the position rule as an additive bias per query head (past_pos already holds this token's position)
        bias = mask_bias(positions, past_pos, self.sliding_window)[:, :, 0].to(q.dtype)  # (B, Hc, 1, S)
        if Hq != Hc:
            bias = bias.index_select(1, torch.arange(Hq, device=bias.device) // (Hq // Hc))
        out, k_cache, v_cache = ops.cache_step_attention.cache_step_attention(
            q, k, v, past_k, past_v, bias, self.step_slots, cos[:, 0, :half], sin[:, 0, :half], float(self.scaling),
            Hq, Hc)
        return self.o_proj(out), k_cache, v_cache, q.view(B, T, Hq, D).transpose(1, 2)
