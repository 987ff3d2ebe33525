# SPDX-License-Identifier: Apache-2.0
"""The one parametrized list of all presses the cache tests run through, and how to build each one.

Small budgets keep the tests fast: budget 24, cache window 8; SnapKV/PyramidKV observe 8 tokens, and
PyramidKV uses beta 2 so that its two layers get different budgets (36 and 12).
"""

from __future__ import annotations

import torch

from kvexport.presses import PRESSES, OptimalPress, make_press

BUDGET = 24
WINDOW = 8
FUTURE = 12  # future tokens the optimal oracle is told about
ALL_PRESSES = list(PRESSES)
#: presses whose choice for one batch row does not depend on the other rows (Random draws per batch shape)
PER_ROW = [p for p in ALL_PRESSES if p != "random"]
KW = {"snapkv": {"window_size": 8}, "pyramidkv": {"window_size": 8, "beta": 2}, "random": {"seed": 5}}


def build_press(name: str, decoder=None, input_ids=None, attention_mask=None, budget: int = BUDGET):
    """A press for a run on ``input_ids`` (B, N); the oracle is told FUTURE random tokens after each row."""
    p = make_press(name, budget=budget, **KW.get(name, {}))
    if name == "optimal":
        from tests.cache._drive import positions_from_mask

        B, N = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        g = torch.Generator().manual_seed(99)
        fut = torch.randint(0, decoder.spec.vocab_size, (1, FUTURE), generator=g).expand(B, FUTURE)
        ids = torch.cat([input_ids, fut], 1)
        pos = positions_from_mask(torch.cat([mask, torch.ones_like(fut)], 1))
        p.future = OptimalPress.record_future(decoder, ids, pos, start=mask.sum(-1))
    return p
