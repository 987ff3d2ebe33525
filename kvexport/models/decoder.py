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

from kvexport.cache.plan import CachePlan
from kvexport.cache.static_cache import LayerCache, StaticCache
from kvexport.errors import BadUsage
from kvexport.models.attention import GQAAttention, RMSNorm
from kvexport.models.rope import Rotary
from kvexport.models.spec import ModelSpec
from kvexport.presses.context import ScoreContext


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
        make_attn = attention_factory or (lambda i: GQAAttention(spec, rotary, i))
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, make_attn(i)) for i in range(spec.num_layers))
        for i, layer in enumerate(self.layers):  # faithful or refused: a windowed layer needs a windowed attention
            w = spec.sliding_window_of(i)
            if w is not None and getattr(layer.self_attn, "sliding_window", None) != w:
                from kvexport.errors import BadModel

                raise BadModel(f"layer {i} has sliding_window {w}, which {type(layer.self_attn).__name__} does not "
                               "support; use the model without an MLA rewrite (eviction works with windows)")
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> "Decoder":
        """A transformers ``*ForCausalLM`` (Llama, Qwen2, Qwen3, Mistral) as a Decoder that **shares** its weights.

        The Decoder is built on the meta device (no allocation, no random init) and its parameters are the HF
        model's own tensors (``load_state_dict(assign=True)``), so both together hold the weights once; for a
        checkpoint loaded by :func:`kvexport.models.loading.load_hf_model` these are memory-mapped safetensors.
        Writing into one model's weights in place changes the other's.
        """
        spec = ModelSpec.from_hf_config(hf_model.config)
        base = hf_model.model
        rotary = Rotary.from_hf_rotary(base.rotary_emb)  # real: built outside the meta device
        inv_freq = rotary.inv_freq.clone()  # the frequencies as loaded (from_hf_rotary)
        with torch.device("meta"):
            dec = cls(spec, rotary)
        param = next(hf_model.parameters())
        # one dtype throughout, as the copying version made it (a tensor of another dtype is converted alone)
        state = {k.removeprefix("model."): v if v.dtype == param.dtype or not v.is_floating_point() else v.to(param.dtype)
                 for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
        if spec.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        missing, unexpected = dec.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if not m.endswith("inv_freq")]
        if missing or unexpected:
            from kvexport.errors import BadModel

            raise BadModel(f"weights do not match the {spec.family} layout: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
        if spec.tie_word_embeddings:
            dec.lm_head.weight = dec.embed_tokens.weight  # one parameter, as the HF model has it
        dec.rotary.to(dtype=param.dtype, device=param.device)  # as the copying version left it
        dec.rotary.inv_freq.copy_(inv_freq)
        left = [n for n, t in list(dec.named_parameters()) + list(dec.named_buffers()) if t.is_meta]
        if left:
            from kvexport.errors import BadModel

            raise BadModel(f"weights do not match the {spec.family} layout: no value for {left[:3]}")
        return dec.eval()

    def new_cache(self, batch: int, press, budgets: int | list[int], window: int, chunk: int | None = None,
                  lookahead: int = 0) -> StaticCache:
        """A :class:`StaticCache` on this model's device/dtype, per-layer capacity ``budget + window``.

        With a press the cache evicts (``budget`` kept, ``window`` decode slots and observation queries); with
        ``press=None`` nothing is ever evicted and ``budget + window`` is a hard capacity (kvexport.cache.plan).
        ``lookahead``: the prompt's last columns that observe each earlier chunk (plan rule 3b; press only).
        """
        L = self.spec.num_layers
        if isinstance(budgets, int):
            budgets = [budgets] * L
        if len(budgets) != L:
            raise BadUsage(f"{len(budgets)} budgets for {L} layers")
        if window < (1 if press is not None else 0):
            raise BadUsage(f"window {window} must be >= 1")
        evicting = press is not None
        plan = CachePlan.for_press(evicting, budgets, window, chunk, lookahead)
        p = next(self.parameters())
        layers = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            ctx = ScoreContext(rotary=attn.score_rotary if hasattr(attn, "score_rotary") else attn.rotary,
                               scaling=attn.scaling, layer_idx=i, num_layers=L,
                               sliding_window=getattr(attn, "sliding_window", None))
            layers.append(LayerCache(batch, attn.cache_heads, attn.key_dim, attn.value_dim, attn.num_heads,
                                     attn.score_dim if hasattr(attn, "score_dim") else attn.head_dim,
                                     plan.budgets[i], plan.window, p.dtype, p.device, ctx, evicting,
                                     capacity=plan.capacities[i]))
        return StaticCache(layers, press, plan)

    # ----------------------------------------------------------------- running
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache | None = None,
                mode: str = "prefill", output_hidden: bool = False, tail_ids: torch.Tensor | None = None,
                tail_positions: torch.Tensor | None = None, last_only: bool = False):
        """Run T tokens through every layer; the cache follows the rules of :mod:`kvexport.cache.plan`.

        mode "prefill": a chunk of T prompt columns joins the cache (compacted to the budget where it
        overflows). mode "decode": one token per row (T = 1); when a layer is full, all are compacted.
        With ``cache=None`` the tokens attend only to themselves (a plain forward).
        ``tail_ids`` / ``tail_positions`` (B, L), prefill only: the chunk's lookahead tail (plan rule 3b): run after
        the chunk at its own positions, never stored, observing the chunk when it compacts.
        Returns logits (B, T, V) of the chunk (and the final hidden states (B, T, H) with ``output_hidden``);
        ``last_only``: of its last column only, (B, 1, V) (and (B, 1, H)), what a prefill chunk is run for: the LM
        head's T x V product and its (B, T, V) float32 output are not made (on SmolLM2 a 512-token chunk's logits
        are 100 MB per row).
        """
        B, T = input_ids.shape
        if tail_ids is not None:
            if cache is None or mode != "prefill" or cache.press is None:
                raise BadUsage("a lookahead tail observes a prefill chunk of an evicting cache")
            input_ids = torch.cat([input_ids, tail_ids], dim=1)
        h = self.embed_tokens(input_ids)
        if cache is None:
            for layer in self.layers:
                attn = layer.self_attn
                empty_k = h.new_zeros(B, attn.cache_heads, 0, attn.key_dim)
                empty_v = h.new_zeros(B, attn.cache_heads, 0, attn.value_dim)
                empty_p = positions.new_zeros(B, attn.cache_heads, 0)
                h, *_ = layer(h, positions, empty_k, empty_v, empty_p)
            h = self.norm(h[:, -1:] if last_only else h)
            logits = self.lm_head(h)
            return (logits, h) if output_hidden else logits
        if mode == "decode":
            if T != 1:
                raise BadUsage(f"decode takes one token per row, got {T}")
            h = self._decode_layers(h, positions, [cache])
        elif mode == "prefill":
            step = cache.begin_prefill(T)
            fills = step.fills
            all_positions = positions if tail_ids is None else torch.cat([positions, tail_positions], dim=1)
            for i, layer in enumerate(self.layers):
                attn, lc = layer.self_attn, cache.layers[i]
                h, k_new, v_new, q_pre = layer(h, all_positions, *lc.view(fills[i]))
                q_score = attn.score_queries(q_pre) if cache.press is not None else None
                if tail_ids is not None:  # the chunk's rows join the cache, the tail's queries observe (rule 3b)
                    k_new, v_new, q_score = k_new[:, :, :T], v_new[:, :, :T], q_score[:, :, T:]
                new_pos = positions[:, None, :].expand(B, k_new.shape[1], T)
                lc.prefill(cache.press, fills[i], step.compacts[i], k_new, v_new, new_pos, q_score,
                           positions if tail_ids is None else tail_positions, own_observers=tail_ids is None)
            cache.end_prefill(step)
        else:
            raise BadUsage(f"mode {mode!r} is not one of: prefill, decode")
        h = self.norm(h[:, T - 1:T] if last_only else h[:, :T])
        logits = self.lm_head(h)
        return (logits, h) if output_hidden else logits

    @torch.no_grad()
    def decode_caches(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[StaticCache]) -> torch.Tensor:
        """One decode step of several independent caches in one batch: ``caches[j]`` holds rows
        ``[sum of the earlier caches' rows, + its own)`` of input_ids / positions (B, 1). Each cache follows its own
        plan (its own fills, slots and compactions), exactly as :meth:`forward` with ``mode="decode"`` would step it
        alone; the weights are read once for all rows. -> logits (B, 1, V)."""
        if input_ids.shape[1] != 1:
            raise BadUsage(f"decode takes one token per row, got {input_ids.shape[1]}")
        if sum(c.layers[0].k.shape[0] for c in caches) != input_ids.shape[0]:
            raise BadUsage(f"{input_ids.shape[0]} rows for caches of {[c.layers[0].k.shape[0] for c in caches]} rows")
        if len({c.press is None for c in caches}) > 1:
            raise BadUsage("caches decoded together either all evict or none does")
        h = self._decode_layers(self.embed_tokens(input_ids), positions, caches)
        return self.lm_head(self.norm(h))

    def _decode_layers(self, h: torch.Tensor, positions: torch.Tensor, caches: list[StaticCache]) -> torch.Tensor:
        """Plan rule 4 for every cache (a token per row at its slot; a compaction where a layer is full), the
        layers run once over all rows: each layer attends over every cache's occupied slots, a shorter one padded
        with empty slots (position -1, which no query sees: :mod:`kvexport.cache.visibility`)."""
        steps = [c.begin_decode() for c in caches]
        rows = [c.layers[0].k.shape[0] for c in caches]
        evicting = caches[0].press is not None
        B = h.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if len(caches) == 1:
                past = caches[0].layers[i].view(steps[0].slots[i])
            else:  # the stored rows stacked (int8 codes, not float copies), then read once
                past = caches[0].layers[i].read(*_stack_stored([(c.layers[i], st.slots[i])
                                                                for c, st in zip(caches, steps, strict=True)]))
            h, k_new, v_new, q_pre = layer(h, positions, *past)
            q_score = attn.score_queries(q_pre) if evicting else None
            new_pos = positions[:, None, :].expand(B, k_new.shape[1], 1)
            at = 0
            for c, st, n in zip(caches, steps, rows, strict=True):
                r = slice(at, at + n)
                at += n
                c.layers[i].append(st.slots[i], st.query_slot if evicting else None, k_new[r], v_new[r], new_pos[r],
                                   None if q_score is None else q_score[r], positions[r])
        for c, st in zip(caches, steps, strict=True):
            c.end_decode(st)
        return h


def _stack_stored(layers: list) -> tuple:
    """Several caches' layer (LayerCache, fill) -> their stored rows and positions (k, v, ks, vs, pos) stacked on the
    batch axis, (sum B_j, Hc, max fill, .): the shorter ones padded with zero rows at position -1 (never visible)."""
    S = max(int(f) for _, f in layers)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        n = S - t.shape[2]
        if n == 0:
            return t
        shape = list(t.shape)
        shape[2] = n
        return torch.cat([t, t.new_full(shape, value)], dim=2)

    parts = [(*lc.stored(f), lc.pos[:, :, :f]) for lc, f in layers]
    out = []
    for j, value in enumerate((0, 0, 0, 0, -1)):
        col = [p[j] for p in parts]
        out.append(None if col[0] is None else torch.cat([pad(t, value) for t in col]))
    return tuple(out)
