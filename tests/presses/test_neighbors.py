# SPDX-License-Identifier: Apache-2.0
"""``ScorerPress.neighbors``: the cache ranks a candidate by the largest score within r places in candidate order.
Checked against a plain NumPy loop, for the invariance of kvexport.cache.plan rule 6 (invalid entries first change
no valid candidate's rank score) for every exportable press, and end to end: a token scored alone brings its
neighbours into the kept set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.errors import BadUsage
from kvexport.presses import PRESSES, make_press
from kvexport.presses.base import ScoreInputs, spread_to_neighbors


def numpy_spread(scores: np.ndarray, valid: np.ndarray, r: int) -> np.ndarray:
    out = np.full(scores.shape, np.finfo(np.float32).min, np.float32)
    for idx in np.ndindex(scores.shape[:-1]):
        s, v = scores[idx], valid[idx]
        for j in range(s.shape[0]):
            if v[j]:
                lo, hi = max(0, j - r), min(s.shape[0], j + r + 1)
                out[idx + (j,)] = max(s[i] for i in range(lo, hi) if v[i])
    return out


@pytest.mark.parametrize("r", [1, 2, 5])
def test_spread_matches_a_loop(r):
    g = torch.Generator().manual_seed(r)
    scores = torch.randn(2, 3, 17, generator=g)
    valid = torch.rand(2, 3, 17, generator=g) > 0.2
    valid[1, :, :4] = False  # leading invalid entries (press order)
    got = spread_to_neighbors(scores, valid, r).numpy()
    np.testing.assert_array_equal(got, numpy_spread(scores.numpy(), valid.numpy(), r))


def test_negative_neighbors_refused():
    with pytest.raises(BadUsage, match="neighbors -1 must be >= 0"):
        make_press("knorm", budget=8, neighbors=-1)


KW = {"snapkv": {"window_size": 4}, "pyramidkv": {"window_size": 4}, "expected_attention": {"n_future_positions": 8}}


@pytest.mark.parametrize("name", [p for p in PRESSES if p not in ("random", "optimal")])
def test_invalid_entries_first_change_no_rank(tiny_models, name):
    from kvexport.models.decoder import Decoder

    attn = Decoder.from_hf(tiny_models("llama")).layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    B, Hc, Hq, D, S, Q, E = 1, attn.num_kv_heads, attn.num_heads, attn.head_dim, 12, 3, 4

    def inputs(k, v, pos, q, qp):
        return ScoreInputs(keys=k, values=v, positions=pos, queries=q, query_positions=qp, rotary=attn.rotary,
                           scaling=attn.scaling, layer_idx=0, num_layers=2, n_keep=5)

    k, v = torch.randn(B, Hc, S, D, generator=g), torch.randn(B, Hc, S, D, generator=g)
    pos = torch.arange(S).expand(B, Hc, S).clone()
    q, qp = torch.randn(B, Hq, Q, D, generator=g), torch.arange(S - Q, S).expand(B, Q).clone()
    press = make_press(name, budget=5, neighbors=2, **KW.get(name, {}))
    ref = press.keep_scores(inputs(k, v, pos, q, qp))
    k2 = torch.cat([torch.randn(B, Hc, E, D, generator=g) * 50, k], 2)
    v2 = torch.cat([torch.randn(B, Hc, E, D, generator=g) * 50, v], 2)
    pos2 = torch.cat([torch.full((B, Hc, E), -1), pos], 2)
    got = press.keep_scores(inputs(k2, v2, pos2, q, qp))
    torch.testing.assert_close(got[..., E:], ref, atol=1e-6, rtol=1e-5)


def test_a_scored_token_brings_its_neighbours(tiny_models):
    """KNorm keeps the smallest-norm keys; one candidate is given a tiny key: with neighbors 2 its two neighbours on
    each side are kept with it, whatever their own norms (checked on the kept positions of a real cache)."""
    from kvexport.generation import generate
    from kvexport.models.decoder import Decoder

    hf = tiny_models("llama")
    dec = Decoder.from_hf(hf)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    plain = generate(dec, ids, press=make_press("knorm", budget=12), window=4, max_new_tokens=1, track_kept=True)
    spread = generate(dec, ids, press=make_press("knorm", budget=12, neighbors=2), window=4, max_new_tokens=1,
                      track_kept=True)
    kept_plain = set(plain.kept_positions[0][0][0, 0, :12].tolist())
    kept_spread = set(spread.kept_positions[0][0][0, 0, :12].tolist())
    # reference: transformers' own post-RoPE keys of layer 0, KNorm's score -||k||, spread by the NumPy loop, the
    # top 12 (ties to the lower index)
    with torch.no_grad():
        keys = hf(ids, use_cache=True).past_key_values.layers[0].keys  # (1, Hkv, 40, D)
    s = -keys[0, 0].norm(dim=-1).numpy()[None, None]
    ranked = numpy_spread(s, np.ones_like(s, bool), 2)[0, 0]
    order = np.argsort(-ranked, kind="stable")[:12]
    assert kept_spread == set(order.tolist())
    assert kept_spread != kept_plain
