# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with kvexport's PyTorch decoder and static cache: the library path a user calls, and the
reference ``kvexport validate`` compares every export with (unpadded prompts, the export's press, budget,
window and chunk). The cache rules are :mod:`kvexport.cache.plan`'s; this module only loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kvexport.cache import plan as cache_plan
from kvexport.cache.formats import kv_format
from kvexport.errors import BadUsage


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask (B, N) of 0/1, left padded -> positions (B, N), -1 on padding (plan rule 1)."""
    pos = cache_plan.positions_from_mask(attention_mask.detach().cpu().numpy())
    return torch.from_numpy(pos).to(attention_mask.device)


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, n_new) generated (or forced) ids
    prompt_logits: torch.Tensor  # (B, V) logits at the last prompt token
    step_logits: list[torch.Tensor] = field(default_factory=list)  # per decode step (B, V), with keep_logits
    compactions: int = 0
    cache_bytes: int = 0  # K/V buffers
    resident_bytes: dict[str, int] = field(default_factory=dict)  # every cache buffer, by kind
    kept_positions: list[list[torch.Tensor]] = field(default_factory=list)  # per compaction, per layer (B, Hc, cap)
    compaction_steps: list[str] = field(default_factory=list)  # "prefill:<chunk>" / "decode:<step>"
    ties_resolved: int = 0  # compactions where ``tie_break`` chose among equal scores


def prefill(decoder, cache, input_ids, positions, chunk: int | None = None) -> torch.Tensor:
    """Feed the prompt (B, N), whole or in chunks of ``chunk`` columns (plan rule 2), each earlier chunk with its
    lookahead tail when the cache's plan has one (rule 3b); -> logits of the last chunk."""
    logits = None
    plan = cache_plan.CachePlan((1,), 1, True, chunk, lookahead=cache.plan.lookahead)
    for c in plan.chunks(input_ids.shape[1]):
        tail = {}
        if c.has_tail:
            tail = {"tail_ids": input_ids[:, c.tail_start : c.tail_stop],
                    "tail_positions": positions[:, c.tail_start : c.tail_stop]}
        logits = decoder(input_ids[:, c.start : c.stop], positions[:, c.start : c.stop], cache, mode="prefill", **tail)
    return logits


@torch.no_grad()
def generate(
    decoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    press=None,
    window: int = 32,
    chunk: int | None = None,
    max_new_tokens: int = 32,
    eos_token_id: int | None = None,
    keep_logits: bool = False,
    track_kept: bool = False,
    forced_tokens=None,
    capacity: int | None = None,
    tie_break: Callable | None = None,
    kv_dtype: str | None = None,
    lookahead: int = 0,
) -> GenerationResult:
    """Greedy decoding with a static cache; ``press=None`` never evicts (the full-cache reference).

    input_ids (B, N), attention_mask (B, N) with left padding. With a press the cache has per-layer capacity
    ``press.layer_budgets(...) + window`` and never grows; without, ``capacity`` slots (default: the prompt plus
    ``max_new_tokens``). ``forced_tokens`` (B, n): feed these instead of the argmax (teacher forcing).
    ``keep_logits``: keep every decode step's logits. ``track_kept``: copy the kept positions after each
    compaction. ``tie_break(where, layer, scores, positions, n_keep) -> indices or None``: lets a caller choose
    among candidates the press scores (near-)equal (validation uses it to follow another runtime's tie choices;
    see kvexport.export.validation). ``kv_dtype``: how the cache stores K/V (``fp32`` ``fp16`` ``bf16`` ``int8``
    ``fp8``, :mod:`kvexport.cache.formats`; default: the model's dtype). ``lookahead`` L (with a press and
    ``chunk``): the prompt's last L columns observe every earlier chunk (kvexport.cache.plan rule 3b).
    """
    if kv_dtype is not None:
        kv_format(kv_dtype)  # one line if unknown, before any work
    if input_ids.numel() == 0 or input_ids.shape[1] == 0:
        raise BadUsage("the prompt is empty; give at least one token")
    if press is not None and window < 1:
        raise BadUsage(f"window {window} must be >= 1")
    if chunk is not None and chunk < 1:
        raise BadUsage(f"chunk {chunk} must be >= 1")
    if int(max_new_tokens) < 1:
        raise BadUsage(f"max_new_tokens {max_new_tokens} must be >= 1")
    B, N = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if bool((attention_mask.sum(-1) == 0).any()):
        raise BadUsage("a prompt row is all padding; give at least one token per row")
    positions = positions_from_mask(attention_mask).to(input_ids.device)
    L = decoder.spec.num_layers
    if press is None:
        budgets, window = [int(capacity or N + max_new_tokens)] * L, 0
    else:
        n_real = int(attention_mask.sum(-1).max())
        budgets = press.layer_budgets(L, n_real)
        if hasattr(press, "reset"):
            press.reset()
    if int(lookahead) < 0:
        raise BadUsage(f"lookahead {lookahead} must be >= 0")
    if lookahead and press is not None and not press.observes:
        raise BadUsage(f"--lookahead: {press.name} scores without observation queries, so a lookahead tail changes "
                       "nothing; use it with snapkv, pyramidkv, tova, expected_attention or observed_attention")
    cache = decoder.new_cache(B, press, budgets, window, chunk, lookahead=lookahead if press is not None else 0)
    if kv_dtype is not None:
        cache.set_kv_dtype(kv_dtype, decoder)
    if press is None:
        cache.plan.check_fits(N, max_new_tokens - 1)
    result = GenerationResult(tokens=input_ids.new_zeros(B, 0), prompt_logits=input_ids.new_zeros(0))

    def on_compaction(where: str) -> None:
        if track_kept:
            result.kept_positions.append(cache.kept_positions())
            result.compaction_steps.append(where)

    cache.on_compaction = on_compaction
    if tie_break is not None:
        cache.tie_break = tie_break
    logits = prefill(decoder, cache, input_ids, positions, chunk)
    last = logits[:, -1]
    result.prompt_logits = last.clone()
    next_pos = torch.from_numpy(cache_plan.next_positions(positions.cpu().numpy())).to(input_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    forced = None if forced_tokens is None else torch.as_tensor(np.asarray(forced_tokens), device=input_ids.device)
    out = []
    for step in range(max_new_tokens):
        tok = last.argmax(-1) if forced is None else forced[:, step].long()
        if eos_token_id is not None:
            tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
            done |= tok == eos_token_id
        out.append(tok)
        if len(out) == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            break
        last = decoder(tok[:, None], next_pos[:, None], cache, mode="decode")[:, -1]
        if keep_logits:
            result.step_logits.append(last.clone())
        next_pos = next_pos + 1
    result.tokens = torch.stack(out, dim=1)
    result.compactions = cache.compactions
    result.resident_bytes = cache.resident_bytes()
    result.cache_bytes = result.resident_bytes["kv"]
    result.ties_resolved = cache.ties_resolved
    result.cache = cache  # type: ignore[attr-defined]
    return result
