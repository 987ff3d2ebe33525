# SPDX-License-Identifier: Apache-2.0
"""Full-cache exports held in buckets (kvexport.cache.plan rule 7): the graphs take the capacity axis as a dynamic
dimension, OrtGenerator holds the smallest power-of-two bucket that fits and doubles it when full.

Parity across a doubling (a 250-token prompt in the 256-slot bucket, decoding on into 512) against two independent
references: the PyTorch library path (its static cache holds the whole capacity, no buckets) and, for GQA, HF's own
greedy decoding. Press exports keep fixed shapes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from kvexport.cache.plan import MIN_BUCKET
from kvexport.runtime import Stream

CAPACITY = 1024
PROMPT = 250  # < MIN_BUCKET = 256: the prompt fits the first bucket, the 7th decoded token doubles it
NEW = 24
CASES = {"llama": ("llama", {}, {}), "qwen3": ("qwen3", {"head_dim": 32}, {}),
         "llama-mla": ("llama", {}, {"mla_rank": 16, "rope_dim": 4}),
         "qwen3-mla": ("qwen3", {"head_dim": 32}, {"mla_rank": 16, "rope_dim": 4})}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_models):
    """name -> (HF model, export dir), exported on first use."""
    from kvexport.export import export_model

    made: dict = {}

    def get(name: str):
        if name not in made:
            family, extra, kw = CASES[name]
            hf = tiny_models(family, **extra)
            out = export_model(hf, tmp_path_factory.mktemp(name) / "x", chunk=64, max_positions=CAPACITY, **kw)
            made[name] = (hf, out)
        return made[name]

    return get


@pytest.fixture(scope="module")
def press_export(tmp_path_factory, tiny_models):
    from kvexport.export import export_model

    return export_model(tiny_models("llama"), tmp_path_factory.mktemp("press") / "x", press="knorm", budget=12,
                        window=4, chunk=8)


def _prompt(n: int = PROMPT, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 128, (1, n))


def _dims(path, graph: str) -> dict[str, list]:
    m = onnx.load(str(path / f"{graph}.onnx"), load_external_data=False)
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_across_a_bucket_doubling(exports, name):
    from kvexport.export import OrtGenerator
    from kvexport.export.reference import load_reference_model, reference_generate

    hf, out = exports(name)
    gen = OrtGenerator(out)
    s = gen.settings
    assert s["dynamic_capacity"] is True and s["capacities"] == [CAPACITY] * s["num_layers"]
    ids = _prompt()
    Stream(gen, ids).prefill()
    assert gen.cache["k_0"].shape[2] == MIN_BUCKET  # the prompt's bucket, not the capacity
    res = gen.generate(ids, None, NEW, keep_logits=True)
    assert gen.cache["k_0"].shape[2] == 2 * MIN_BUCKET  # PROMPT + NEW - 1 rows: one doubling
    ref = reference_generate(load_reference_model({"settings": s}, hf), s, None, ids, np.ones_like(ids), NEW)
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    np.testing.assert_allclose(res.prompt_logits, ref.prompt_logits.numpy(), atol=1e-4, rtol=0)
    got, want = np.stack(res.step_logits), torch.stack(ref.step_logits).numpy()
    assert np.abs(got - want).max() <= 1e-4  # the parity tests' fp32 tolerance, before and after the doubling
    if "mla" not in name:  # the MLA rewrite is lossy by design: HF is the reference of the GQA exports only
        with torch.no_grad():
            hf_out = hf.generate(torch.as_tensor(ids), max_new_tokens=NEW, do_sample=False,
                                 attention_mask=torch.ones(1, PROMPT, dtype=torch.long))
        np.testing.assert_array_equal(res.tokens, hf_out[:, PROMPT:].numpy())


@pytest.mark.parametrize("name", ["llama", "qwen3-mla"])
def test_reserved_bucket_is_taken_at_prefill(exports, name):
    """A prompt that fills its bucket, with the sequence's length known (``generate``, the profiler): the bucket that
    length needs is taken at prefill when it is at most twice the prompt (no copy while decoding), and the run
    equals the PyTorch library path."""
    from kvexport.export import OrtGenerator
    from kvexport.export.reference import load_reference_model, reference_generate

    hf, out = exports(name)
    gen = OrtGenerator(out)
    ids = _prompt(MIN_BUCKET)
    stream = Stream(gen, ids, new_tokens=NEW)  # the sequence's length: MIN_BUCKET + NEW - 1 tokens
    last = stream.prefill()
    held = gen.cache["k_0"]
    assert held.shape[2] == 2 * MIN_BUCKET
    tok, got = np.asarray(last).argmax(-1), []
    for _ in range(NEW - 1):
        got.append(stream.decode(tok))
        tok = got[-1].argmax(-1)
    assert gen.cache["k_0"] is held  # never grown: the same buffer throughout
    # a sequence of 1023 tokens (it fits the capacity) needs a bucket of more than twice the prompt: the prompt's own
    Stream(gen, ids, new_tokens=3 * MIN_BUCKET).prefill()
    assert gen.cache["k_0"].shape[2] == MIN_BUCKET
    s = gen.settings
    ref = reference_generate(load_reference_model({"settings": s}, hf), s, None, ids, np.ones_like(ids), NEW)
    want = torch.stack(ref.step_logits).numpy()[:, 0]
    assert np.abs(np.stack(got)[:, 0] - want).max() <= 1e-4


def test_capacity_axis_symbolic_for_full_caches_static_for_presses(exports, press_export):
    _, full = exports("llama")
    for graph in ("prefill", "decode"):
        dims = _dims(full, graph)
        for i in range(2):
            assert dims[f"k_{i}"][2] == dims[f"v_{i}"][2] == dims[f"pos_{i}"][2] == "capacity"
            assert all(isinstance(d, int) for k in (f"k_{i}", f"pos_{i}") for d in dims[k][:2])
        # a prompt's last chunk runs at its real width (plan rule 2b): the prefill's column axis is dynamic too
        assert dims["input_ids"] == [1, "columns" if graph == "prefill" else 1]
    _, mla = exports("llama-mla")
    assert _dims(mla, "decode")["k_0"] == [1, 1, "capacity", 20]
    press = press_export
    assert json.loads((press / "manifest.json").read_text())["settings"]["dynamic_capacity"] is False
    for graph in ("prefill", "decode", "compact", "compact_prefill"):
        dims = _dims(press, graph)
        assert dims["k_0"] == [1, 2, 16, 16] and dims["pos_0"] == [1, 2, 16]


@pytest.mark.parametrize("name", ["llama", "llama-mla"])
def test_decode_reads_the_cache_without_copying_it(exports, name):
    """A full-cache decode step must not copy its past (issue 15): no node but the attention products (GQA: MatMul,
    the keys after a Transpose of their last two axes, which onnxruntime folds into the product; MLA:
    LatentAttention, given the cache buffer itself and this step's rows as ``new_latent``): no Concat, Gather or
    Where copies the cache."""
    _, out = exports(name)
    m = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    cache = {i.name for i in m.graph.input if i.name.startswith(("k_", "v_"))}
    readers = {}
    for n in m.graph.node:
        for i in n.input:
            if i in cache:
                readers.setdefault(i, []).append(n)
    assert set(readers) == ({c for c in cache if c.startswith("k_")} if name.endswith("mla") else cache)
    if name.endswith("mla"):  # the latent cache (B, 1, S, R + Dr) itself, this step's rows as new_latent
        for k, nodes in readers.items():
            assert [(n.op_type, list(n.input).index(k), len(n.input)) for n in nodes] == [("LatentAttention", 1, 5)]
        return
    users = {}
    for n in m.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    products = 0
    for k, nodes in readers.items():
        node = nodes[0]
        assert len(nodes) == 1
        if node.op_type == "Transpose":  # of the last two axes only: folded into the MatMul (FusedMatMul transB)
            perm = list(next(a for a in node.attribute if a.name == "perm").ints)
            assert perm == [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2], (k, perm)
            (node,) = users[node.output[0]]
        assert node.op_type == "MatMul", (k, node.op_type)
        products += 1
    assert products == len(cache)


def test_resident_bytes_are_the_buckets(exports):
    from kvexport.cache.memory import CacheShape
    from kvexport.export import OrtGenerator

    hf, out = exports("llama")
    gen = OrtGenerator(out)
    cfg = hf.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = CacheShape.from_export(gen.settings)
    for n, new, slots in ((PROMPT, NEW, 512), (40, 10, 256), (600, 5, 1024)):
        res = gen.generate(_prompt(n, seed=n), max_new_tokens=new)
        kv = L * 2 * H * slots * D * 4  # k and v, fp32, every layer: the bucket, by hand
        assert res.resident_bytes["kv"] == res.cache_bytes == gen.resident_bytes()["kv"] == kv
        assert res.resident_bytes["positions"] == L * H * slots * 8
        assert res.resident_bytes == shape.resident_bytes_at(n + new - 1)  # the formula knows the bucket too
        assert gen.kept_positions()[0].shape == (1, H, slots)


@pytest.mark.parametrize("name", ["llama", "qwen3-mla"])
def test_a_short_last_chunk_runs_at_its_real_width(exports, name):
    """Plan rule 2b on a full cache (whose chunks never compact): a prompt's last chunk with at least 2 real columns
    is fed without its padding, so a short prompt costs its own columns, not the chunk's; one real column keeps the
    chunk's width. Tokens and logits against the PyTorch library path."""
    from kvexport.export import OrtGenerator
    from kvexport.export.reference import load_reference_model, reference_generate

    hf, out = exports(name)
    gen = OrtGenerator(out)
    s = gen.settings
    assert s["ragged_last"] == "prefill"
    widths = []
    call = gen.graphs.call

    def recording(graph, feeds, *args, **kw):
        if graph.startswith("prefill"):
            widths.append(feeds["input_ids"].shape[1])
        return call(graph, feeds, *args, **kw)

    gen.graphs.call = recording
    dec = load_reference_model({"settings": s}, hf)
    for n, want in {1: [64], 2: [2], 40: [40], 64: [64], 65: [64, 64], 130: [64, 64, 2], 300: [64] * 4 + [44]}.items():
        widths.clear()
        ids = _prompt(n, seed=n)
        res = gen.generate(ids, None, 6, keep_logits=True)
        assert widths == want, n
        ref = reference_generate(dec, s, None, ids, np.ones_like(ids), 6)
        np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
        np.testing.assert_allclose(res.prompt_logits, ref.prompt_logits.numpy(), atol=1e-4, rtol=0)


def test_tensorrt_profile_spans_the_buckets(exports, press_export):
    """Without TensorRT: the engine builder's optimization profile for the capacity axis (recorded by stand-ins)."""
    from kvexport.errors import BadArtifact
    from kvexport.tensorrt.engine import capacity_profile, capacity_range, column_range
    from tests.tensorrt.profile_stand_ins import Builder, Config

    _, full = exports("llama")
    assert capacity_range(full / "decode.onnx") == (MIN_BUCKET, CAPACITY)
    assert column_range(full / "prefill.onnx") == (2, 64) and column_range(full / "decode.onnx") is None
    both = Config()  # the prefill: its columns (rule 2b) and its buckets (rule 7) in one profile
    capacity_profile(Builder(), both, full / "prefill.onnx",
                     {"input_ids": (1, -1), "positions": (1, -1), "k_0": (1, 2, -1, 16)})
    got = both.profiles[0].shapes
    assert got["input_ids"] == got["positions"] == ((1, 2), (1, 64), (1, 64))
    assert got["k_0"] == ((1, 2, MIN_BUCKET, 16), (1, 2, CAPACITY, 16), (1, 2, CAPACITY, 16))

    config = Config()
    capacity_profile(Builder(), config, full / "decode.onnx", {"k_0": (1, 2, -1, 16)})
    assert config.profiles[0].shapes["k_0"] == ((1, 2, MIN_BUCKET, 16), (1, 2, CAPACITY, 16), (1, 2, CAPACITY, 16))
    assert capacity_range(press_export / "decode.onnx") is None
    with pytest.raises(BadArtifact, match="dynamic shape"):
        capacity_profile(Builder(), Config(), press_export / "decode.onnx", {"k_0": (1, 2, -1, 16)})
    with pytest.raises(BadArtifact, match="dynamic shape"):  # only the capacity axis may be dynamic
        capacity_profile(Builder(), Config(), full / "decode.onnx", {"input_ids": (-1, 1)})


def test_bucket_rule():
    from kvexport.cache.plan import CachePlan, bucket_slots
    from kvexport.errors import BadUsage

    assert [bucket_slots(n, 16449) for n in (0, 1, 256, 257, 576, 8192, 8193, 16448, 16449)] == \
        [256, 256, 256, 512, 1024, 8192, 16384, 16449, 16449]
    assert bucket_slots(10, 64) == 64  # a capacity under the floor is one bucket
    assert CachePlan((1024, 1024), 0, False, 64, True, bucketed=True).slots_for(300) == 512
    assert CachePlan((1024, 1024), 0, False, 64, True).slots_for(300) == 1024  # not bucketed: the capacity
    with pytest.raises(BadUsage, match="buckets"):
        CachePlan((12, 12), 4, True, bucketed=True)
