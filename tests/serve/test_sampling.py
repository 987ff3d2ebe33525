# SPDX-License-Identifier: Apache-2.0
"""Token choice against its definitions: greedy is the first maximum; the nucleus is the smallest most-likely set
reaching top_p (checked by its defining properties, not by re-running the algorithm); draws follow the nucleus
distribution (a chi-square bound over 20000 seeded draws); temperature is softmax(logits / T) (torch's softmax
as the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.serve.sampling import SamplingParams, choose, nucleus_probs


def test_greedy_is_the_first_maximum():
    logits = np.array([0.1, 3.0, -1.0, 3.0], np.float32)
    assert choose(logits, SamplingParams(temperature=0.0), np.random.default_rng(0)) == 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_is_a_softmax(temperature):
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    want = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1).numpy()
    np.testing.assert_allclose(nucleus_probs(logits, temperature, 1.0), want, rtol=1e-12)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_nucleus_is_the_smallest_set_reaching_top_p(top_p):
    logits = np.random.default_rng(2).normal(size=200).astype(np.float32) * 2
    full = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    got = nucleus_probs(logits, 1.0, top_p)
    kept = got > 0
    assert full[kept].sum() >= top_p - 1e-12  # reaches top_p ...
    assert full[kept].sum() - full[kept].min() < top_p  # ... and without its least likely member it would not
    assert full[kept].min() >= full[~kept].max(initial=0)  # the most likely tokens
    np.testing.assert_allclose(got[kept], full[kept] / full[kept].sum(), rtol=1e-12)


def test_draws_follow_the_nucleus():
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    params = SamplingParams(temperature=1.0, top_p=0.85, seed=5)
    rng = params.rng()
    counts = np.bincount([choose(logits, params, rng) for _ in range(20000)], minlength=6)
    p = nucleus_probs(logits, 1.0, 0.85)
    assert counts[p == 0].sum() == 0 and (p > 0).sum() == 4  # 0.4 + 0.25 + 0.15 < 0.85 <= + 0.1
    expected = 20000 * p[p > 0]
    chi2 = (((counts[p > 0] - expected) ** 2) / expected).sum()
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_seed_replays():
    logits = np.random.default_rng(3).normal(size=100)
    draw = lambda seed: [choose(logits, SamplingParams(0.8, 0.95, seed), r) for r in [np.random.default_rng(seed)]  # noqa: E731
                         for _ in range(30)]
    assert draw(7) == draw(7) and draw(7) != draw(8)
