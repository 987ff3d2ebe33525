# SPDX-License-Identifier: Apache-2.0
"""Edge cases of the custom ops that tests/export/test_ops.py's hypothesis strategies do not draw: rows with
every slot masked, k == S, scores of +-inf, fully masked queries. PyTorch op == ONNX function (onnxruntime)
== NumPy reference, in fp32 and fp16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvexport import ops
from tests.export.test_ops import (
    NP,
    _run,
    latent_attention_model,
    latent_attention_numpy,
    topk_gather_model,
    topk_gather_numpy,
)


@settings(max_examples=25, deadline=None)
@given(S=st.integers(1, 10), full_k=st.booleans(), dtype=st.sampled_from(["fp32", "fp16"]),
       seed=st.integers(0, 2**31 - 1))
def test_topk_gather_masked_rows_full_k_and_infinities(S, full_k, dtype, seed):
    rng = np.random.default_rng(seed)
    B, H, Dk, Dv = 2, 2, 3, 2
    k = S if full_k else int(rng.integers(1, S + 1))
    nd = NP[dtype]
    scores = rng.choice(np.array([-np.inf, np.inf, 0.0, 1.0, -1.0]), (B, H, S)).astype(np.float32)  # ties, infinities
    keys = rng.standard_normal((B, H, S, Dk)).astype(nd)
    values = rng.standard_normal((B, H, S, Dv)).astype(nd)
    positions = np.broadcast_to(np.arange(S), (B, H, S)).copy().astype(np.int64)
    positions[0, 0] = -1  # a row with every slot empty
    positions[1, 1, rng.random(S) < 0.5] = -1
    want = topk_gather_numpy(scores, keys, values, positions, k)
    got_t = ops.topk_gather.topk_gather(*(torch.from_numpy(x) for x in (scores, keys, values, positions)), k)
    got_o = _run(topk_gather_model(B, H, S, Dk, Dv, k, dtype),
                 {"scores": scores, "keys": keys, "values": values, "positions": positions})
    for w, t, o in zip(want, got_t, got_o, strict=True):
        np.testing.assert_array_equal(t.numpy(), w)
        np.testing.assert_array_equal(o, w)
    if full_k:  # keeping everything keeps every slot, in order
        np.testing.assert_array_equal(got_o[3], np.broadcast_to(np.arange(S), (B, H, S)))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_latent_attention_fully_masked_query_and_cache(dtype):
    rng = np.random.default_rng(1)
    B, Hq, T, S, R, Dr = 2, 2, 3, 5, 4, 2
    nd = NP[dtype]
    scale = float((R + Dr) ** -0.5)
    q = rng.standard_normal((B, Hq, T, R + Dr)).astype(nd)
    latent = rng.standard_normal((B, S, R + Dr)).astype(nd)
    qp = np.array([[-1, -1, -1], [0, 3, 9]], np.int64)  # row 0: padding queries only
    lp = np.array([[0, 1, 2, 3, 4], [-1, -1, -1, -1, 2]], np.int64)  # row 1: one visible slot from position 2
    want_out = latent_attention_numpy(q, latent, qp, lp, R, scale)
    t_out = ops.latent_attention.latent_attention(*(torch.from_numpy(x) for x in (q, latent, qp, lp)), R, scale)
    (o_out,) = _run(latent_attention_model(B, Hq, T, S, R, Dr, scale, dtype),
                    {"q": q, "latent": latent, "q_positions": qp, "latent_positions": lp})
    tol = 1e-5 if dtype == "fp32" else 2e-2
    for out in (t_out.numpy(), o_out):
        assert np.isfinite(out.astype(np.float64)).all()
        # rows with a visible key agree with the reference (what a fully masked row returns is unspecified,
        # but it must be finite); row 1's queries at positions 3 and 9 see only slot 4
        np.testing.assert_allclose(out[1, :, 1:].astype(np.float64), want_out[1, :, 1:], atol=tol, rtol=tol)
        np.testing.assert_allclose(out[1, :, 1:].astype(np.float64),
                                   np.broadcast_to(latent[1, 4, :R].astype(np.float64), (Hq, T - 1, R)),
                                   atol=tol, rtol=tol)
