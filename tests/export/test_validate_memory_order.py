# SPDX-License-Identifier: Apache-2.0
"""validate holds one model at a time: the export's onnxruntime sessions, the PyTorch reference and the original
model are never resident together (issue 20: on a 1B-8B model each is several GB).

The property is checked where it matters: at the moment validate loads the PyTorch reference, and at the moment
the fidelity check loads the original model, no OrtGenerator of the export still has open sessions (or weight
maps), and no kvexport Decoder is alive when the original is loaded. The results are the ones the old interleaved
order gave: parity passes, and the fidelity numbers equal those of :func:`measure_fidelity` run with the
sessions kept open.
"""

from __future__ import annotations

import gc

import pytest

from kvexport.export import OrtGenerator, export_model, validate
from kvexport.export import fidelity as fidelity_mod
from kvexport.export import validation as validation_mod
from kvexport.export.fidelity import FidelitySettings, measure_fidelity
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model
from kvexport.presses import make_press

FS = FidelitySettings(sequences=2, scored=8, prefix=40, recall=0)


def _open_generators() -> list:
    return [o for o in gc.get_objects() if issubclass(type(o), OrtGenerator) and (o.sessions or o._maps)]


def _live_decoders() -> list:
    return [o for o in gc.get_objects() if issubclass(type(o), Decoder)]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    src = root / "hf"
    tiny_model("qwen3", head_dim=32, vocab_size=512, max_positions=256).save_pretrained(src)
    return export_model(str(src), root / "x", press=make_press("snapkv", budget=16, window_size=4), window=4,
                        chunk=8)


def test_one_model_at_a_time(export_dir, monkeypatch):
    gc.collect()
    # decoders another test of this worker still holds (a module-scoped fixture) are not this validate run's
    before = {id(d) for d in _live_decoders()}
    seen: dict = {}
    load_ref, load_hf = validation_mod.load_reference_model, fidelity_mod.FidelityRun.original

    def watched_ref(*a, **kw):
        gc.collect()
        seen["sessions at reference load"] = len(_open_generators())
        return load_ref(*a, **kw)

    def watched_original(self):
        gc.collect()
        seen["sessions at original load"] = len(_open_generators())
        seen["decoders at original load"] = len([d for d in _live_decoders() if id(d) not in before])
        return load_hf(self)

    def watched_init(self, *a, **kw):
        gc.collect()
        seen["decoders at session open"] = len([d for d in _live_decoders() if id(d) not in before])
        return init(self, *a, **kw)

    init = OrtGenerator.__init__
    monkeypatch.setattr(OrtGenerator, "__init__", watched_init)
    monkeypatch.setattr(validation_mod, "load_reference_model", watched_ref)
    monkeypatch.setattr(fidelity_mod.FidelityRun, "original", watched_original)
    rep = validate(export_dir, prompts=[5, 21, 37], steps=6, write=False, fidelity=True, fidelity_settings=FS)
    assert seen == {"decoders at session open": 0, "sessions at reference load": 0, "sessions at original load": 0, "decoders at original load": 0}
    assert all(p["passed"] for p in rep["pairs"].values()), rep["pairs"]
    # the split fidelity check scores what the one-call form scores with the sessions open the whole time
    monkeypatch.undo()
    gen = OrtGenerator(export_dir)
    try:
        whole = measure_fidelity(export_dir, gen, None, settings=FS)
    finally:
        gen.close()
    for k in ("next_token_agreement", "mean_kl", "ppl_original", "ppl_converted", "scored_tokens"):
        assert rep["fidelity"][k] == pytest.approx(whole[k], rel=1e-9, abs=1e-12), k
    assert 0.0 <= rep["fidelity"]["next_token_agreement"] <= 1.0 and rep["fidelity"]["mean_kl"] >= 0.0
