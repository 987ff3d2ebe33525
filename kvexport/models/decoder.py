# SPDX-License-Identifier: Apache-2.0
"""kvexport's compact decoder: a HF causal LM re-expressed with explicit positions and caches.

One module for Llama, Qwen2, Qwen3 and Mistral (they differ only in the attention switches of
:class:`~kvexport.models.spec.ModelSpec`). Parameter names are HF's minus the ``model.`` prefix,
so weights load with one ``load_state_dict``. The HF model stays the reference: with a cache that
never evicts, logits match HF's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from kvexport.cache.static_cache import LayerCache, ScoreContext, StaticCache
from kvexport.models.attention import GQAAttention, RMSNorm
from kvexport.models.rope import Rotary
from kvexport.models.spec import ModelSpec


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        H, F, b = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(H, F, bias=b)
        self.up_proj = nn.Linear(H, F, bias=b)
        self.down_proj = nn.Linear(F, H, bias=b)
        self.act = ACT2FN[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, attn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, h, positions, past_k, past_v, past_pos):
        """h (B, T, H) -> h (B, T, H), k_new, v_new (B, Hc, T, .), q_pre (B, Hq, T, .)."""
        a, k_new, v_new, q_pre = self.self_attn(self.input_layernorm(h), positions, past_k, past_v, past_pos)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k_new, v_new, q_pre


class Decoder(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; caches are passed in, never hidden.

    ``forward(input_ids (B, T), positions (B, T), cache, mode)`` -> logits (B, T, V);
    positions are true token positions, -1 for left padding.
    """

    def __init__(self, spec: ModelSpec, rotary: Rotary, attention_factory=None):
        super().__init__()
        self.spec = spec
        self.rotary = rotary
        make_attn = attention_factory or (lambda i: GQAAttention(spec, rotary))
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, make_attn(i)) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> "Decoder":
        """Copy a transformers ``*ForCausalLM`` (Llama, Qwen2, Qwen3, Mistral) into a Decoder."""
        spec = ModelSpec.from_hf_config(hf_model.config)
        base = hf_model.model
        rotary = Rotary.from_hf_rotary(base.rotary_emb)
        param = next(hf_model.parameters())
        dec = cls(spec, rotary).to(dtype=param.dtype, device=param.device)
        state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
        if spec.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        missing, unexpected = dec.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq")]
        if missing or unexpected:
            from kvexport.errors import BadModel

            raise BadModel(f"weights do not match the {spec.family} layout: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
        dec.rotary.inv_freq.copy_(base.rotary_emb.inv_freq)
        return dec.eval()

    def new_cache(self, batch: int, press, budgets: int | list[int], window: int) -> StaticCache:
        """A :class:`StaticCache` with per-layer capacity ``budget + window``, on this model's device/dtype."""
        L = self.spec.num_layers
        if isinstance(budgets, int):
            budgets = [budgets] * L
        p = next(self.parameters())
        layers = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            ctx = ScoreContext(rotary=attn.score_rotary if hasattr(attn, "score_rotary") else attn.rotary,
                               scaling=attn.scaling, layer_idx=i, num_layers=L)
            layers.append(LayerCache(batch, attn.cache_heads, attn.key_dim, attn.value_dim, attn.num_heads,
                                     attn.score_dim if hasattr(attn, "score_dim") else attn.head_dim,
                                     budgets[i], window, p.dtype, p.device, ctx))
        return StaticCache(layers, press)

    # ----------------------------------------------------------------- running
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache | None = None,
                mode: str = "prefill", output_hidden: bool = False):
        """Run T tokens through every layer.

        mode "prefill": the chunk joins the cache and each layer is compacted to its budget if it
        overflows. mode "decode": tokens are appended; when a layer is full, all are compacted.
        With ``cache=None`` the tokens attend only to themselves (a plain forward).
        Returns logits (B, T, V) (and the final hidden states (B, T, H) with ``output_hidden``).
        """
        h = self.embed_tokens(input_ids)
        B = input_ids.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if cache is None:
                empty_k = h.new_zeros(B, attn.cache_heads, 0, attn.key_dim)
                empty_v = h.new_zeros(B, attn.cache_heads, 0, attn.value_dim)
                empty_p = positions.new_zeros(B, attn.cache_heads, 0)
                h, *_ = layer(h, positions, empty_k, empty_v, empty_p)
                continue
            lc = cache.layers[i]
            pk, pv, pp = lc.occupied()
            h, k_new, v_new, q_pre = layer(h, positions, pk, pv, pp)
            new_pos = positions[:, None, :].expand(B, k_new.shape[1], positions.shape[1])
            q_score = attn.score_queries(q_pre)
            if mode == "prefill":
                lc.prefill(cache.press, k_new, v_new, new_pos, q_score, positions)
            else:
                lc.append(k_new, v_new, new_pos, q_score, positions)
        if cache is not None and mode == "decode" and cache.is_full():
            cache.compact()
        h = self.norm(h)
        logits = self.lm_head(h)
        return (logits, h) if output_hidden else logits
