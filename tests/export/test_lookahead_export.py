# SPDX-License-Identifier: Apache-2.0
"""Lookahead observation in the export (kvexport.cache.plan rule 3b): the prefill graph takes a chunk and the
prompt's last columns after it, ``compact_prefill_tail`` compacts a chunk its tail observes, and the host feeds the
tail the plan gives (a padded one for the prompt's last chunk). Checked against the PyTorch library path as a user
calls it (:func:`kvexport.generation.generate` with ``lookahead=``): the same kept positions at every compaction,
bit for bit, and the same tokens, for prompts shorter than a chunk, whose tail is shorter than the lookahead, whose
last chunk is partial, and of many chunks; with int8 storage and neighbours (the convert default's shape). And the
refusals: a press that does not observe, no press."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.errors import BadUsage
from kvexport.export import export_model
from kvexport.export.reference import load_reference_model
from kvexport.generation import generate as torch_generate
from kvexport.manifest import verify_manifest
from kvexport.paths import DEFAULT_MODEL
from kvexport.presses import make_press
from kvexport.runtime import OrtGenerator, generate

CHUNK, LOOKAHEAD, BUDGET, WINDOW = 32, 16, 96, 8


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("la") / "kvx-la"
    export_model(DEFAULT_MODEL, out, press=make_press("snapkv", budget=BUDGET, neighbors=2), window=WINDOW,
                 chunk=CHUNK, lookahead=LOOKAHEAD, kv_dtype="int8")
    return out


def test_graphs_and_manifest(export_dir):
    s = verify_manifest(export_dir)["settings"]
    assert s["lookahead"] == LOOKAHEAD and s["press"]["params"]["neighbors"] == 2
    g = s["graphs"]
    assert {"prefill", "compact_prefill", "compact_prefill_tail", "compact", "decode"} <= set(g)
    assert g["prefill"]["outputs"][-1] == f"q_tail_{s['num_layers'] - 1}"
    assert "tail_positions" in g["compact_prefill_tail"]["inputs"]


@pytest.mark.parametrize("n", [20, 40, 100, 150, 237, 300])
def test_kept_positions_equal_the_library_path(export_dir, n):
    manifest = verify_manifest(export_dir)
    dec = load_reference_model(manifest, None, root=export_dir)
    vocab = int(manifest["settings"]["vocab_size"])
    ids = np.random.default_rng(n).integers(3, vocab, size=(1, n))
    got = generate(OrtGenerator(export_dir), ids, None, 12, track_kept=True)
    # the library path as a user calls it, with the export's settings written out by hand
    ref = torch_generate(dec, torch.as_tensor(ids), None, press=make_press("snapkv", budget=BUDGET, neighbors=2),
                         window=WINDOW, chunk=CHUNK, lookahead=LOOKAHEAD, kv_dtype="int8", max_new_tokens=12,
                         forced_tokens=torch.as_tensor(got.tokens), track_kept=True)
    assert got.compactions == ref.compactions == len(got.kept_positions) == len(ref.kept_positions)
    if n > BUDGET:
        assert got.compactions >= 1
    for a, b in zip(got.kept_positions, ref.kept_positions, strict=True):
        for la, lb in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    assert np.asarray(ref.tokens).tolist() == got.tokens.tolist()


def test_the_tail_changes_what_is_kept(export_dir):
    """Not a no-op: on a prompt of several chunks the tail's observation keeps other tokens than the chunks' own."""
    manifest = verify_manifest(export_dir)
    dec = load_reference_model(manifest, None, root=export_dir)
    ids = torch.as_tensor(np.random.default_rng(1).integers(3, int(manifest["settings"]["vocab_size"]), (1, 300)))
    kw = dict(press=make_press("snapkv", budget=BUDGET, neighbors=2), window=WINDOW, chunk=CHUNK, kv_dtype="int8",
              max_new_tokens=1, track_kept=True)
    own, tail = torch_generate(dec, ids, None, **kw), torch_generate(dec, ids, None, lookahead=LOOKAHEAD, **kw)
    got = generate(OrtGenerator(export_dir), ids.numpy(), None, 1, track_kept=True)
    differ = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(own.kept_positions[-1],
                                                                               tail.kept_positions[-1], strict=True)]
    assert any(differ)
    for a, b in zip(got.kept_positions[-1], tail.kept_positions[-1], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("press, match", [("knorm", "needs a press that scores with observation queries"),
                                          (None, "needs a press that scores with observation queries")])
def test_refused_without_observation(tmp_path, press, match):
    with pytest.raises(BadUsage, match=match):
        export_model(DEFAULT_MODEL, tmp_path / "x", press=press, budget=96 if press else None, chunk=CHUNK,
                     lookahead=LOOKAHEAD)
    assert not (tmp_path / "x").exists()
