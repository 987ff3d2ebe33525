# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with a static-budget (evicting) cache, single-shot or chunked prefill."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvexport.errors import BadUsage


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask (B, N) of 0/1, left padded -> positions (B, N), -1 on padding."""
    m = attention_mask.long()
    return torch.where(m.bool(), m.cumsum(-1) - 1, torch.full_like(m, -1))


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, n_new) generated ids
    prompt_logits: torch.Tensor  # (B, V) logits at the last prompt token
    step_logits: list[torch.Tensor] = field(default_factory=list)  # per decode step (B, V)
    compactions: int = 0
    cache_bytes: int = 0
    kept_positions: list[list[torch.Tensor]] = field(default_factory=list)  # after each compaction


def prefill(decoder, cache, input_ids, positions, chunk: int | None = None) -> torch.Tensor:
    """Feed the prompt, whole or in chunks of ``chunk`` tokens; -> logits of the last chunk (B, T, V)."""
    N = input_ids.shape[1]
    step = N if not chunk else int(chunk)
    logits = None
    for s in range(0, N, step):
        logits = decoder(input_ids[:, s : s + step], positions[:, s : s + step], cache, mode="prefill")
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
) -> GenerationResult:
    """Greedy decoding. ``press=None`` means a cache that never evicts (the full-cache reference).

    input_ids (B, N), attention_mask (B, N) with left padding. The cache is made once, with
    per-layer capacity ``press.layer_budgets(...) + window``, and never grows.
    """
    if input_ids.numel() == 0 or input_ids.shape[1] == 0:
        raise BadUsage("the prompt is empty; give at least one token")
    if window < 1:
        raise BadUsage(f"window {window} must be >= 1")
    if chunk is not None and chunk < 1:
        raise BadUsage(f"chunk {chunk} must be >= 1")
    B, N = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = positions_from_mask(attention_mask).to(input_ids.device)
    L = decoder.spec.num_layers
    if press is None:
        budgets = [N + max_new_tokens] * L
    else:
        n_real = int(attention_mask.sum(-1).max())
        budgets = press.layer_budgets(L, n_real)
    cache = decoder.new_cache(B, press, budgets, window)
    logits = prefill(decoder, cache, input_ids, positions, chunk)
    last = logits[:, -1]
    result = GenerationResult(tokens=input_ids.new_zeros(B, 0), prompt_logits=last.clone())
    next_pos = positions.max(dim=1).values + 1  # (B,)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    out = []
    for _ in range(max_new_tokens):
        tok = last.argmax(-1)
        if eos_token_id is not None:
            tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
            done |= tok == eos_token_id
        out.append(tok)
        if len(out) == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            break
        before = cache.compactions
        last = decoder(tok[:, None], next_pos[:, None], cache, mode="decode")[:, -1]
        if keep_logits:
            result.step_logits.append(last.clone())
        if track_kept and cache.compactions != before:
            result.kept_positions.append(cache.kept_positions())
        next_pos = next_pos + 1
    result.tokens = torch.stack(out, dim=1)
    result.compactions = cache.compactions
    result.cache_bytes = cache.nbytes()
    result.cache = cache  # type: ignore[attr-defined]
    return result
