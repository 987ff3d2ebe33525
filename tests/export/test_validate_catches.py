# SPDX-License-Identifier: Apache-2.0
"""validate fails a runtime with a planted bug, and passes the real one on the same export.

The bugs are the ones a host loop can have: padding a short last chunk at its end (the press then observes
padding and evicts the prompt's tail: what earlier versions did and their validation missed), and writing a
decode token one slot off. The reference is the library's generate on unpadded prompts, so neither can hide.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.cache.plan import DecodeStep
from kvexport.errors import ParityFailure
from kvexport.export import OrtGenerator, export_model, validate
from kvexport.presses import make_press
from kvexport.runtime import Stream

PROMPTS = [21, 45]  # chunk 8: last chunks of 5 real columns


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("v") / "x"
    hf = tiny_models("llama")
    return export_model(hf, out, press=make_press("snapkv", budget=12, window_size=4), window=4, chunk=8), hf


class EndPadded(OrtGenerator):
    """The last chunk's padding placed after its real columns, and the compaction told there is none."""

    def _prefill_chunk(self, rows, ids, pos, chunk, tail=None):  # this export has no lookahead: tail is None
        pad, n = chunk.pad, chunk.n_real
        ids = np.concatenate([ids[:, pad:], ids[:, :pad]], 1)  # the host's front padding moved to the end
        pos = np.concatenate([pos[:, pad:], pos[:, :pad]], 1)
        step = rows.state.prefill(n)
        new = self.graphs.call("prefill", {"input_ids": ids, "positions": pos}, self._inputs(rows, "prefill"),
                               {**rows.staging, "logits": rows.logits})
        if step.any_compaction:
            kept = self.graphs.call("compact_prefill", {"fill": np.array(step.fills, np.int64),
                                                        "n_pad": np.zeros(1, np.int64), "positions": pos},
                                    self._inputs(rows, "compact_prefill", new), {})
            self._write_kept(rows, kept)
        else:
            for i, f in enumerate(step.fills):
                self._write_rows(rows, {k: v[:, :, :n] for k, v in new.items() if k != "logits"}, i, f, pos[:, :n])
        return self._logits(rows), step.any_compaction


class SlotOff(OrtGenerator):
    """Decode tokens written one slot past where the plan puts them (wrapping at a layer's capacity: a slot past it
    is not silent, the host's write raises IndexError)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        decode = self.state.decode
        caps = self.plan.capacities

        def off():
            s = decode()
            return DecodeStep(tuple((x + 1) % c for x, c in zip(s.slots, caps, strict=True)), s.query_slot,
                              s.compact, s.fills_after)

        self.state.decode = off


@pytest.mark.parametrize("bug", [EndPadded, SlotOff], ids=["end-padded chunk", "slot off by one"])
def test_validate_fails_a_planted_bug(exported, bug):
    out, hf = exported
    kw = dict(prompts=PROMPTS, steps=8, fidelity=False, write=False, model=hf)
    good = validate(out, **kw)["pairs"]["pytorch~onnxruntime"]
    assert good["passed"] and good["index_agreement"] == 1.0 and good["max_abs_logit_error"] <= 1e-4
    bad = validate(out, candidate=bug(out), **kw)["pairs"]["pytorch~onnxruntime"]
    assert not bad["passed"]
    assert bad["index_agreement"] < 1.0 or bad["max_abs_logit_error"] > 1e-2
    with pytest.raises(ParityFailure):
        validate(out, candidate=bug(out), raise_on_failure=True, **kw)


def test_end_padding_evicts_the_prompt_tail(exported):
    """What the planted bug does, measured: the last chunk's tokens are lost after the prefill."""
    ids = np.random.default_rng(0).integers(3, 128, (1, 21))
    tails = {}
    for cls in (OrtGenerator, EndPadded):
        g = cls(exported[0])
        Stream(g, ids).prefill()
        tails[cls.__name__] = [int((p[0] >= 16).sum()) for p in g.kept_positions()]  # positions 16..20: last chunk
    assert min(tails["OrtGenerator"]) >= 2 * 4  # SnapKV keeps its 4 observing tokens, per KV head and layer
    assert min(tails["EndPadded"]) < 2 * 4


def test_a_decode_slot_past_the_capacity_raises(exported):
    """The host writes a decode token's row by its slot index: a slot past a layer's capacity (a plan or host bug)
    raises instead of writing nothing."""
    out, _ = exported
    gen = OrtGenerator(out)
    decode = gen.state.decode

    def past():
        s = decode()
        return DecodeStep(tuple(gen.plan.capacities), s.query_slot, s.compact, s.fills_after)

    gen.state.decode = past
    with pytest.raises(IndexError):
        gen.generate(np.random.default_rng(1).integers(3, 128, (1, 9)), None, 2)
