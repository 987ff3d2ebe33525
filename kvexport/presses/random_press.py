# SPDX-License-Identifier: Apache-2.0
"""Random eviction, the baseline every press must beat.

Scores are ``torch.rand((B, Hc, S))``. With a ``seed`` the press owns one generator per layer, seeded with it
when the press is made (or :meth:`RandomPress.reset`): each layer's first draw is kvpress's RandomPress (which
seeds a generator with the same seed on every call), so a single-shot prefill keeps the same set; every later
scoring of that layer (the next chunk, each decode compaction) continues its stream, so it draws fresh numbers,
and a fresh press object replays the same run. ``seed=None`` draws from the global generator. Not exportable: a
graph would bake in one draw (the exporter refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.presses.base import ScoreInputs, ScorerPress


@dataclass
class RandomPress(ScorerPress):
    seed: int | None = None
    name: ClassVar[str] = "random"
    observes: ClassVar[bool] = False  # no observation queries: a lookahead tail has nothing to say

    def __post_init__(self):
        super().__post_init__()
        self.reset()

    def reset(self) -> None:
        """Start every layer's seeded stream again."""
        self._gens: dict[int, torch.Generator] = {}

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) uniform in [0, 1), fresh at every call."""
        shape = tuple(inputs.keys.shape[:-1])
        gen = None
        if self.seed is not None:
            gen = self._gens.get(inputs.layer_idx)
            if gen is None:
                gen = self._gens[inputs.layer_idx] = torch.Generator().manual_seed(int(self.seed))
        return torch.rand(shape, generator=gen, dtype=torch.float32).to(inputs.keys.device, inputs.keys.dtype)
