# SPDX-License-Identifier: Apache-2.0
"""What validate keeps while the next model runs (issue 20): the candidate's logits wait on disk, not in memory
(prompts x steps x vocabulary floats: 60 MB on a 32k vocabulary, 0.23 GB on Llama-3's 128k, beside the reference
model), and the original model computes only the scored positions' logits (the whole window's were a transient
of 1.1 GB on a 128k vocabulary at 2k tokens). Checked against transformers' own full forward pass and against the
arrays as they were produced."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvexport.export import OrtGenerator, export_model
from kvexport.export.fidelity import FidelityRun, FidelitySettings
from kvexport.export.spill import SpilledArrays, StoredRuns
from kvexport.models.tiny import tiny_model
from kvexport.presses import make_press
from kvexport.runtime import GenerationResult as OrtGenerationResult

FS = FidelitySettings(sequences=3, scored=7, prefix=30, recall=0)


def test_stored_runs_give_back_what_was_stored():
    rng = np.random.default_rng(0)
    runs = StoredRuns()
    stored = {}
    for k in range(3):
        res = OrtGenerationResult(tokens=rng.integers(0, 9, (2, 5)), prompt_logits=rng.standard_normal((2, 11)).astype(np.float32),
                                  step_logits=[rng.standard_normal((2, 11)).astype(np.float32) for _ in range(4)])
        runs[k.to_bytes(1, "little")] = res
        stored[k] = res
    root = Path(runs._logits._dir.name)
    assert len(list(root.glob("*.npy"))) == 3  # on disk
    for k, res in stored.items():
        got = runs.get(k.to_bytes(1, "little"))
        np.testing.assert_array_equal(got.tokens, res.tokens)
        np.testing.assert_array_equal(got.prompt_logits, res.prompt_logits)
        assert len(got.step_logits) == 4
        for a, b in zip(got.step_logits, res.step_logits, strict=True):
            np.testing.assert_array_equal(a, b)
        assert runs._runs[k.to_bytes(1, "little")][0].step_logits == []  # memory keeps no logits
    assert runs.get(b"missing") is None
    runs.close()
    assert not root.exists()


def test_spilled_arrays_leave_nothing_when_collected():
    s = SpilledArrays()
    s.append(np.arange(6.0).reshape(2, 3))
    root = Path(s._dir.name)
    np.testing.assert_array_equal(list(s)[0], np.arange(6.0).reshape(2, 3))
    del s
    gc.collect()
    assert not root.exists()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("spill")
    src = root / "hf"
    tiny_model("llama", vocab_size=384, max_positions=256).save_pretrained(src)
    return src, export_model(str(src), root / "x", press=make_press("snapkv", budget=16, window_size=4),
                             window=4, chunk=8)


def test_fidelity_original_logits_are_the_full_forward_pass(export_dir):
    src, out = export_dir
    gen = OrtGenerator(out)
    run = FidelityRun(out, gen.settings, None, original=src, fidelity=FS)
    run.candidate(gen)
    gen.close()
    assert isinstance(run.cand_logits, SpilledArrays) and len(run.cand_logits) == len(list(run._groups()))
    run.original()
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    P, T = FS.prefix, FS.scored
    for (_, real, group), got in zip(run._groups(), run.orig_logits, strict=True):
        with torch.no_grad():
            want = hf(torch.from_numpy(group[:real, : P + T])).logits[:, P - 1 : P + T - 1].numpy()
        assert got.shape == want.shape == (real, T, 384)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    rep = run.report()
    assert rep["scored_tokens"] == FS.sequences * T and 0.0 <= rep["next_token_agreement"] <= 1.0
