# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with kvexport's PyTorch decoder and static cache: the library path a user calls, and the
reference ``kvexport validate`` compares every export with (unpadded prompts, the export's press, budget,
window and chunk). The cache rules are :mod:`kvexport.cache.plan`'s, the loop is :func:`kvexport.runtime.loop.generate`
on a :class:`~kvexport.runtime.torch_driver.TorchDriver`; this module only hands the arguments on.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.runtime import loop
from kvexport.runtime.torch_driver import TorchDriver

GenerationResult = loop.GenerationResult


def generate(
    decoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    press=None,
    window: int = DEFAULT_WINDOW,
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
    see kvexport.export.ties). ``kv_dtype``: how the cache stores K/V (``fp32`` ``fp16`` ``bf16`` ``int8``
    ``fp8``, :mod:`kvexport.cache.formats`; default: the model's dtype). ``lookahead`` L (with a press and
    ``chunk``): the prompt's last L columns observe every earlier chunk (kvexport.cache.plan rule 3b).
    Returns tokens (B, n) as a torch tensor on the prompt's device; logits and kept positions as torch tensors;
    ``cache``: the StaticCache it ran on.
    """
    driver = TorchDriver(decoder, press, window, chunk, capacity, kv_dtype, batch=int(input_ids.shape[0]),
                         tie_break=tie_break, lookahead=lookahead)
    res = loop.generate(driver, input_ids, attention_mask, max_new_tokens, eos_token_id, forced_tokens, keep_logits,
                        track_kept)
    res.tokens = torch.from_numpy(res.tokens).to(input_ids.device)
    res.ties_resolved = driver.cache.ties_resolved
    res.cache = driver.cache  # type: ignore[attr-defined]
    return res


__all__ = ["generate", "GenerationResult"]
