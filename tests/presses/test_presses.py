# SPDX-License-Identifier: Apache-2.0
"""Press-level checks on synthetic inputs: registry and bad input, traceability, the MLA shape
(Hc = 1, many query heads, partial rotary) against references built on the decoder's own attention
(:func:`kvexport.models.attention.grouped_attention`), PyramidKV budgets, Random, Optimal."""

from __future__ import annotations

import pytest
import torch

from kvexport.errors import BadUsage
from kvexport.models.attention import grouped_attention
from kvexport.models.rope import Rotary
from kvexport.presses import PRESSES, make_press
from kvexport.presses.base import ScoreInputs

ALL = ["streaming_llm", "knorm", "keydiff", "tova", "snapkv", "pyramidkv", "expected_attention",
       "observed_attention", "random", "optimal"]
ALWAYS_KEPT = {"streaming_llm": 4, "tova": 1, "snapkv": 64, "pyramidkv": 64, "expected_attention": 4}


def inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))


def synthetic(B=2, Hc=2, Hq=4, S=40, Q=8, D=16, rot_dim=None, offset=0, seed=0, pad=0) -> ScoreInputs:
    """Candidates at positions 0..S-1 (the first ``pad`` of row 0 are padding), the last Q observe."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S).expand(B, Hc, S).clone()
    pos[0, :, :pad] = -1
    qpos = torch.arange(S - Q, S).expand(B, Q).clone()
    rot = Rotary(inv_freq(rot_dim or D), offset=offset)
    return ScoreInputs(keys=torch.randn(B, Hc, S, D, generator=g), values=torch.randn(B, Hc, S, D, generator=g),
                       positions=pos, queries=torch.randn(B, Hq, Q, D, generator=g) * 2, query_positions=qpos,
                       rotary=rot, scaling=D**-0.5, layer_idx=0, num_layers=2, n_keep=S // 2)


def press(name: str, **kw):
    if name in ("snapkv", "pyramidkv"):
        kw.setdefault("window_size", 4)
    if name == "random":
        kw.setdefault("seed", 7)
    return make_press(name, budget=kw.pop("budget", 20), **kw)


def reference_probs(inp: ScoreInputs) -> torch.Tensor:
    """(B, Hq, Q, S) via the decoder's grouped attention, padding rows zeroed."""
    q = inp.rotary.apply(inp.queries, inp.query_positions)
    _, probs = grouped_attention(q, inp.keys, inp.values, inp.query_positions, inp.positions, inp.scaling,
                                 return_probs=True)
    return probs * (inp.query_positions >= 0)[:, None, :, None]


# ----------------------------------------------------------------------------- registry and bad input
def test_registry_names():
    assert list(PRESSES) == ALL


@pytest.mark.parametrize("name", ALL)
def test_budget_must_exceed_always_kept(name):
    k = ALWAYS_KEPT.get(name, 0)
    assert PRESSES[name]().always_kept() == k
    if k:
        with pytest.raises(BadUsage, match="must exceed"):
            make_press(name, budget=k)
    make_press(name, budget=k + 1)
    with pytest.raises(BadUsage, match="budget"):
        make_press(name, budget=0)
    for bad in (-0.1, 1.0):
        with pytest.raises(BadUsage, match="outside"):
            make_press(name, compression_ratio=bad)


def test_unknown_press_lists_names():
    with pytest.raises(BadUsage, match="accepted: streaming_llm, knorm"):
        make_press("h2o", budget=8)


# ----------------------------------------------------------------------------- export-friendliness
@pytest.mark.parametrize("name", [n for n in ALL if n not in ("random", "optimal")])
def test_score_is_exportable(name):
    """torch.export (what the ONNX dynamo exporter runs) traces score() with no data-dependent branch,
    and the exported program computes the same scores."""
    inp = synthetic()
    p = press(name)

    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rot = inp.rotary

        def forward(self, k, v, pos, q, qp):
            return p.score(ScoreInputs(k, v, pos, q, qp, self.rot, inp.scaling, 0, 2, 20))

    args = (inp.keys, inp.values, inp.positions, inp.queries, inp.query_positions)
    ep = torch.export.export(Scorer(), args, strict=False)
    torch.testing.assert_close(ep.module()(*args), Scorer()(*args))


# ----------------------------------------------------------------------------- MLA shape: Hc = 1, Hq = 8
MLA = dict(B=2, Hc=1, Hq=8, S=36, Q=6, D=24, rot_dim=8, offset=16, pad=5)


@pytest.mark.parametrize("name", [n for n in ALL if n != "optimal"])
def test_mla_shape_scores(name):
    inp = synthetic(**MLA)
    s = press(name).score(inp)
    assert s.shape == (2, 1, 36)
    assert torch.isfinite(s[inp.valid]).all()


def test_observed_attention_reference_mla():
    inp = synthetic(**MLA)
    probs = reference_probs(inp)  # (B, Hq, Q, S)
    seen = ((inp.positions[:, :1, None, :] <= inp.query_positions[:, None, :, None])
            & (inp.positions[:, :1, None, :] >= 0)).sum(2).clamp(min=1)  # (B, 1, S)
    ref = (probs.sum(2) / seen).mean(1, keepdim=True)
    torch.testing.assert_close(press("observed_attention").score(inp), ref)


def test_tova_reference_mla():
    inp = synthetic(**MLA)
    ref = reference_probs(inp)[:, :, -1].mean(1, keepdim=True)  # (B, 1, S)
    s = press("tova").score(inp)
    torch.testing.assert_close(s[..., :-1], ref[..., :-1])
    assert (s[..., -1] > s[..., :-1].max()).all()


def test_snapkv_reference_and_short_window_mla():
    """Fewer observation queries (6) than window_size (64): the 6 there are observe and are kept."""
    inp = synthetic(**MLA)
    w, S = 6, 36
    probs = reference_probs(inp)[:, :, -w:, : S - w]  # (B, Hq, w, S - w)
    att = probs.mean(2)
    pad = torch.nn.functional.pad(att, (2, 2))
    pooled = torch.stack([pad[..., i : i + 5].sum(-1) / 5 for i in range(S - w)], -1)
    ref = pooled.mean(1, keepdim=True)
    s = make_press("snapkv", budget=100).score(inp)  # window_size 64 > Q = 6
    torch.testing.assert_close(s[..., : S - w], ref)
    assert (s[..., S - w :] > s[..., : S - w].max()).all()
    torch.testing.assert_close(s, press("snapkv", window_size=w).score(inp))


def test_expected_attention_reference_mla():
    """Reference: R averaged by rotating vectors one position at a time (rotary.apply, slice only)."""
    inp = synthetic(**{**MLA, "pad": 0})
    p = make_press("expected_attention", budget=10, n_future_positions=40)
    B, Hq, Q, D = inp.queries.shape
    mu_ref, cov_ref = [], []
    for b in range(B):
        start = int(inp.query_positions[b].max()) + 1
        eye = torch.eye(D)[None, None]  # rotate basis vectors: R^T rows
        Rt = torch.stack([inp.rotary.apply(eye, torch.tensor([[start + i] * D]))[0, 0] for i in range(40)]).mean(0)
        R = Rt.T
        q = inp.queries[b].float()  # (Hq, Q, D), all positions >= n_sink here
        mu = q.mean(1)
        c = q - mu[:, None]
        cov = c.transpose(1, 2) @ c / Q
        mu_ref.append(mu @ R.T)
        cov_ref.append(R @ cov @ R.T)
    mu_ref, cov_ref = torch.stack(mu_ref), torch.stack(cov_ref)
    mu, cov = p.query_statistics(inp)
    torch.testing.assert_close(mu, mu_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cov, cov_ref, atol=1e-5, rtol=1e-5)
    # rotation is the identity outside the rope slice [16, 24)
    R = p.averaged_rotation(inp)
    torch.testing.assert_close(R[:, :16, :16], torch.eye(16).expand(B, 16, 16))
    k = inp.keys[:, 0].float()  # (B, S, D)
    logit = torch.einsum("bhd,bsd->bhs", mu_ref, k) * inp.scaling
    logit = logit + torch.einsum("bsi,bhij,bsj->bhs", k, cov_ref, k) * inp.scaling**2 / 2
    logit[..., :4] = float("-inf")  # sinks
    ref = torch.softmax(logit, -1).mean(1) * inp.values[:, 0].norm(dim=-1)
    s = p.score(inp)[:, 0]
    torch.testing.assert_close(s[:, 4:], ref[:, 4:], atol=1e-6, rtol=1e-4)
    assert (s[:, :4] > s[:, 4:].max()).all()


# ----------------------------------------------------------------------------- single presses
def test_pyramidkv_budgets():
    """Ratio: kvpress's get_layer_budget (numbers worked by hand); absolute: a line averaging B."""
    p = make_press("pyramidkv", compression_ratio=0.5)
    assert p.layer_budgets(3, 160) == [96, 80, 64]  # max=n-window=96, min=2*80-96=64
    assert p.layer_budgets(3, 100) == [50, 50, 50]  # min_num < window: SnapKV fallback round(100 * 0.5)
    # kvpress quirk kept: one layer gets max_num = n - window, not n (1 - ratio); absolute budgets do not
    assert make_press("pyramidkv", compression_ratio=0.3).layer_budgets(1, 1000) == [936]
    assert make_press("pyramidkv", budget=2560).layer_budgets(1, 10) == [2560]
    b = make_press("pyramidkv", budget=2560).layer_budgets(5, 10)
    assert b == [4992, 3776, 2560, 1344, 128] and sum(b) == 5 * 2560  # min = B/20 = 128, max = 2B - min
    assert make_press("pyramidkv", budget=256).layer_budgets(4, 10) == [256] * 4  # 256/20 < window 64


def test_random_seeded():
    inp = synthetic()
    a, b = press("random", seed=3).score(inp), press("random", seed=3).score(inp)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, torch.rand(2, 2, 40, generator=torch.Generator().manual_seed(3)))


def test_keydiff_anchor_ignores_padding():
    inp = synthetic(pad=7)
    s = press("keydiff").score(inp)
    k = inp.keys[0, :, 7:]
    kn = torch.nn.functional.normalize(k, dim=-1)
    ref = -torch.nn.functional.cosine_similarity(k, kn.mean(1, keepdim=True), dim=-1)
    torch.testing.assert_close(s[0, :, 7:], ref)


def test_streaming_llm_keeps_sinks_and_recent():
    from kvexport.cache.static_cache import select_kept

    inp = synthetic(pad=3)
    idx = select_kept(press("streaming_llm").score(inp), inp.positions, 12)
    assert idx[0, 0].tolist() == [3, 4, 5, 6] + list(range(32, 40))  # first 4 real tokens + 8 newest
    assert idx[1, 0].tolist() == [0, 1, 2, 3] + list(range(32, 40))


def test_optimal_reference_and_needs_future():
    inp = synthetic(pad=2)
    fut_q = torch.randn(2, 4, 5, 16)
    fut_pos = torch.tensor([[40, 41, 42, 43, 44], [-1, 40, 41, 42, 43]])
    p = make_press("optimal", budget=10)
    with pytest.raises(BadUsage, match="future"):
        p.score(inp)
    p.future = {0: (fut_q, fut_pos)}
    ref_inp = ScoreInputs(**{**inp.__dict__, "queries": fut_q, "query_positions": fut_pos})
    probs = reference_probs(ref_inp)  # (B, Hq, F, S)
    n = (fut_pos >= 0).sum(-1).float()[:, None, None]
    ref = (probs.sum(2) / n).reshape(2, 2, 2, 40).mean(2)
    torch.testing.assert_close(p.score(inp), ref)
