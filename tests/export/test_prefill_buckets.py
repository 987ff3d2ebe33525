# SPDX-License-Identifier: Apache-2.0
"""Prefill buckets of an evicting cache (kvexport.cache.plan rule 7b): ``prefill.onnx`` takes the cache's capacity
axis as a dynamic dimension and the host hands each chunk only the power-of-two bucket (>= MIN_BUCKET) of the slots
filled before it, so a prompt's first chunks do not attend over the empty capacity. The other graphs keep fixed
shapes.

Checked against the PyTorch library path as a user calls it (its cache reads exactly the filled slots, no buckets):
greedy tokens equal, prompt logits within 1e-4, and the kept positions of every layer equal after the prompt (the
prompt overflows the budget, so chunks compact); GQA and MLA, fp32 and int8 caches, with a lookahead tail."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

BUDGET, WINDOW, CHUNK, LOOK = 400, 16, 96, 16
PROMPT, NEW = 700, 24  # 8 chunks: fills 0, 96, ..., 672 -> compactions from the 5th chunk on
CASES = {"gqa-fp32": ({}, None), "gqa-int8": ({}, "int8"), "mla-int8": ({"mla_rank": 16, "rope_dim": 4}, "int8")}


def _bucket(filled: int, capacity: int) -> int:
    """What rule 7b hands a chunk, restated here: the smallest power of two >= max(filled, 256), at most the
    capacity."""
    n = 256
    while n < filled:
        n *= 2
    return min(n, capacity)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_models):
    from kvexport.export import export_model

    made: dict = {}

    def get(name: str):
        if name not in made:
            kw, kvd = CASES[name]
            hf = tiny_models("llama")
            out = export_model(hf, tmp_path_factory.mktemp(name) / "x", press="snapkv", budget=BUDGET, window=WINDOW,
                               chunk=CHUNK, lookahead=LOOK, kv_dtype=kvd, **kw)
            made[name] = (hf, out)
        return made[name]

    return get


def _axis2(path, graph: str) -> set:
    m = onnx.load(str(path / f"{graph}.onnx"), load_external_data=False)
    return {(d := i.type.tensor_type.shape.dim[2]).dim_param or d.dim_value
            for i in m.graph.input if re.fullmatch(r"(k|v|pos)_\d+", i.name)}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_reads_the_bucket_of_what_is_filled(exported, name):
    from kvexport.export import OrtGenerator
    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.export.source import press_from_dict

    hf, out = exported(name)
    cap = BUDGET + WINDOW
    assert _axis2(out, "prefill") == _axis2(out, "prefill_last") == {"capacity"}  # dynamic ...
    for graph in ("decode", "compact_prefill", "compact_prefill_tail", "compact"):
        assert _axis2(out, graph) == {cap}, graph  # ... and only there
    gen = OrtGenerator(out, threads=1)
    s = gen.settings
    assert s["prefill_bucketed"] is True
    handed, call = [], gen.graphs.call

    def spy(graph, feeds, arrays, outputs, persistent=False):
        if graph.startswith("prefill"):
            handed.append((graph, {arrays[n].shape[2] for n in arrays}, feeds["input_ids"].shape[1]))
        return call(graph, feeds, arrays, outputs, persistent)

    gen.graphs.call = spy
    ids = np.random.default_rng(7).integers(3, 128, (1, PROMPT))
    res = gen.generate(ids, None, NEW, keep_logits=True)
    fills, expect, n = 0, [], -(-PROMPT // CHUNK)
    for c in range(n):  # the last chunk has no lookahead tail: prefill_last, C columns
        expect.append(("prefill_last", {_bucket(fills, cap)}, CHUNK) if c == n - 1 else
                      ("prefill", {_bucket(fills, cap)}, CHUNK + LOOK))
        fills = min(fills + CHUNK, BUDGET)
    assert handed == expect
    assert handed[0][1] == {256} and handed[-1][1] == {cap}  # the first chunk reads 256 slots of 416, the last all
    assert gen.cache["k_0"].shape[2] == cap  # the buffers keep the capacity

    ref = reference_generate(load_reference_model({"settings": s}, hf), s, press_from_dict(s["press"]), ids,
                             np.ones_like(ids), NEW)
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    np.testing.assert_allclose(res.prompt_logits, ref.prompt_logits.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gqa-int8", "mla-int8"])
def test_kept_after_the_prompt_equal_the_library_path(exported, name):
    """What the prompt's compactions kept, layer by layer, against the PyTorch cache fed the same chunks."""
    from kvexport.export import OrtGenerator
    from kvexport.export.reference import load_reference_model, reference_kwargs
    from kvexport.export.source import press_from_dict
    from kvexport.runtime import Stream
    from kvexport.runtime.torch_driver import TorchDriver

    hf, out = exported(name)
    gen = OrtGenerator(out, threads=1)
    s = gen.settings
    ids = np.random.default_rng(11).integers(3, 128, (1, PROMPT))
    Stream(gen, ids).prefill()
    ref = TorchDriver(load_reference_model({"settings": s}, hf), **reference_kwargs(s, press_from_dict(s["press"])))
    Stream(ref, ids).prefill()
    got, kept = gen.kept_positions(), ref.kept_positions()
    assert len(got) == len(kept) == s["num_layers"]
    for i, (a, b) in enumerate(zip(got, kept, strict=True)):
        b = b.detach().cpu().numpy() if hasattr(b, "detach") else np.asarray(b)
        assert (a >= 0).sum() == BUDGET * a.shape[1], f"layer {i}"  # the prompt filled the budget
        np.testing.assert_array_equal(np.sort(a[a >= 0]), np.sort(b[b >= 0]), err_msg=f"layer {i}")


def test_tensorrt_profile_only_for_the_prefill(exported):
    """Without TensorRT: the engine builder gives the prefill graph's capacity axis a profile from the smallest
    bucket to the capacity, and the other graphs none (their shapes are fixed)."""
    from kvexport.tensorrt.engine import capacity_range

    _, out = exported("gqa-fp32")
    assert capacity_range(out / "prefill.onnx") == (256, BUDGET + WINDOW)
    assert capacity_range(out / "prefill_last.onnx") == (256, BUDGET + WINDOW)
    for graph in ("decode", "compact_prefill", "compact_prefill_tail", "compact"):
        assert capacity_range(out / f"{graph}.onnx") is None
