# SPDX-License-Identifier: Apache-2.0
"""The press family: a press scores every candidate token per cache head; the cache keeps the top ones.

A new press subclasses :class:`ScorerPress` and writes :meth:`ScorerPress.score` only; the cache does
top-k, gather and position ordering (``kvexport.cache.static_cache``). Semantics follow NVIDIA
kvpress (``ScorerPress`` family) so that, at a single-shot prefill, the kept index sets are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.errors import BadUsage


@dataclass
class ScoreInputs:
    """Everything a press may score with, in the *press order* of kvexport.cache.plan (rule 6).

    keys (B, Hc, S, Dk): candidate keys, post-RoPE (MLA: the latent ``[c_kv; k_pe]``, Hc = 1)
    values (B, Hc, S, Dv): candidate values (MLA: may be empty, Dv = 0)
    positions (B, Hc, S): true positions, -1 = empty / padding
    queries (B, Hq, Q, Dk): observation queries *before* RoPE, in the keys' space (MLA: absorbed)
    query_positions (B, Q): their positions, -1 = padding
    rotary: ``apply(x, pos)`` rotates queries like the keys; ``matrix(pos)`` gives R (P, Dk, Dk)
    scaling: softmax scale of the attention logits
    n_keep: how many candidates the cache will keep per (batch, head) in this layer
    sliding_window: the layer's attention window (None = unlimited): key j is visible to query t iff
        ``0 <= pos_j <= pos_t`` and ``pos_t - pos_j < sliding_window`` (:func:`kvexport.cache.visibility.visible`)
    observers_are_candidates: the observation queries are the last candidates' own (a chunk observing itself,
        decode compaction); False when a lookahead tail observes a chunk (kvexport.cache.plan rule 3b): its
        tokens are not candidates, so nothing is kept for being an observer

    What the cache guarantees (rule 6): invalid candidates (position -1: empty slots, padding) come first and
    the valid ones after, in position order, so the last candidates are the newest real tokens; a row's real
    observation queries are its *last* queries, and the tokens of its last ``n`` real queries are its last ``n``
    candidates. Invalid candidates are never kept whatever they score. A press must score a valid candidate
    the same whatever invalid entries precede it (the static graphs have more of them than the PyTorch cache).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    rotary: object
    scaling: float
    layer_idx: int
    num_layers: int
    n_keep: int
    sliding_window: int | None = None
    observers_are_candidates: bool = True

    @property
    def valid(self) -> torch.Tensor:
        """(B, Hc, S) bool: candidate is a real token."""
        return self.positions >= 0

    @property
    def n_real_queries(self) -> torch.Tensor:
        """(B,) int64: how many observation queries of each row are real tokens (they are the last ones)."""
        return (self.query_positions >= 0).sum(-1)


@dataclass
class ScorerPress:
    """Base press. Give either ``compression_ratio`` in [0, 1) or an absolute ``budget`` (>= 1).

    ``budget`` wins when both are set. With a ratio, a prompt of n tokens keeps
    ``int(n * (1 - ratio))`` (kvpress's rule).

    ``neighbors`` r >= 0: a candidate is kept for its neighbours too: the score the cache ranks by
    (:meth:`keep_scores`) is the largest score among the valid candidates at most r places away in candidate order
    (position order), so a scored token brings the r tokens on each side with it. A token is rarely useful alone:
    a 5-digit key is 5 tokens, and the query that finds it attends to its start (ChunkKV, Liu et al. 2025, keeps
    whole chunks for the same reason). 0 = the press's own scores (kvpress's).
    """

    compression_ratio: float | None = None
    budget: int | None = None
    neighbors: int = 0

    #: CLI name (the registry key in ``kvexport.presses.PRESSES``)
    name: ClassVar[str] = "base"
    #: no press reads the model's attention matrix (attention-based presses compute it from queries + keys)
    needs_attention: ClassVar[bool] = False
    #: the press scores with observation queries (so a lookahead tail, kvexport.cache.plan rule 3b, changes what it
    #: keeps); False for presses that score keys or positions alone
    observes: ClassVar[bool] = True

    def __post_init__(self):
        if self.compression_ratio is not None and not (0.0 <= float(self.compression_ratio) < 1.0):
            raise BadUsage(f"compression ratio {self.compression_ratio} is outside [0, 1)")
        if self.budget is not None and int(self.budget) < 1:
            raise BadUsage(f"budget {self.budget} must be >= 1 token")
        if int(self.neighbors) < 0:
            raise BadUsage(f"neighbors {self.neighbors} must be >= 0")
        if self.budget is not None and self.budget <= self.always_kept():
            raise BadUsage(
                f"budget {self.budget} must exceed the {self.always_kept()} tokens {self.name} always keeps"
            )

    def always_kept(self) -> int:
        """Tokens kept whatever their score (sinks, observation window): a ``budget`` must exceed it."""
        return 0

    def resolve_budget(self, n_tokens: int) -> int:
        """Tokens kept from a prompt of n tokens."""
        if self.budget is not None:
            return int(self.budget)
        ratio = float(self.compression_ratio or 0.0)
        return max(1, int(n_tokens * (1 - ratio)))

    def layer_budgets(self, num_layers: int, n_tokens: int) -> list[int]:
        """Per-layer budgets for a prompt of n tokens (uniform unless the press says otherwise)."""
        return [self.resolve_budget(n_tokens)] * num_layers

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) scores; higher = keep. Invalid candidates are masked by the cache."""
        raise NotImplementedError

    def keep_scores(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) what the cache ranks candidates by: :meth:`score`, spread to ``neighbors`` (class doc)."""
        scores = self.score(inputs)
        r = int(self.neighbors)
        if r == 0:
            return scores
        return spread_to_neighbors(scores, inputs.valid, r)


def spread_to_neighbors(scores: torch.Tensor, valid: torch.Tensor, r: int) -> torch.Tensor:
    """(B, Hc, S) -> each valid entry's largest score within r places (invalid entries neither give nor take; they
    come first in press order, so a valid entry's result does not depend on how many there are)."""
    B, H, S = scores.shape
    low = torch.finfo(torch.float32).min
    s = scores.float().masked_fill(~valid, low)
    spread = torch.nn.functional.max_pool1d(s.reshape(B * H, 1, S), 2 * r + 1, stride=1, padding=r)
    return spread.reshape(B, H, S).masked_fill(~valid, low)
