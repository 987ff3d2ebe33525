# SPDX-License-Identifier: Apache-2.0
"""Static-budget eviction over the MLA latent cache (Hc = 1, one selection per token shared by all heads),
for every press in the registry: the cache stays fixed, and the kept set after a single-shot prefill equals
the press's own top-k over the latent keys and absorbed queries, computed here outside the cache."""

from __future__ import annotations

import pytest
import torch

from kvexport.cache.static_cache import select_kept
from kvexport.generation import generate
from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.models.decoder import Decoder
from kvexport.presses import PRESSES, make_press
from kvexport.presses.base import ScoreInputs

N, BUDGET, WINDOW = 40, 16, 4


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


def reference_kept(mla, press, ids):
    """Per layer: the positions the press keeps from the whole prompt, scored from a never-evicting run."""
    caught = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: caught.append(a[0])) for layer in mla.layers]
    cache = mla.new_cache(1, None, N, 1)
    pos = torch.arange(N)[None]
    with torch.no_grad():
        mla(ids, pos, cache)
    for hk in hooks:
        hk.remove()
    kept = []
    for i, (layer, h) in enumerate(zip(mla.layers, caught, strict=True)):
        attn = layer.self_attn
        lc = cache.layers[i]
        k, v, p = lc.occupied()
        q = attn.score_queries(attn.queries(h))
        inp = ScoreInputs(keys=k, values=v, positions=p, queries=q, query_positions=pos, rotary=attn.score_rotary,
                          scaling=attn.scaling, layer_idx=i, num_layers=len(mla.layers), n_keep=lc.budget)
        inp.n_keep = press.layer_budgets(len(mla.layers), N)[i]
        torch.manual_seed(0)
        if hasattr(press, "reset"):  # a seeded press replays its first draw
            press.reset()
        idx = select_kept(press.score(inp), p, inp.n_keep)
        kept.append(p.gather(2, idx))
    return kept


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_press_on_latent_cache(mla_model, name):
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
    got = [lc.pos[:, :, : lc.fill].clone() for lc in cache.layers]
    want = reference_kept(mla_model, press, ids)
    for g, w, b in zip(got, want, budgets, strict=True):
        assert g.shape == (1, 1, b)
        assert torch.equal(g, w)
    # decoding past capacity compacts in place: same buffers, same shapes
    with torch.no_grad():
        for t in range(2 * WINDOW + 1):
            mla_model(ids[:, t : t + 1], torch.tensor([[N + t]]), cache, mode="decode")
    assert cache.compactions >= 2
    assert [(lc.k.data_ptr(), lc.k.shape, lc.v.shape) for lc in cache.layers] == ptrs
    assert all(lc.k.shape == (1, 1, b + WINDOW, 24) and lc.v.shape[-1] == 0
               for lc, b in zip(cache.layers, budgets, strict=True))


@pytest.mark.parametrize("name", ["snapkv", "knorm", "tova", "expected_attention", "streaming_llm"])
def test_generate_with_budget(mla_model, name):
    """generate() on an MLA model with a static budget: a budget that holds everything changes nothing;
    a small one keeps the cache at budget + window."""
    if name not in PRESSES:
        pytest.skip(f"press {name} is not in this tree yet")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(8))
    full = generate(mla_model, ids, max_new_tokens=10, keep_logits=True)
    roomy = generate(mla_model, ids, press=press_for_test(name, 40), window=8, max_new_tokens=10, keep_logits=True)
    assert torch.equal(full.tokens, roomy.tokens)
    small = generate(mla_model, ids, press=press_for_test(name, 12), window=4, max_new_tokens=10)
    assert small.compactions >= 2
    assert small.cache_bytes == sum(lc.k.numel() * 4 for lc in small.cache.layers)
    assert small.cache_bytes == len(mla_model.layers) * (12 + 4) * 24 * 4
