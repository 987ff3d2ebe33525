# SPDX-License-Identifier: Apache-2.0
"""The scheduler over real slots is faithful to the cache rules: three sequences of different lengths, two slots,
the third admitted mid-way into a slot another sequence left. Each one's greedy tokens, and after every compaction
the positions its slot keeps, equal a solo run of the same prompt and tokens on ``kvexport generate``'s PyTorch path
(kvexport.generation.generate with the export's model and settings: no code shared with the slots but the cache
rules). Prefill chunks interleave with the other streams' decode steps. Driven tick by tick (``Engine.step``), so the order of events is the scheduler's own, not a race."""

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
    assert backend.host.batched is (decode == "batched") and backend.n_slots == 2
    assert not backend.host.inplace and "decode_inplace" not in backend.host.graphs.sessions
    seqs, ticks = run(backend, tokenizer)
    assert_equal_library_runs(seqs, solo)
    # the third sequence took the slot the second left, and was admitted while the first still decoded
    assert seqs[2].slot == seqs[1].slot
    first_c = next(t for t, evs in enumerate(ticks) if any(i == 2 for i, _ in evs))
    last_b = max(t for t, evs in enumerate(ticks) if any(i == 1 for i, _ in evs))
    assert last_b < first_c
    # its 3 prefill chunks ran one per tick, each beside a decode step of the first sequence
    for t in range(last_b + 1, first_c + 1):
        assert any(i == 0 for i, _ in ticks[t]), t
    assert first_c - last_b == 3


def assert_equal_library_runs(seqs: list[Sequence], solo) -> None:
    """Each sequence's tokens are the library path's greedy ones; forced with them, the library path compacts at the
    same steps and keeps the same positions as the slot did."""
    for s in seqs:
        free = solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens)  # greedy, nothing forced
        assert s.tokens == free.tokens[0].tolist()
        forced = solo.generate(np.array([s.prompt]), max_new_tokens=s.max_tokens, forced_tokens=np.array([s.tokens]),
                               track_kept=True)
        assert forced.compactions == len(s.compactions) > 0
        assert_same_kept(s.compactions, forced.compaction_steps, forced.kept_positions)


@pytest.mark.parametrize("decode", ["auto", "batched", "rows"])
def test_pytorch_backend_equals_library_generate(export_dir, tokenizer, solo, decode):
    """The PyTorch backend's slots (decoded in one batched forward, or one by one) give the library path's tokens,
    compactions and kept positions for every sequence."""
    from kvexport.serve.backends.torch_slots import TorchSlots

    backend = TorchSlots(export_dir, max_sequences=2, decode=decode)
    assert backend.batched == (decode != "rows")
    calls = []
    if backend.batched:  # count the batched steps: the run must have decoded its slots together
        host = backend.driver(0).host
        inner = host.decode_slots
        host.decode_slots = lambda drivers, *a: calls.append(len(drivers)) or inner(drivers, *a)
    seqs, _ = run(backend, tokenizer)
    assert_equal_library_runs(seqs, solo)
    if decode == "auto":
        assert calls and min(calls) == 2
    elif decode == "batched":
        assert 1 in calls and 2 in calls
    else:
        assert not calls


@pytest.mark.parametrize("decode", ["batched", "rows"], ids=["decode_batch", "slot-by-slot"])
def test_mla_slots_equal_solo_runs(mla_export_dir, tokenizer, decode):
    """An MLA cache (one latent tensor per layer, ``v_i`` empty) through the slots equals the library path's runs."""
    from tests.serve.conftest import LibraryRun

    solo = LibraryRun(mla_export_dir)
    assert solo.settings["graphs"]["layers"][0]["value_dim"] == 0
    backend = GraphSlots(mla_export_dir, max_sequences=2, decode=decode)
    seqs, _ = run(backend, tokenizer)
    assert_equal_library_runs(seqs, solo)


def test_tensorrt_host_logic_with_stand_in_engines(export_dir, tokenizer, solo, tmp_path):
    """The TensorRT flavour of the slots (TrtGenerator's engines as the host's backend) on stand-in engines that
    run the ONNX graphs, against the library path."""
    from tests.tensorrt.test_generator import OnnxAsEngine, fake_engines

    engines = fake_engines(export_dir, tmp_path / "engines")
    backend = GraphSlots(export_dir, "tensorrt", max_sequences=2, engines=engines, decode="batched",
                         runtime_kw={"runner_factory": OnnxAsEngine})
    assert backend.host.graphs.backend == "tensorrt" and backend.host.batched
    seqs, _ = run(backend, tokenizer)
    assert_equal_library_runs(seqs, solo)


def test_resident_bytes_equal_the_formula_and_stay_fixed(export_dir, tokenizer):
    from kvexport.cache.memory import CacheShape

    backend = GraphSlots(export_dir)
    got = backend.resident_bytes()
    shape = CacheShape.from_export(backend.settings, banked=True)
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
