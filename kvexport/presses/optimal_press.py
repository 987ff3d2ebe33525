# SPDX-License-Identifier: Apache-2.0
"""Optimal: an oracle for evaluation that is told the future queries (the "Optimal" line of the Expected
Attention paper, Devoto et al., 2025). It keeps the tokens the future queries actually attend to most.

Give it ``future``: a dict ``layer_idx -> (queries (B, Hq, F, Dk) pre-RoPE in the keys' space,
positions (B, F), -1 = ignore)``, e.g. from :meth:`OptimalPress.record_future` on the prompt + the
continuation with ``start`` = the first future position. Score of candidate j, per cache head: for each
real future query t the softmax of its RoPE'd attention over the *candidates* it can see
(``0 <= pos_j <= pos_t``; tokens outside the candidate set are not in the softmax), summed over the
real future queries and divided by their number, then averaged over the G query heads of the group.
Padding keys score 0. The observation queries in ``ScoreInputs`` are ignored; the same future serves every chunk and
every decode compaction (a candidate's score only depends on the future, not on when it is scored).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kvexport.errors import BadUsage
from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.observation import observation_probs, query_valid


@dataclass
class OptimalPress(ScorerPress):
    future: dict = field(default_factory=dict, repr=False)
    name: ClassVar[str] = "optimal"
    observes: ClassVar[bool] = False  # no observation queries: a lookahead tail has nothing to say

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S): mean attention of the real future queries, mean over the GQA group."""
        if inputs.layer_idx not in self.future:
            raise BadUsage(f"the optimal press is an evaluation oracle and has no future queries for layer "
                           f"{inputs.layer_idx}; set press.future = OptimalPress.record_future(...) first "
                           "(generation without a known future accepts the other presses)")
        fq, fpos = self.future[inputs.layer_idx]
        fut = replace(inputs, queries=fq.to(inputs.keys.dtype), query_positions=fpos)
        probs = observation_probs(fut)  # (B, Hc, G, F, S)
        n = query_valid(fut).sum(-1).clamp(min=1).float()  # (B,)
        return (probs.sum(3) / n[:, None, None, None]).mean(2)

    @staticmethod
    @torch.no_grad()
    def record_future(decoder, input_ids: torch.Tensor, positions: torch.Tensor, start=0) -> dict:
        """Run ``decoder`` with full attention on the whole text, ids (B, N) / positions (B, N), and return
        ``{layer: (queries (B, Hq, N, Dk), positions (B, N))}`` in the keys' space (``score_queries``),
        positions below ``start`` (int, or (B,) per row: the prompt lengths) set to -1 so that only the
        future queries vote."""
        out: dict = {}
        start = torch.as_tensor(start, device=positions.device).reshape(-1, 1)  # (B or 1, 1)
        fpos = torch.where(positions >= start, positions, torch.full_like(positions, -1))
        hooks = []
        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn

            def hook(mod, args, result, i=i):
                out[i] = (mod.score_queries(result[3]).detach(), fpos)

            hooks.append(attn.register_forward_hook(hook))
        try:
            decoder(input_ids, positions, None)
        finally:
            for h in hooks:
                h.remove()
        return out
