# SPDX-License-Identifier: Apache-2.0
"""Knorm on onnxruntime against the PyTorch library path, with a partial last prefill chunk and repeated tokens.

Knorm scores a candidate by its own post-RoPE key norm. RoPE preserves norms, and in layer 0 a token's key depends
on the token alone, so every repeat of a token ties with the others in exact arithmetic; which one a runtime keeps
is decided by rounding. The two runtimes round differently (other kernels; onnxruntime computes every chunk at the
static width, a short last chunk padded at its front, PyTorch at the chunk's real width), so they may keep different
copies of the same token. The copy kept sits at another position, so every later
token attends to it at another distance: every deeper layer's keys then differ a little, and Knorm keeps other
tokens there too. So a free run of each ends with other kept tokens beyond layer 0, and every such difference
starts at a layer-0 tie between equal tokens. Validation follows the export's choice where the reference's own
scores tie (kvexport.export.ties) and then finds no other difference. The tests state both halves."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.export import export_model, validate
from kvexport.export.parity import tolerances
from kvexport.export.reference import load_reference_model, reference_generate
from kvexport.export.source import press_from_dict
from kvexport.manifest import verify_manifest
from kvexport.paths import MODELS_DIR
from kvexport.runtime import OrtGenerator

BUDGET, WINDOW, CHUNK, N, NEW = 48, 8, 32, 150, 40  # 150 = 4 x 32 + 22: the last chunk is partial


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_model(str(MODELS_DIR / "kvx-student"), tmp_path_factory.mktemp("knorm") / "x", press="knorm",
                        budget=BUDGET, window=WINDOW, chunk=CHUNK)


def _prompt() -> np.ndarray:
    """(1, N) ids drawn from 40 tokens: every token repeats a few times."""
    return np.random.default_rng(5).integers(3, 43, (1, N))


def test_free_runs_part_only_at_layer0_ties_of_equal_tokens(exported):
    ids = _prompt()
    ort = OrtGenerator(exported).generate(ids, None, NEW)
    manifest = verify_manifest(exported)
    s = manifest["settings"]
    ref = reference_generate(load_reference_model(manifest, root=exported), s, press_from_dict(s["press"]), ids,
                             np.ones_like(ids), NEW, forced=ort.tokens)
    assert ort.compaction_steps == ref.compaction_steps and len(ort.compaction_steps) > 3
    seq = np.concatenate([ids[0], ort.tokens[0]])
    first = None
    for c, (a, b) in enumerate(zip(ort.kept_positions, ref.kept_positions, strict=True)):
        for layer, (x, y) in enumerate(zip(a, b, strict=True)):
            for h in range(x.shape[1]):
                mine, theirs = set(x[0, h][x[0, h] >= 0].tolist()), set(y.numpy()[0, h][y.numpy()[0, h] >= 0].tolist())
                if mine != theirs and first is None:
                    first = (c, layer, sorted(mine - theirs), sorted(theirs - mine))
    if first is not None:  # where the two runs first keep other tokens: a layer-0 choice among copies of one token
        c, layer, ort_only, ref_only = first
        assert layer == 0, first
        assert {int(seq[p]) for p in ort_only} == {int(seq[p]) for p in ref_only}, first


def test_validate_follows_the_ties_and_finds_nothing_else(exported):
    pair = validate(exported, prompts=[_prompt()[0].tolist()], steps=NEW, fidelity=False,
                    write=False)["pairs"]["pytorch~onnxruntime"]
    assert pair["ties_followed"] >= 1  # the repeats did tie somewhere
    assert pair["index_agreement"] == 1.0 and pair["token_agreement"] == 1.0
    assert pair["max_abs_logit_error"] <= tolerances(verify_manifest(exported)["settings"])[0]
