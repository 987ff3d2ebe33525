# SPDX-License-Identifier: Apache-2.0
"""The seeded Random press: each layer's first draw is kvpress's (a generator seeded with the seed), later
scorings of the layer draw fresh numbers, and a fresh press replays the same run."""

from __future__ import annotations

import torch

from kvexport.presses import make_press
from kvexport.presses.base import ScoreInputs


def _inputs(layer: int, S: int = 9):
    k = torch.zeros(1, 2, S, 4)
    return ScoreInputs(keys=k, values=k, positions=torch.arange(S).expand(1, 2, S), queries=torch.zeros(1, 2, 1, 4),
                       query_positions=torch.zeros(1, 1, dtype=torch.long), rotary=None, scaling=1.0, layer_idx=layer,
                       num_layers=2, n_keep=4)


def test_seeded_random_draws_fresh_per_compaction():
    p = make_press("random", budget=4, seed=7)
    kvpress_like = torch.rand((1, 2, 9), generator=torch.Generator().manual_seed(7))
    first0, first1 = p.score(_inputs(0)), p.score(_inputs(1))
    assert torch.equal(first0, kvpress_like) and torch.equal(first1, kvpress_like)
    second0 = p.score(_inputs(0))
    assert not torch.equal(second0, first0)  # the next compaction of layer 0 draws anew
    q = make_press("random", budget=4, seed=7)
    assert [torch.equal(q.score(_inputs(i)), w) for i, w in ((0, first0), (1, first1), (0, second0))] == [True] * 3
    p.reset()
    assert torch.equal(p.score(_inputs(0)), first0)
