# SPDX-License-Identifier: Apache-2.0
"""The scheduler over real slots is faithful to the cache rules: three sequences of different lengths, two slots,
the third admitted mid-way into a slot another sequence left. Each one's greedy tokens, and after every compaction
the positions its slot keeps, equal a solo run of the same prompt and tokens (OrtGenerator on the same export; the
PyTorch backend against kvexport.generation.generate). Prefill chunks interleave with the other streams' decode
steps. Driven tick by tick (``Engine.step``), so the order of events is the scheduler's own, not a race."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.serve.backends.graphs import GraphSlots
from kvexport.serve.engine import Engine, Sequence
from kvexport.serve.sampling import SamplingParams

#: (prompt length, tokens): 70 = 5 chunks of 16 with compactions in the prefill; 20 fits the budget (its first
#: compaction comes while decoding); 45 comes in
#: when the 20-token one is done, while the 70-token one still decodes
CASES = [(70, 40), (20, 24), (45, 25)]
GREEDY = SamplingParams(temperature=0.0)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 4000, n).tolist() for n, _ in CASES]


def run(backend, tokenizer) -> tuple[list[Sequence], list[list]]:
    """The three sequences through an engine with two slots; returns them and each tick's events."""
    eng = Engine(backend, tokenizer, track_kept=True)
    seqs = [Sequence(p, m, GREEDY) for p, (_, m) in zip(prompts(), CASES, strict=True)]
    for s in seqs:
        assert eng.submit(s)
    ticks = []
    while any(s.state != "done" for s in seqs):
        ticks.append([(seqs.index(s), ev) for s, ev in eng.step()])
        assert len(ticks) < 500
    assert all(s.finish == "length" and len(s.tokens) == m for s, (_, m) in zip(seqs, CASES, strict=True))
    return seqs, ticks


def assert_same_kept(got: list, want_steps: list[str], want_kept: list) -> None:
    assert [w for w, _ in got] == want_steps
    for (_, layers), ref in zip(got, want_kept, strict=True):
        for a, b in zip(layers, ref, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("decode", ["batched", "rows"], ids=["decode_batch", "slot-by-slot"])
def test_slots_equal_solo_runs(export_dir, tokenizer, solo, decode):
    backend = GraphSlots(export_dir, max_sequences=2, decode=decode)
    assert backend.rt.batched is (decode == "batched") and backend.n_slots == 2
    assert solo.inplace and not backend.rt.inplace and "decode_inplace" not in backend.rt.sessions
    seqs, ticks = run(backend, tokenizer)
    for s in seqs:
        free = solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens)  # greedy, nothing forced
        assert s.tokens == free.tokens[0].tolist()
        forced = solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens, forced_tokens=np.array([s.tokens]),
                               track_kept=True)
        assert forced.compactions == len(s.compactions) > 0
        assert_same_kept(s.compactions, forced.compaction_steps, forced.kept_positions)
    # the third sequence took the slot the second left, and was admitted while the first still decoded
    assert seqs[2].slot == seqs[1].slot
    first_c = next(t for t, evs in enumerate(ticks) if any(i == 2 for i, _ in evs))
    last_b = max(t for t, evs in enumerate(ticks) if any(i == 1 for i, _ in evs))
    assert last_b < first_c
    # its 3 prefill chunks ran one per tick, each beside a decode step of the first sequence
    for t in range(last_b + 1, first_c + 1):
        assert any(i == 0 for i, _ in ticks[t]), t
    assert first_c - last_b == 3


@pytest.mark.parametrize("decode", ["batched", "rows"], ids=["one-forward", "slot-by-slot"])
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_pytorch_backend_equals_library_generate(export_dir, mla_export_dir, tokenizer, decode, mla, monkeypatch):
    """The PyTorch slots, decoded in one batched forward (kvexport.serve.backends.torch_slots.decode_rows: the rows
    at different fills, compacting at different steps) or slot by slot, equal batch-1 generate on each prompt."""
    import torch

    import kvexport.serve.backends.torch_slots as ts
    from kvexport.export.exporter import press_from_dict
    from kvexport.generation import generate

    backend = ts.TorchSlots(mla_export_dir if mla else export_dir, max_sequences=2, decode=decode)
    assert backend.batched is (decode == "batched")
    rows = []  # the rows of each batched forward
    real = ts.decode_rows
    monkeypatch.setattr(ts, "decode_rows", lambda dec, caches, *a: rows.append(len(caches)) or real(dec, caches, *a))
    seqs, _ = run(backend, tokenizer)
    assert set(rows) == ({2} if decode == "batched" else set())
    s = backend.settings
    for q in seqs:
        ids = torch.tensor([q.prompt])
        free = generate(backend.decoder, ids, press=press_from_dict(s["press"]), window=s["window"], chunk=s["chunk"],
                        max_new_tokens=q.max_tokens)
        assert q.tokens == free.tokens[0].tolist()
        forced = generate(backend.decoder, ids, press=press_from_dict(s["press"]), window=s["window"],
                          chunk=s["chunk"], max_new_tokens=q.max_tokens, forced_tokens=np.array([q.tokens]),
                          track_kept=True)
        assert forced.compactions == len(q.compactions) > 0
        assert_same_kept(q.compactions, forced.compaction_steps, forced.kept_positions)


@pytest.mark.parametrize("decode", ["batched", "rows"], ids=["decode_batch", "slot-by-slot"])
def test_mla_slots_equal_solo_runs(mla_export_dir, tokenizer, decode):
    """An MLA cache (one latent tensor per layer, ``v_i`` empty) through the slots equals its solo runs."""
    from kvexport.export.runtime import OrtGenerator

    solo = OrtGenerator(mla_export_dir)
    assert solo.settings["graphs"]["layers"][0]["value_dim"] == 0
    backend = GraphSlots(mla_export_dir, max_sequences=2, decode=decode)
    seqs, _ = run(backend, tokenizer)
    for s in seqs:
        assert s.tokens == solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens).tokens[0].tolist()
        forced = solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens, forced_tokens=np.array([s.tokens]),
                               track_kept=True)
        assert_same_kept(s.compactions, forced.compaction_steps, forced.kept_positions)


def test_tensorrt_host_logic_with_stand_in_engines(export_dir, tokenizer, solo, tmp_path):
    """The TensorRT flavour of the slots (TrtGenerator's hooks) on stand-in engines that run the ONNX graphs."""
    from tests.tensorrt.test_generator import OnnxAsEngine, fake_engines

    engines = fake_engines(export_dir, tmp_path / "engines")
    backend = GraphSlots(export_dir, "tensorrt", max_sequences=2, engines=engines, decode="batched",
                         runtime_kw={"runner_factory": OnnxAsEngine})
    assert backend.rt.backend == "tensorrt" and backend.rt.batched
    seqs, _ = run(backend, tokenizer)
    for s in seqs:
        assert s.tokens == solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens).tokens[0].tolist()


def test_resident_bytes_equal_the_formula_and_stay_fixed(export_dir, tokenizer):
    from kvexport.profile.kv_bytes import CacheShape

    backend = GraphSlots(export_dir)
    got = backend.resident_bytes()
    shape = CacheShape.from_export(backend.settings)
    rows = got["slots"]
    assert rows == backend.settings["decode_batch"] == backend.n_slots
    want = shape.resident_bytes_at(100, batch=rows)
    for kind in ("kv", "positions", "queries", "query_positions"):
        assert got["per_slot"][kind] * rows == want[kind], kind
    assert got["per_slot"] == {**{k: want[k] // rows for k in ("kv", "positions", "queries", "query_positions")},
                               "total": got["per_slot"]["total"]}
    assert got["shared"]["step_outputs"] == want["step_outputs"] and got["shared"]["logits"] == want["logits"]
    assert got["shared"]["staging"] == shape.step_bytes(1, int(backend.settings["chunk"]))  # one chunk, batch 1
    assert got["total"] == want["total"] + got["shared"]["staging"]
    run(backend, tokenizer)
    assert backend.resident_bytes() == got


def test_cancel_frees_the_slot_and_a_queued_sequence_takes_it(export_dir, tokenizer):
    backend = GraphSlots(export_dir, max_sequences=1)
    eng = Engine(backend, tokenizer)
    a, b = Sequence([5, 6, 7], 100, GREEDY), Sequence([8, 9], 3, GREEDY)
    eng.submit(a)
    eng.submit(b)
    for _ in range(4):
        eng.step()
    assert a.state == "decode" and b.state == "queued" and eng.counts()["queued_sequences"] == 1
    eng.cancel(a)
    events = eng.step()
    assert (a, a.finish) in [(s, ev.finish) for s, ev in events] and a.finish == "cancelled"
    assert b.slot == 0 and b.state in ("prefill", "decode")
    while b.state != "done":
        eng.step()
    assert b.finish == "length" and eng.counts()["active_sequences"] == 0
