# SPDX-License-Identifier: Apache-2.0
"""Next-token choice from one row of logits: greedy (temperature 0) or temperature + nucleus (top-p) sampling.

Greedy is ``argmax`` (the lowest index among equal maxima, as :meth:`OrtGenerator.generate` and
:func:`kvexport.generation.generate` choose). Sampling (Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration"): ``p = softmax(logits / temperature)``; keep the smallest set of most likely tokens whose mass
reaches ``top_p`` (at least one token); renormalise; draw with the request's own ``numpy.random.Generator``
(seeded by ``seed``), so a seeded request gives the same tokens whatever else the server runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` >= 0 (0 = greedy), ``top_p`` in (0, 1], ``seed`` (None: fresh entropy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """logits (V,) -> the sampling distribution (V,) float64: softmax at ``temperature``, cut to the top-p nucleus."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order])
        n = int(np.searchsorted(mass, top_p) + 1)  # smallest prefix whose mass reaches top_p
        keep = np.zeros_like(p)
        keep[order[:n]] = p[order[:n]]
        p = keep / keep.sum()
    return p


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from ``logits`` (V,)."""
    if params.greedy:
        return int(np.argmax(logits))
    p = nucleus_probs(logits, params.temperature, params.top_p)
    return int(rng.choice(p.shape[0], p=p))


__all__ = ["SamplingParams", "choose", "nucleus_probs"]
