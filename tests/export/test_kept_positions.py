# SPDX-License-Identifier: Apache-2.0
"""Exported graphs keep what the PyTorch library keeps: for every exportable press x chunk in {1, 7, 64, 128} x
five prompt lengths (none a multiple of the chunk but one), on the trained student and on tiny models of all
four families. The reference is :func:`kvexport.generation.generate` on the *unpadded* prompt (the graphs see a
front-padded last chunk); both are fed the same tokens. Where the reference's own scores tie two candidates it
may follow onnxruntime's choice (kvexport.export.ties); every other kept set must be equal, and logits within
fp32 tolerance. CI runs a covering part of the product (:func:`_cases`), ``-m slow`` the rest.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.export.exporter import export_model
from kvexport.export.source import NOT_EXPORTABLE
from kvexport.export.ties import TieReferee
from kvexport.generation import generate
from kvexport.mla.io import load_decoder
from kvexport.models.decoder import Decoder
from kvexport.paths import MODELS_DIR
from kvexport.presses import PRESSES, make_press
from kvexport.runtime import OrtGenerator

BUDGET, WINDOW, STEPS = 12, 4, 9  # two decode compactions after the prefill
KW = {"snapkv": {"window_size": 4}, "pyramidkv": {"window_size": 4, "beta": 2},
      "expected_attention": {"n_future_positions": 16}}
EXPORTABLE = [p for p in PRESSES if p not in NOT_EXPORTABLE]
CHUNKS = [1, 7, 64, 128]
MODELS = {"student": None, "llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {"head_dim": 32}),
          "mistral": ("mistral", {})}


def _cases() -> list:
    """Every model x press x chunk. CI runs every press on the student at two chunks and on each tiny family at
    one, rotated so that the student meets every chunk four times and each family twice (48 exports); the rest
    of the product (112 more) is marked slow (``python -m pytest -m slow``)."""
    out = []
    for m_i, model in enumerate(MODELS):
        for p_i, press in enumerate(EXPORTABLE):
            for c_i, chunk in enumerate(CHUNKS):
                at = (m_i + p_i) % len(CHUNKS)
                ci = c_i == at or (model == "student" and c_i == (at + 2) % len(CHUNKS))
                out.append(pytest.param(model, press, chunk, marks=() if ci else pytest.mark.slow,
                                        id=f"{model}-{press}-{chunk}"))
    return out


def lengths(chunk: int) -> list[int]:
    if chunk == 1:
        return [1, 2, 3, 40, 389]
    return [1, chunk - 1, chunk + 1, 389, 1000]


@pytest.fixture(scope="module")
def models(tiny_models):
    made = {}

    def get(name):
        if name not in made:
            if name == "student":
                dec, _ = load_decoder(MODELS_DIR / "kvx-student")
                made[name] = (str(MODELS_DIR / "kvx-student"), dec, 4096)
            else:
                family, kw = MODELS[name]
                hf = tiny_models(family, **kw)
                made[name] = (hf, Decoder.from_hf(hf), 128)
        return made[name]

    return get


def kept_sets(snapshot: list) -> list:
    out = []
    for layer in snapshot:
        a = layer.numpy() if hasattr(layer, "numpy") else np.asarray(layer)
        out.append([[sorted(int(p) for p in a[b, h] if p >= 0) for h in range(a.shape[1])] for b in range(a.shape[0])])
    return out


@pytest.mark.parametrize(("model", "press", "chunk"), _cases())
def test_exported_kept_positions_equal_library_generate(models, tmp_path, model, press, chunk):
    src, dec, vocab = models(model)
    out = export_model(src, tmp_path / "x", press=make_press(press, budget=BUDGET, **KW.get(press, {})), window=WINDOW,
                       chunk=chunk)
    gen = OrtGenerator(out)
    for n in lengths(chunk):
        ids = np.random.default_rng(n).integers(3, vocab, size=(1, n))
        got = gen.generate(ids, max_new_tokens=STEPS, keep_logits=True)
        referee = TieReferee(dict(zip(got.compaction_steps, got.kept_positions, strict=True)), 1e-5)
        ref = generate(dec, torch.from_numpy(ids), press=make_press(press, budget=BUDGET, **KW.get(press, {})),
                       window=WINDOW, chunk=chunk, max_new_tokens=STEPS, forced_tokens=got.tokens, keep_logits=True,
                       track_kept=True, tie_break=referee)
        where = f"{model}/{press}/chunk {chunk}/{n} tokens"
        assert ref.compaction_steps == got.compaction_steps, where
        assert ref.compactions >= (1 if n > BUDGET * 2 else 0), where
        for step, a, b in zip(got.compaction_steps, ref.kept_positions, got.kept_positions, strict=True):
            assert kept_sets(a) == kept_sets(b), f"{where}: kept positions differ at {step}"
        assert referee.refused == 0, where
        ref_logits = np.stack([ref.prompt_logits.numpy()] + [x.numpy() for x in ref.step_logits])
        got_logits = np.stack([got.prompt_logits] + got.step_logits)
        np.testing.assert_allclose(got_logits, ref_logits, atol=1e-4, rtol=1e-4, err_msg=where)
