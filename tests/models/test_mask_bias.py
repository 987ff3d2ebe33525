# SPDX-License-Identifier: Apache-2.0
"""The traced attention adds the position rule as a bias (kvexport.models.attention.mask_bias) instead of a Where
over every query head's logits: the masked logits must be those of the Where, bit for bit, and a traced graph's
attention must stay the eager softmax."""

from __future__ import annotations

import pytest
import torch

from kvexport.cache.visibility import visible
from kvexport.models.attention import attention_over_parts, grouped_attention, mask_bias


@pytest.mark.parametrize("window", [None, 5])
def test_bias_gives_the_where_bit_for_bit(window):
    g = torch.Generator().manual_seed(0)
    B, Hc, G, T, S = 2, 3, 4, 7, 19
    logits = torch.randn(B, Hc, G, T, S, generator=g) * torch.logspace(-3, 4, S)  # up to 1e4 in magnitude
    q_pos = torch.randint(-1, 30, (B, T), generator=g)
    k_pos = torch.randint(-1, 30, (B, Hc, S), generator=g)
    want = torch.where(visible(q_pos, k_pos, window)[:, :, None], logits, torch.finfo(torch.float32).min)
    got = logits + mask_bias(q_pos, k_pos, window)
    assert torch.equal(got, want)


def test_traced_forms_equal_a_plain_softmax():
    """Both traced forms (one softmax over the concatenation, the two-part merge) against softmax attention
    written out with an explicit -inf mask."""
    g = torch.Generator().manual_seed(1)
    B, Hc, G, T, S, D = 1, 2, 3, 5, 11, 8
    q = torch.randn(B, Hc * G, T, D, generator=g)
    k, v = torch.randn(B, Hc, S, D, generator=g), torch.randn(B, Hc, S, D, generator=g)
    k_pos = torch.arange(S).expand(B, Hc, S).clone()
    k_pos[..., 3] = -1  # an empty slot
    q_pos = torch.arange(S - T, S)[None]
    vis = visible(q_pos, k_pos)  # (B, Hc, T, S)
    ref = []
    for h in range(Hc * G):
        lg = q[:, h] @ k[:, h // G].transpose(-1, -2) * D**-0.5
        ref.append(torch.softmax(lg.masked_fill(~vis[:, h // G], float("-inf")), -1) @ v[:, h // G])
    ref = torch.stack(ref, 1)
    with torch.no_grad():
        one, _ = grouped_attention(q, k, v, q_pos, k_pos, D**-0.5)
        traced = torch.jit.trace(lambda *a: attention_over_parts(a[0], [(a[1], a[2], a[3])], a[4], D**-0.5),
                                 (q, k, v, k_pos, q_pos))
        two = traced(q, k, v, k_pos, q_pos)
    torch.testing.assert_close(one, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(two, ref, atol=1e-6, rtol=1e-5)
