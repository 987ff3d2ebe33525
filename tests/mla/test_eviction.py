# SPDX-License-Identifier: Apache-2.0
"""Static-budget eviction over the MLA latent cache (Hc = 1, one selection per token shared by all heads).

The kept set after a single-shot prefill is checked against an independent NumPy reference: the latent
rows ``[c_kv ; RoPE(k_pe)]`` and the absorbed queries ``[W_UK,iᵀ q_i ; W_QR,i q_i]`` are rebuilt from the
MLA weights, scored by each press's published rule (REFERENCE.md §1: Knorm ``-‖k_j‖``, KeyDiff
``-cos(k_j, mean of normalised keys)``, StreamingLLM sinks + recent, TOVA the last query's attention averaged
over all heads, last token kept) and a stable top-k (ties to the lower index). Every registered press runs
through the cache once more to check that its buffers never move or grow."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.generation import generate
from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.models.decoder import Decoder
from kvexport.presses import PRESSES, make_press

N, BUDGET, WINDOW = 40, 16, 4
N_SINK = 4  # StreamingLLM's default (kvpress)


def press_for_test(name: str, budget: int):
    """The press with knobs scaled to a 40-token prompt (observation window 4) and a fixed seed."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(PRESSES[name])}
    kw = {k: v for k, v in {"window_size": 4, "seed": 0}.items() if k in fields}
    return make_press(name, budget=budget, **kw)


@pytest.fixture(scope="module")
def mla_model():
    from kvexport.models.tiny import tiny_model

    dec = Decoder.from_hf(tiny_model("llama", seed=2))
    return rewrite_to_mla(dec, MLASettings(kv_rank=16, rope_dim=8))


# ---------------------------------------------------------------------------------------- NumPy reference
def np_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, scaling: float) -> np.ndarray:
    """HF half-split RoPE of x (..., T, d) at positions pos (T,)."""
    half = x.shape[-1] // 2
    ang = pos[:, None] * inv_freq[None, :]  # (T, d/2)
    c, s = np.cos(ang) * scaling, np.sin(ang) * scaling
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def np_layer(attn, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """h (T, H) attention input of one layer -> latent rows (T, r + dr), RoPE'd absorbed queries (Hq, T, r + dr)."""
    w = lambda t: t.detach().double().numpy()  # noqa: E731
    r, D, Hq = attn.kv_rank, attn.head_dim, attn.num_heads
    pos = np.arange(h.shape[0], dtype=np.float64)
    inv, sc = w(attn.score_rotary.inv_freq), attn.score_rotary.scaling
    c_kv = h @ w(attn.kv_a_proj.weight).T  # (T, r)
    k_pe = h @ w(attn.k_rope_proj.weight).T
    if attn.k_rope_proj.bias is not None:
        k_pe = k_pe + w(attn.k_rope_proj.bias)
    rows = np.concatenate([c_kv, np_rope(k_pe, pos, inv, sc)], axis=-1)
    q = h @ w(attn.q_proj.weight).T
    if attn.q_proj.bias is not None:
        q = q + w(attn.q_proj.bias)
    q = q.reshape(-1, Hq, D).transpose(1, 0, 2)  # (Hq, T, D)
    w_uk = w(attn.kv_b_proj.weight).reshape(Hq, 2 * D, r)[:, :D]  # (Hq, D, r)
    q_lat = np.einsum("htd,hdr->htr", q, w_uk)
    q_pe = np.einsum("htd,hpd->htp", q, w(attn.q_rope))
    return rows, np.concatenate([q_lat, np_rope(q_pe, pos, inv, sc)], axis=-1)


def np_scores(name: str, rows: np.ndarray, q: np.ndarray, scaling: float) -> np.ndarray:
    """The press's score of every prompt token (T,), from the published formulas."""
    T = rows.shape[0]
    if name == "knorm":
        return -np.linalg.norm(rows, axis=-1)
    if name == "keydiff":
        kn = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
        a = kn.mean(0)
        return -(kn @ a) / np.linalg.norm(a)
    if name == "streaming_llm":
        s = np.arange(T, dtype=np.float64)
        s[:N_SINK] += 1e9
        return s
    if name == "tova":
        logits = q[:, -1] @ rows.T * scaling  # (Hq, T): the last query sees every token
        p = np.exp(logits - logits.max(-1, keepdims=True))
        s = (p / p.sum(-1, keepdims=True)).mean(0)
        s[-1] = s.max() + 1.0  # the newest token is always kept
        return s
    raise KeyError(name)


def np_kept(scores: np.ndarray, n_keep: int) -> np.ndarray:
    """Positions of the n_keep best scores, ascending; ties to the lower position."""
    return np.sort(np.argsort(-scores, kind="stable")[:n_keep])


@pytest.mark.parametrize("name", ["knorm", "keydiff", "streaming_llm", "tova"])
def test_kept_set_equals_numpy_reference(mla_model, name):
    caught = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: caught.append(a[0][0].detach().double().numpy()))
             for layer in mla_model.layers]
    press = press_for_test(name, BUDGET)
    ids = torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(7))
    cache = mla_model.new_cache(1, press, [BUDGET] * len(mla_model.layers), WINDOW)
    try:
        with torch.no_grad():
            mla_model(ids, torch.arange(N)[None], cache)
    finally:
        for hk in hooks:
            hk.remove()
    for layer, h, lc in zip(mla_model.layers, caught, cache.layers, strict=True):
        attn = layer.self_attn
        rows, q = np_layer(attn, h)
        want = np_kept(np_scores(name, rows, q, attn.scaling), BUDGET)
        got = lc.pos[0, 0, : lc.fill].numpy()
        np.testing.assert_array_equal(got, want)
        # the cache holds those tokens' latent rows, as the NumPy rewrite of the weights computes them
        np.testing.assert_allclose(lc.k[0, 0, : lc.fill].double().numpy(), rows[want], atol=1e-5, rtol=1e-5)


def test_streaming_llm_reference_is_sinks_plus_recent():
    """The reference itself, on numbers written out: sinks 0-3 and the newest 12 of 40."""
    want = np.array([0, 1, 2, 3] + list(range(28, 40)))
    np.testing.assert_array_equal(np_kept(np_scores("streaming_llm", np.zeros((40, 2)), None, 1.0), 16), want)


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_press_keeps_buffers_fixed(mla_model, name):
    """Every press on the latent cache: prefill keeps the layer budgets, decoding past capacity compacts
    in place (same buffers, same shapes, value width 0)."""
    if name == "optimal":
        pytest.skip("the optimal press is an oracle that needs future queries recorded first")
    press = press_for_test(name, BUDGET)
    ids = torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(7))
    budgets = press.layer_budgets(len(mla_model.layers), N)
    cache = mla_model.new_cache(1, press, budgets, WINDOW)
    ptrs = [(lc.k.data_ptr(), lc.k.shape, lc.v.shape) for lc in cache.layers]
    torch.manual_seed(0)
    with torch.no_grad():
        mla_model(ids, torch.arange(N)[None], cache)
        assert [lc.fill for lc in cache.layers] == list(budgets)
        for lc in cache.layers:  # distinct prompt positions, ascending
            p = lc.pos[0, 0, : lc.fill]
            assert bool((p[1:] > p[:-1]).all()) and int(p.min()) >= 0 and int(p.max()) < N
        for t in range(2 * WINDOW + 1):
            mla_model(ids[:, t : t + 1], torch.tensor([[N + t]]), cache, mode="decode")
    assert cache.compactions >= 2
    assert [(lc.k.data_ptr(), lc.k.shape, lc.v.shape) for lc in cache.layers] == ptrs
    assert all(lc.k.shape == (1, 1, b + WINDOW, 24) and lc.v.shape[-1] == 0
               for lc, b in zip(cache.layers, budgets, strict=True))


@pytest.mark.parametrize("name", ["snapkv", "knorm", "tova", "expected_attention", "streaming_llm"])
def test_generate_with_budget(mla_model, name):
    """generate() on an MLA model with a static budget: a budget that holds everything changes nothing;
    a small one keeps the cache at budget + window (2 layers x 16 slots x 24 elements x 4 bytes)."""
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(8))
    full = generate(mla_model, ids, max_new_tokens=10, keep_logits=True)
    roomy = generate(mla_model, ids, press=press_for_test(name, 40), window=8, max_new_tokens=10, keep_logits=True)
    assert torch.equal(full.tokens, roomy.tokens)
    small = generate(mla_model, ids, press=press_for_test(name, 12), window=4, max_new_tokens=10)
    assert small.compactions >= 2
    assert len(mla_model.layers) == 2
    assert small.cache_bytes == 3072
