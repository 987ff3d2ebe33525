# SPDX-License-Identifier: Apache-2.0
"""Random eviction, the baseline every press must beat.

Scores are ``torch.rand((B, Hc, S))`` from a CPU generator seeded with ``seed`` on every call (kvpress's
RandomPress does the same, so with the same seed and shapes the single-shot prefill keeps the same set;
every layer draws the same numbers). ``seed=None`` draws from the global generator. Per chunk and at
decode compaction the scores are fresh draws of the candidates' shape. Not meant for ONNX export: a
graph would bake in one draw or need a RandomUniform op; the exporter should refuse it.
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

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) uniform in [0, 1)."""
        shape = tuple(inputs.keys.shape[:-1])
        gen = None
        if self.seed is not None:
            gen = torch.Generator(device=inputs.keys.device)
            gen.manual_seed(int(self.seed))
        return torch.rand(shape, generator=gen, device=inputs.keys.device, dtype=inputs.keys.dtype)
