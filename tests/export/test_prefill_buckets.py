# SPDX-License-Identifier: Apache-2.0
"""Read buckets of an evicting cache (kvexport.cache.plan rule 7b): the graphs that read the cache without compacting
it (``prefill``, ``prefill_last``, ``decode``) take the capacity axis as a dynamic dimension and the host hands each
call only the power-of-two bucket (>= MIN_BUCKET) of the slots filled before it while that is at most half the
capacity, so a prompt's first chunks and a short sequence's steps do not read the empty capacity. The compactions
keep fixed shapes.

Checked against the PyTorch library path as a user calls it (its cache reads exactly the filled slots, no buckets):
greedy tokens equal, prompt logits within 1e-4, and the kept positions of every layer equal after the prompt (the
prompt overflows the budget, so chunks compact); GQA with an int8 cache, MLA with an fp32 one, both with a
lookahead tail."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

BUDGET, WINDOW, CHUNK, LOOK = 600, 16, 96, 16  # 616 slots: a bucket of 256 is read, 512 would be more than half
PROMPT, NEW = 900, 24  # 10 chunks: fills 0, 96, ..., 600 -> compactions from the 7th chunk on
CASES = {"gqa-int8": ({}, "int8"), "mla-fp32": ({"mla_rank": 16, "rope_dim": 4}, None)}


def _bucket(filled: int, capacity: int) -> int:
    """What rule 7b hands a call, restated here: the smallest power of two >= max(filled, 256) when it is at most
    half the capacity, else the capacity."""
    n = 256
    while n < filled:
        n *= 2
    return n if 2 * n <= capacity else capacity


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_models):
    from kvexport.export import export_model

    made: dict = {}

    def get(name: str):
        if name not in made:
            kw, kvd = CASES[name]
            hf = tiny_models("llama")
            out = export_model(hf, tmp_path_factory.mktemp(name) / "x", press="snapkv", budget=BUDGET, window=WINDOW,
                               chunk=CHUNK, lookahead=LOOK, kv_dtype=kvd, decode_batch=2, **kw)
            made[name] = (hf, out)
        return made[name]

    return get


def _record(graphs, pick) -> list:
    """Wrap ``graphs.call`` (a host backend) to append ``pick(graph, feeds, arrays)`` of every call where it is not
    None; -> the list it appends to."""
    seen, call = [], graphs.call

    def spy(graph, feeds, arrays, outputs, persistent=False):
        got = pick(graph, feeds, arrays)
        if got is not None:
            seen.append(got)
        return call(graph, feeds, arrays, outputs, persistent)

    graphs.call = spy
    return seen


def _slots(arrays: dict) -> set:
    """The slot counts (axis 2) of a call's cache inputs."""
    return {a.shape[2] for a in arrays.values()}


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
    for graph in ("prefill", "prefill_last", "decode", "decode_batch"):
        assert _axis2(out, graph) == {"capacity"}, graph  # dynamic ...
    for graph in ("compact_prefill", "compact_prefill_tail", "compact"):
        assert _axis2(out, graph) == {cap}, graph  # ... and only there
    gen = OrtGenerator(out, threads=1)
    s = gen.settings
    assert s["read_buckets"] == ["prefill", "decode", "prefill_last", "decode_batch"]
    handed = _record(gen.graphs, lambda graph, feeds, arrays: (graph, _slots(arrays), feeds["input_ids"].shape[1])
                     if graph.startswith("prefill") else None)
    ids = np.random.default_rng(7).integers(3, 128, (1, PROMPT))
    res = gen.generate(ids, None, NEW, keep_logits=True)
    fills, expect, n = 0, [], -(-PROMPT // CHUNK)
    for c in range(n):  # the last chunk has no lookahead tail: prefill_last, C columns
        expect.append(("prefill_last", {_bucket(fills, cap)}, CHUNK) if c == n - 1 else
                      ("prefill", {_bucket(fills, cap)}, CHUNK + LOOK))
        fills = min(fills + CHUNK, BUDGET)
    assert handed == expect
    assert handed[0][1] == {256} and handed[-1][1] == {cap}  # the first chunk reads 256 slots of 616, the last all
    assert gen.cache["k_0"].shape[2] == cap  # the buffers keep the capacity

    ref = reference_generate(load_reference_model({"settings": s}, hf), s, press_from_dict(s["press"]), ids,
                             np.ones_like(ids), NEW)
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    np.testing.assert_allclose(res.prompt_logits, ref.prompt_logits.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_a_short_sequence_decodes_over_its_bucket(exported, name):
    """A 100-token prompt decoding 200 tokens: steps read 256 slots until the cache holds 256, then the capacity;
    every step's logits against the library path, within validate's gate for the export's cache (an int8 cache:
    the two sides may store a value at a rounding boundary one code apart, kvexport.export.parity)."""
    from kvexport.export import OrtGenerator
    from kvexport.export.parity import ParityRule
    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.export.source import press_from_dict

    hf, out = exported(name)
    gen = OrtGenerator(out, threads=1)
    s = gen.settings
    read = _record(gen.graphs, lambda graph, feeds, arrays: _slots(arrays) if graph == "decode" else None)
    ids = np.random.default_rng(3).integers(3, 128, (1, 100))
    res = gen.generate(ids, None, 200, keep_logits=True)
    assert read == [{_bucket(100 + k, BUDGET + WINDOW)} for k in range(199)]
    assert read[0] == {256} and read[-1] == {BUDGET + WINDOW}
    ref = reference_generate(load_reference_model({"settings": s}, hf), s, press_from_dict(s["press"]), ids,
                             np.ones_like(ids), 200)
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    atol = ParityRule(s).tolerances[0]
    assert atol == (0.25 if name == "gqa-int8" else 1e-4)
    got, want = np.stack(res.step_logits), np.stack([x.numpy() for x in ref.step_logits])
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    # until the first step whose logits part, the float32 arithmetic agrees to its rounding
    np.testing.assert_allclose(got[:10], want[:10], atol=1e-4, rtol=0)


def test_one_batch_holds_its_bucket_and_reads_its_buffers_whole(exported):
    """The batch driver holds its cache in the bucket (plan rule 7b, CachePlan.slots_for): a 100-token prompt's
    steps are handed the host's own buffers (no copy per call) and its resident bytes are the formula's for the
    bucket, below the capacity's; past half the capacity it holds the capacity, as a server's bank does."""
    from kvexport.cache.memory import CacheShape
    from kvexport.export import OrtGenerator

    _, out = exported("gqa-int8")
    gen = OrtGenerator(out, threads=1)
    shape, bank = CacheShape.from_export(gen.settings), CacheShape.from_export(gen.settings, banked=True)
    own = _record(gen.graphs, lambda graph, feeds, arrays: all(a is gen.cache[n] for n, a in arrays.items())
                  if graph == "decode" else None)
    ids = np.random.default_rng(5).integers(3, 128, (1, 100))
    gen.generate(ids, None, 40)
    assert own == [True] * 39
    held = gen.resident_bytes()
    assert held == shape.resident_bytes_at(100 + 40 - 1)
    assert {a.shape[2] for n, a in gen.cache.items() if re.fullmatch(r"(k|v|pos|ks|vs)_\d+", n)} == {256}
    assert held["kv"] * (BUDGET + WINDOW) == bank.resident_bytes_at(139)["kv"] * 256
    gen.generate(np.random.default_rng(6).integers(3, 128, (1, 300)), None, 4)  # 303 tokens: the capacity
    assert gen.resident_bytes() == shape.resident_bytes_at(303) == bank.resident_bytes_at(303)


def test_profile_counts_the_bucket_it_holds(exported):
    """`kvexport profile` of a read-bucket export: at a short context its analytic K/V bytes are the bucket's
    (CacheShape with read_buckets) and equal what the runtime holds; at a long one, the capacity's."""
    from kvexport.cache.memory import CacheShape
    from kvexport.profile.run import profile_dir

    _, out = exported("gqa-int8")
    prof = profile_dir(out, contexts=[60, 400], decode_steps=2, baseline=False, write=False, repeats=1)
    rows = {r["context"]: r for r in prof["variants"]["converted"]["contexts"]}
    bank = CacheShape.from_export(__import__("json").loads((out / "manifest.json").read_text())["settings"],
                                  banked=True)
    assert rows[60]["resident"]["kv"] == rows[60]["kv_bytes"] == bank.bytes_at(61) * 256 // (BUDGET + WINDOW)
    assert rows[400]["resident"]["kv"] == rows[400]["kv_bytes"] == bank.bytes_at(401)


def test_server_slots_decode_together_over_their_bucket(exported):
    """Two server slots (a bank of batch-1 rows, decode_batch.onnx) at different fills: each step reads the bucket
    of the fuller one; every sequence's tokens are the library path's."""
    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.export.source import press_from_dict
    from kvexport.runtime import Stream
    from kvexport.runtime.sessions import OrtSessions
    from kvexport.runtime.slots import SlotBank

    hf, out = exported("gqa-int8")
    bank = SlotBank(OrtSessions(out, threads=1), slots=2)
    assert bank.batched
    read = _record(bank.graphs, lambda graph, feeds, arrays: _slots(arrays) if graph == "decode_batch" else None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, (1, 100)), rng.integers(3, 128, (1, 150))]
    n_new = 140
    drivers = [bank.slot(0), bank.slot(1)]
    toks = [[int(np.asarray(Stream(d, p).prefill()).argmax())] for d, p in zip(drivers, prompts, strict=True)]
    for k in range(n_new - 1):
        got = bank.decode_slots(drivers, np.array([t[-1] for t in toks]),
                                np.array([p.shape[1] + k for p in prompts]))
        for t, (logits, _) in zip(toks, got, strict=True):
            t.append(int(logits.argmax()))
    assert read == [{_bucket(150 + k, BUDGET + WINDOW)} for k in range(n_new - 1)]
    assert read[0] == {256} and read[-1] == {BUDGET + WINDOW}
    s = bank.settings
    dec = load_reference_model({"settings": s}, hf)
    for p, t in zip(prompts, toks, strict=True):
        ref = reference_generate(dec, s, press_from_dict(s["press"]), p, np.ones_like(p), n_new)
        assert t == ref.tokens[0].tolist()


@pytest.mark.parametrize("name", list(CASES))
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


@pytest.mark.parametrize("lookahead", [LOOK, 0])
def test_a_short_last_chunk_runs_at_its_real_width(exported, tmp_path, tiny_models, lookahead):
    """Plan rule 2b: a prompt's last chunk that does not compact and has at least 2 real columns is fed without its
    padding (prefill_last with a lookahead, prefill without); one real column, or a compaction, keeps the chunk's
    width. Tokens and logits against the library path."""
    from kvexport.export import OrtGenerator, export_model
    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.export.source import press_from_dict

    if lookahead:
        hf, out = exported("gqa-int8")
    else:
        hf = tiny_models("llama")
        out = export_model(hf, tmp_path / "x", press="snapkv", budget=BUDGET, window=WINDOW, chunk=CHUNK)
    gen = OrtGenerator(out, threads=1)
    s = gen.settings
    last = "prefill_last" if lookahead else "prefill"
    assert s["ragged_last"] == last
    widths = _record(gen.graphs, lambda graph, feeds, arrays: (graph, feeds["input_ids"].shape[1])
                     if graph.startswith("prefill") else None)
    full = CHUNK + lookahead
    want = {50: [(last, 50)], 100: [("prefill", full), (last, 4)], 97: [("prefill", full), (last, CHUNK)],
            PROMPT: [("prefill", full)] * (PROMPT // CHUNK) + [(last, CHUNK)]}  # 900: the last chunk compacts
    dec = load_reference_model({"settings": s}, hf)
    for n, expect in want.items():
        widths.clear()
        ids = np.random.default_rng(n).integers(3, 128, (1, n))
        res = gen.generate(ids, None, 8, keep_logits=True)
        assert widths == expect, n
        ref = reference_generate(dec, s, press_from_dict(s["press"]), ids, np.ones_like(ids), 8)
        np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
        np.testing.assert_allclose(res.prompt_logits, ref.prompt_logits.numpy(), atol=1e-4, rtol=0)


def test_tensorrt_profile_only_for_the_prefill(exported):
    """Without TensorRT: the engine builder gives the reading graphs' capacity axis a profile from the smallest
    bucket to the capacity, and the compactions none (their shapes are fixed)."""
    from kvexport.tensorrt.engine import capacity_range, column_range

    _, out = exported("gqa-int8")
    assert capacity_range(out / "prefill.onnx") == (256, BUDGET + WINDOW)
    for graph in ("prefill_last", "decode", "decode_batch"):
        assert capacity_range(out / f"{graph}.onnx") == (256, BUDGET + WINDOW)
    assert column_range(out / "prefill_last.onnx") == (2, CHUNK)  # the ragged last chunk (rule 2b)
    assert column_range(out / "prefill.onnx") is None and column_range(out / "decode.onnx") is None
    for graph in ("compact_prefill", "compact_prefill_tail", "compact"):
        assert capacity_range(out / f"{graph}.onnx") is None


def test_tensorrt_profile_spans_the_columns_and_the_buckets(exported):
    """Without TensorRT: the optimization profile of the last-chunk graph (recorded by stand-ins) gives its ids and
    positions 2 to CHUNK columns and its cache 256 slots to the capacity; a dynamic axis anywhere else is refused."""
    from kvexport.errors import BadArtifact
    from kvexport.tensorrt.engine import capacity_profile
    from tests.tensorrt.profile_stand_ins import Builder, Config

    _, out = exported("gqa-int8")

    config, cap = Config(), BUDGET + WINDOW
    capacity_profile(Builder(), config, out / "prefill_last.onnx",
                     {"input_ids": (1, -1), "positions": (1, -1), "k_0": (1, 2, -1, 16)})
    got = config.profiles[0].shapes
    assert got["input_ids"] == got["positions"] == ((1, 2), (1, CHUNK), (1, CHUNK))
    assert got["k_0"] == ((1, 2, 256, 16), (1, 2, cap, 16), (1, 2, cap, 16))
    with pytest.raises(BadArtifact, match="dynamic shape"):  # prefill.onnx takes C + L columns, fixed
        capacity_profile(Builder(), Config(), out / "prefill.onnx", {"input_ids": (1, -1)})
    with pytest.raises(BadArtifact, match="dynamic shape"):
        capacity_profile(Builder(), Config(), out / "prefill_last.onnx", {"k_0": (-1, 2, 16, 16)})
