# SPDX-License-Identifier: Apache-2.0
"""Memory as held: what each runtime allocated (read from its own buffers) equals the formula of
kvexport.cache.memory (CacheShape.resident_bytes_at), for eviction, MLA + eviction, per-layer budgets, a
static full cache and the growing past; and it stays fixed over a run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.cache.memory import CacheShape
from kvexport.export import export_model, open_onnxruntime
from kvexport.models.decoder import Decoder
from kvexport.presses import make_press

CONFIGS = {
    "snapkv": dict(press=make_press("snapkv", budget=12, window_size=4), window=4, chunk=8),
    "pyramidkv": dict(press=make_press("pyramidkv", budget=12, window_size=4, beta=2), window=4, chunk=8),
    "mla+knorm": dict(press="knorm", budget=12, window=4, chunk=8, mla_rank=16, rope_dim=4),
    "full-static": dict(chunk=8, max_positions=64),
    "growing": dict(dynamic_cache=True, chunk=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_onnxruntime_allocations_equal_the_formula(tiny_models, tmp_path, name):
    out = export_model(tiny_models("llama"), tmp_path / "x", **CONFIGS[name])
    gen = open_onnxruntime(out)
    shape = CacheShape.from_export(gen.settings)
    ids = np.random.default_rng(0).integers(3, 128, (1, 29))
    res = gen.generate(ids, max_new_tokens=10)
    got = res.resident_bytes
    want = shape.resident_bytes_at(29 + 9, batch=1, double_buffer=gen.dynamic)
    assert got == want
    assert got["kv"] == res.cache_bytes == shape.bytes_at(29 + 9)
    if gen.settings["mode"] == "static":
        assert got["total"] > got["kv"] + got["positions"]  # the ring, the step's rows, the logits: not K/V only
        gen.generate(np.random.default_rng(1).integers(3, 128, (1, 40)), max_new_tokens=20)
        assert gen.resident_bytes() == got  # fixed, whatever the prompt


def test_pytorch_cache_allocations_equal_the_formula(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    s = dec.spec
    cache = dec.new_cache(2, make_press("knorm", budget=12), 12, 4)
    shape = CacheShape(s.num_layers, s.num_kv_heads, s.head_dim, None, 0, 12, 4, 4, query_heads=s.num_heads,
                       query_dim=s.head_dim)
    want = shape.resident_bytes_at(100, batch=2)
    got = cache.resident_bytes()
    graph_only = ("step_outputs", "logits", "staging")  # a graph's step rows and chunk buffers: none in PyTorch
    cache_only = {k: v for k, v in want.items() if k not in (*graph_only, "total")}
    assert got == {**cache_only, **dict.fromkeys(graph_only, 0), "total": sum(cache_only.values())}
    # element by element: what one layer's buffers are
    L, H, Hq, D, cap, W = s.num_layers, s.num_kv_heads, s.num_heads, s.head_dim, 16, 4
    assert got["kv"] == 2 * L * 2 * H * cap * D * 4
    assert got["positions"] == 2 * L * H * cap * 8
    assert got["queries"] == 2 * L * Hq * W * D * 4 and got["query_positions"] == 2 * W * 8
    with torch.no_grad():
        dec(torch.zeros(2, 30, dtype=torch.long), torch.arange(30).expand(2, 30), cache)
    assert cache.resident_bytes() == got
