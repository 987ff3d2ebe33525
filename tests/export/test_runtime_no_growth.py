# SPDX-License-Identifier: Apache-2.0
"""OrtGenerator holds the same memory however many prompts it is fed (issue 20): a prefill's staging buffers (the
chunk's new rows) and their OrtValues leave with the prompt. They used to stay in the generator's OrtValue table,
one set per prompt (measured 2026-12-02 on the 385M Qwen3 MLA export: +130 MB of anonymous memory per prompt,
1.1 GB over validate's parity and fidelity prompts)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kvexport.export import export_model
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model
from kvexport.runtime import OrtGenerator


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    dec = Decoder.from_hf(tiny_model("llama", vocab_size=512, hidden_size=128, intermediate_size=256, heads=4,
                                     kv_heads=2))
    return export_model(dec, tmp_path_factory.mktemp("growth") / "x", press="snapkv", budget=80, window=8, chunk=32,
                        max_positions=512)


def test_prompts_leave_nothing_behind(export_dir):
    g = OrtGenerator(export_dir, threads=1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, size=(1, 150))  # five chunks, compactions at prefill
    g.generate(prompt, np.ones_like(prompt), 4)
    n_values = len(g.graphs._ovs)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(6):
        g.generate(prompt, np.ones_like(prompt), 4)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(g.graphs._ovs) == n_values
    # one prompt's staging rows (per layer: k, v and the press's queries for a 32-column chunk), for scale
    per_prompt = sum(int(np.prod((*shape[:2], 32, *shape[3:]))) * np.dtype(dt).itemsize
                     for n, (shape, dt) in g.step_shapes.items() if n in g.settings["graphs"]["prefill"]["outputs"])
    assert per_prompt > 0
    assert grown < per_prompt, (grown, per_prompt)
