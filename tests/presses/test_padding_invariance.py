# SPDX-License-Identifier: Apache-2.0
"""kvexport.cache.plan rule 6, for every registered press: a valid candidate scores the same whatever invalid
entries (empty slots, padding columns) precede it and whatever padding queries precede the real ones. The
static graphs see more of both than the PyTorch cache, so this is what makes a padded export keep what the
unpadded library path keeps. The reference is the same press on the unpadded inputs."""

from __future__ import annotations

import pytest
import torch

from kvexport.models.decoder import Decoder
from kvexport.presses import PRESSES, make_press
from kvexport.presses.base import ScoreInputs

KW = {"snapkv": {"window_size": 4}, "pyramidkv": {"window_size": 4}, "expected_attention": {"n_future_positions": 8}}
#: Random draws one number per entry of the candidates' shape: more entries, other numbers (it is not exportable)
INVARIANT = [p for p in PRESSES if p != "random"]


@pytest.fixture(scope="module")
def layer(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    return dec.layers[0].self_attn


def _inputs(attn, k, v, pos, q, qp, n_keep=6):
    return ScoreInputs(keys=k, values=v, positions=pos, queries=q, query_positions=qp, rotary=attn.rotary,
                       scaling=attn.scaling, layer_idx=0, num_layers=2, n_keep=n_keep)


def _press(name, future=None):
    p = make_press(name, budget=6, **KW.get(name, {}))
    if name == "optimal":
        p.future = future
    return p


@pytest.mark.parametrize("name", INVARIANT)
@pytest.mark.parametrize("n_empty,n_pad_q", [(3, 0), (0, 2), (5, 3)])
def test_invalid_entries_first_change_no_valid_score(layer, name, n_empty, n_pad_q):
    g = torch.Generator().manual_seed(0)
    B, Hc, Hq, D, S, Q = 2, layer.num_kv_heads, layer.num_heads, layer.head_dim, 14, 3  # Q < window_size
    k = torch.randn(B, Hc, S, D, generator=g)
    v = torch.randn(B, Hc, S, D, generator=g)
    pos = torch.arange(S).expand(B, Hc, S).clone()
    pos[1, :, :2] = -1  # row 1 is left padded (batch padding: part of both layouts)
    q = torch.randn(B, Hq, Q, D, generator=g)
    qp = torch.arange(S - Q, S).expand(B, Q).clone()
    future = {0: (torch.randn(B, Hq, 4, D, generator=g), torch.arange(S, S + 4).expand(B, 4).clone())}
    ref = _press(name, future).score(_inputs(layer, k, v, pos, q, qp))
    # the graph's layout: invalid candidates (garbage keys, position -1) first, padding queries first
    k2 = torch.cat([torch.randn(B, Hc, n_empty, D, generator=g) * 50, k], dim=2)
    v2 = torch.cat([torch.randn(B, Hc, n_empty, D, generator=g) * 50, v], dim=2)
    pos2 = torch.cat([torch.full((B, Hc, n_empty), -1), pos], dim=2)
    q2 = torch.cat([torch.randn(B, Hq, n_pad_q, D, generator=g) * 50, q], dim=2)
    qp2 = torch.cat([torch.full((B, n_pad_q), -1), qp], dim=1)
    got = _press(name, future).score(_inputs(layer, k2, v2, pos2, q2, qp2))
    valid = pos >= 0
    torch.testing.assert_close(got[..., n_empty:][valid], ref[valid], atol=1e-6, rtol=1e-5)
