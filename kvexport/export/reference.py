# SPDX-License-Identifier: Apache-2.0
"""The PyTorch side of a parity run: the same model, press and budgets as an export, fed the same way.

:func:`torch_generate` drives :class:`~kvexport.models.decoder.Decoder` with a
:class:`~kvexport.cache.static_cache.StaticCache` exactly as :class:`~kvexport.export.runtime.OrtGenerator`
drives the graphs: the prompt in chunks of the export's C tokens (the last one right-padded with
position -1), greedy (or forced) decode steps, compaction when any layer is full. Results use the
same :class:`~kvexport.export.runtime.OrtGenerationResult` layout so the two can be compared directly.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvexport.export.runtime import OrtGenerationResult, check_prompt, positions_from_mask


@torch.no_grad()
def torch_generate(decoder, settings: dict, input_ids, attention_mask=None, max_new_tokens: int = 32,
                   eos_token_id: int | None = None, forced_tokens=None, press=None) -> OrtGenerationResult:
    """Greedy generation with the PyTorch reference under an export's ``settings`` (manifest["settings"])."""
    ids, mask = check_prompt(input_ids, attention_mask, max_new_tokens)
    B, N = ids.shape
    L = decoder.spec.num_layers
    dev = next(decoder.parameters()).device
    pos = positions_from_mask(mask)
    dynamic = settings["mode"] == "dynamic"
    if dynamic:  # the whole prompt at once, cache large enough for everything
        C = N
        budgets, window = [N + max_new_tokens + 1] * L, 1
    else:
        C = int(settings["chunk"])
        window = int(settings["window"]) or 1
        budgets = settings["budgets"] or [int(c) for c in settings["capacities"]]
    cache = decoder.new_cache(B, press, budgets, window)
    n_chunks = math.ceil(N / C)
    pad = n_chunks * C - N
    ids_p = np.concatenate([ids, np.zeros((B, pad), np.int64)], axis=1)
    pos_p = np.concatenate([pos, np.full((B, pad), -1, np.int64)], axis=1)
    res = OrtGenerationResult(tokens=np.zeros((B, 0), np.int64), prompt_logits=np.zeros(0))
    logits = None
    for c in range(n_chunks):
        fills = [lc.fill for lc in cache.layers]
        t_ids = torch.from_numpy(ids_p[:, c * C : (c + 1) * C]).to(dev)
        t_pos = torch.from_numpy(pos_p[:, c * C : (c + 1) * C]).to(dev)
        logits = decoder(t_ids, t_pos, cache, mode="prefill")
        if press is not None and any(f + C > lc.budget for f, lc in zip(fills, cache.layers, strict=False)):
            res.compactions += 1
            res.kept_positions.append([p.cpu().numpy() for p in cache.kept_positions()])
            res.compaction_steps.append(f"prefill:{c}")
    last_index = N - 1 - (n_chunks - 1) * C
    last = logits[:, last_index].float().cpu().numpy()
    res.prompt_logits = last
    next_pos = torch.from_numpy(pos.max(axis=1) + 1).to(dev)
    done = np.zeros(B, bool)
    out = []
    for step in range(max_new_tokens):
        if forced_tokens is None:
            tok = last.argmax(-1).astype(np.int64)
        else:
            tok = np.asarray(forced_tokens)[:, step].astype(np.int64)
        if eos_token_id is not None:
            tok = np.where(done, eos_token_id, tok)
            done |= tok == eos_token_id
        out.append(tok)
        if step == max_new_tokens - 1 or (eos_token_id is not None and done.all()):
            break
        before = cache.compactions
        lg = decoder(torch.from_numpy(tok[:, None]).to(dev), next_pos[:, None], cache, mode="decode")
        last = lg[:, -1].float().cpu().numpy()
        res.step_logits.append(last)
        if cache.compactions != before:
            res.compactions += 1
            res.kept_positions.append([p.cpu().numpy() for p in cache.kept_positions()])
            res.compaction_steps.append(f"decode:{step}")
        next_pos = next_pos + 1
    res.tokens = np.stack(out, axis=1)
    res.cache_bytes = cache.nbytes()
    res.cache = cache  # type: ignore[attr-defined]
    return res
