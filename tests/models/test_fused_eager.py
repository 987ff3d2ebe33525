# SPDX-License-Identifier: Apache-2.0
"""Eager attention through torch's fused kernel (:func:`kvexport.models.attention.fused_eager_attention`, what the
sweep and the studies run) against a NumPy softmax in float64 of the same rule: a key is seen when its position is
set (>= 0), not after the query's and, with a sliding window, less than the window behind it; a query that sees
no key averages every value. Off by default: the library path keeps the traced forms that exports share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.models import attention as A


def _numpy_attention(q, k, v, q_pos, k_pos, scaling, window):
    B, Hq, T, _ = q.shape
    Hc = k.shape[1]
    G = Hq // Hc
    out = np.zeros((B, Hq, T, v.shape[-1]))
    for b in range(B):
        for h in range(Hq):
            c = h // G
            for t in range(T):
                kp = k_pos[b, c]
                seen = (kp >= 0) & (kp <= q_pos[b, t])
                if window is not None:
                    seen &= q_pos[b, t] - kp < window
                logits = k[b, c] @ q[b, h, t] * scaling
                w = np.exp(logits[seen] - logits[seen].max()) if seen.any() else np.ones(len(kp))
                vals = v[b, c][seen] if seen.any() else v[b, c]
                out[b, h, t] = (w / w.sum()) @ vals
    return out


def _case(seed: int, Hc: int, T: int, S: int, B: int = 2, Hq: int = 6, D: int = 8):
    """Random q, past and new K/V and their positions: row 0's queries at positions past its cache (whose slots hold
    positions in [-1, S+1)), row 1 an empty cache (its first query sees only itself)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g)
    k_past, v_past = torch.randn(B, Hc, S, D, generator=g), torch.randn(B, Hc, S, D, generator=g)
    k_new, v_new = torch.randn(B, Hc, T, D, generator=g), torch.randn(B, Hc, T, D, generator=g)
    pos_past = torch.randint(-1, S + 3, (B, Hc, S), generator=g)
    pos_past[1] = -1
    q_pos = torch.stack([torch.arange(S + 3, S + 3 + T), torch.arange(T)])
    pos_new = q_pos[:, None, :].expand(B, Hc, T).clone()
    return q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos


def _reference(q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos, scaling, window):
    """:func:`_numpy_attention` over the cache and the new tokens together."""
    return _numpy_attention(q.double().numpy(), torch.cat([k_past, k_new], 2).double().numpy(),
                            torch.cat([v_past, v_new], 2).double().numpy(), q_pos.numpy(),
                            torch.cat([pos_past, pos_new], 2).numpy(), scaling, window)


@pytest.mark.parametrize("window", [None, 5])
def test_fused_eager_equals_a_numpy_softmax_and_is_off_by_default(window):
    q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos = _case(0, Hc=2, T=4, S=9)
    pos_new[0, 1, 0] = -1  # a padded new column
    args = (q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos, 0.35, window)
    ref = _reference(*args)
    assert not A._FUSED_EAGER
    with A.fused_eager_attention():
        assert A._FUSED_EAGER
        fused = A.attention(*args)
    assert not A._FUSED_EAGER
    traced = A.attention(*args)
    np.testing.assert_allclose(fused.double().numpy(), ref, atol=2e-6)
    np.testing.assert_allclose(traced.double().numpy(), ref, atol=2e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_parts_in_place_and_with_gradients(window):
    """The two-part read of a large cache (:func:`~kvexport.models.attention.attention_over_parts`) against the NumPy
    softmax: eager without gradients it masks and exponentiates its logits in place, with gradients it makes new
    tensors (autograd needs the logits its maxima were taken from); both give the same values, bit for bit, and the
    gradient flows."""
    q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos = _case(1, Hc=3, T=5, S=11)
    parts = [(k_past, v_past, pos_past), (k_new, v_new, pos_new)]
    ref = _reference(q, k_past, v_past, pos_past, k_new, v_new, pos_new, q_pos, 0.35, window)
    with torch.no_grad():
        in_place = A.attention_over_parts(q, parts, q_pos, 0.35, window)
    qg = q.clone().requires_grad_(True)
    with_grad = A.attention_over_parts(qg, parts, q_pos, 0.35, window)
    with_grad.square().sum().backward()
    assert torch.equal(in_place, with_grad.detach())
    np.testing.assert_allclose(in_place.double().numpy(), ref, atol=2e-6)
    assert qg.grad is not None and torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0
