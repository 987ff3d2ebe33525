# SPDX-License-Identifier: Apache-2.0
"""Analytic KV bytes against the buffers kvexport really allocates and against numbers computed by hand."""

from __future__ import annotations

import pytest

from kvexport.cache.memory import CacheShape, cache_table, full_cache_of


@pytest.mark.parametrize("budget,window", [(None, 0), (16, 4)])
def test_gqa_bytes_equal_allocated_cache(tiny_models, budget, window):
    from kvexport.models.decoder import Decoder
    from kvexport.presses import make_press

    hf = tiny_models("llama")
    dec = Decoder.from_hf(hf)
    s = dec.spec
    context = 40
    shape = CacheShape(s.num_layers, s.num_kv_heads, s.head_dim, None, 0, budget, window, 4)
    if budget is None:
        cache = dec.new_cache(1, None, context, 1)
        # a full cache of `context` slots (+1 decode slot the reference cache keeps)
        assert shape.bytes_at(context + 1) == cache.nbytes()
    else:
        cache = dec.new_cache(1, make_press("knorm", budget=budget), budget, window)
        assert shape.bytes_at(context) == cache.nbytes() == shape.bytes_at(10 * context)
        assert shape.index_bytes_at(context) == sum(layer.pos.numel() * 8 for layer in cache.layers)


def test_mla_bytes_equal_allocated_cache(tiny_models):
    from kvexport.mla.config import MLASettings
    from kvexport.mla.rewrite import rewrite_to_mla
    from kvexport.presses import make_press

    dec = rewrite_to_mla(tiny_models("llama"), MLASettings(kv_rank=16, rope_dim=8))
    s = dec.spec
    shape = CacheShape(s.num_layers, s.num_kv_heads, s.head_dim, tuple(p.kv_rank for p in dec.mla_plans), 8, 24, 8)
    cache = dec.new_cache(1, make_press("knorm", budget=24), 24, 8)
    assert shape.bytes_at(100) == cache.nbytes()
    assert shape.bytes_per_token() == s.num_layers * (16 + 8) * 4


#: Llama-3.2-1B shape (16 layers, 8 KV heads, head 64), d_rope 32, fp32: r_kv -> bytes per token (16 x (r + 32) x 4)
#: and REFERENCE.md's ratio against 16 x 1024 x 4 = 65,536
LLAMA_1B = {48: (5_120, 12.8), 64: (6_144, 10.67), 128: (10_240, 6.4), 256: (18_432, 3.56), 512: (34_816, 1.88)}


@pytest.mark.parametrize("rank", sorted(LLAMA_1B))
def test_llama_1b_mla_bytes_by_hand(rank):
    per_token, ratio = LLAMA_1B[rank]
    shape = CacheShape(16, 8, 64, (rank,) * 16, 32)
    t = cache_table(shape, [4096])
    assert shape.bytes_per_token() == t["bytes_per_token"] == per_token
    assert t["baseline_bytes_per_token"] == 65_536
    assert shape.bytes_at(4096) == 4096 * per_token
    assert t["per_token_ratio"] == pytest.approx(ratio, abs=0.01)


def test_static_budget_table():
    shape = CacheShape(4, 2, 32, None, 0, 256, 32, 4)
    t = cache_table(shape, [512, 2048, 8192])
    per_tok = 4 * 2 * 2 * 32 * 4  # layers * kv heads * (K+V) * head_dim * fp32
    assert t["bytes_per_token"] == t["baseline_bytes_per_token"] == per_tok
    rows = {r["context"]: r for r in t["contexts"]}
    assert rows[8192]["kv_bytes"] == 288 * per_tok
    assert rows[8192]["baseline_kv_bytes"] == 8192 * per_tok
    assert rows[8192]["ratio"] == pytest.approx(8192 / 288)
    assert full_cache_of(shape).budget is None


def test_static_full_cache_counts_its_bucket():
    """A static export without a press holds the power-of-two bucket of the context (>= 256 slots, at most its
    capacity; kvexport.cache.plan rule 7): that is what is resident."""
    shape = CacheShape(4, 2, 32, (16,) * 4, 8, None, 0, 4, capacity=4096)
    assert shape.bytes_at(512) == 512 * 4 * 24 * 4
    assert shape.bytes_at(600) == 1024 * 4 * 24 * 4
    assert shape.bytes_at(100) == 256 * 4 * 24 * 4
    assert shape.bytes_at(4000) == shape.bytes_at(4096) == 4096 * 4 * 24 * 4
    assert full_cache_of(shape).bytes_at(512) == 512 * 4 * 2 * 2 * 32 * 4
