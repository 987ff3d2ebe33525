# SPDX-License-Identifier: Apache-2.0
"""The growing-past baseline on CPU writes each step's present into the runner's own double buffer (issue 20):
two buffers per cache tensor, reused every step, sized for the sequence's reserved length or grown by doubling.
Left to onnxruntime, every step's outputs came from its arena, which grew around tensors one row longer each step
(385M model, 2048 tokens: 1.7 GB anonymous for 0.47 GB of K/V). Tokens and logits are checked against kvexport's
PyTorch library path, with and without a reserved length (the buffers then grow during decoding)."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.cache.memory import CacheShape
from kvexport.export import export_model, open_onnxruntime
from kvexport.export.reference import reference_generate
from kvexport.models.decoder import Decoder
from kvexport.runtime import Stream

PROMPT, NEW = 37, 24


@pytest.fixture(scope="module")
def growing(tiny_models, tmp_path_factory):
    hf = tiny_models("qwen3", head_dim=32)
    out = export_model(hf, tmp_path_factory.mktemp("grow") / "x", dynamic_cache=True, chunk=16)
    return hf, out


def _steps(gen, ids, new_tokens):
    """prefill + NEW - 1 decode steps by hand; -> (tokens, logits per step, data pointers of past_k_0)."""
    stream = Stream(gen, ids, np.ones_like(ids), new_tokens=new_tokens)
    last = stream.prefill()
    toks, logits, ptrs = [int(last.argmax(-1)[0])], [last], []
    for _ in range(NEW - 1):
        last = stream.decode(np.array([toks[-1]], np.int64))
        toks.append(int(last.argmax(-1)[0]))
        logits.append(last)
        ptrs.append(gen._past["past_k_0"].__array_interface__["data"][0])
    return np.array(toks), np.concatenate(logits), ptrs


def test_double_buffer_reused_and_equal_to_pytorch(growing):
    hf, out = growing
    gen = open_onnxruntime(out, threads=1)
    ids = np.random.default_rng(3).integers(3, 128, (1, PROMPT))
    s = gen.settings
    ref = reference_generate(Decoder.from_hf(hf), s, None, ids, np.ones_like(ids), NEW)
    want = ref.tokens.numpy()[0]
    toks, logits, ptrs = _steps(gen, ids, new_tokens=NEW)
    np.testing.assert_array_equal(toks, want)
    assert len(set(ptrs)) == 2 and ptrs[0::2] == [ptrs[0]] * len(ptrs[0::2])  # two buffers, alternating
    # held: the past's buffer and the spare, each the reserved length (the formula's double buffer)
    shape = CacheShape.from_export(s)
    assert gen.resident_bytes() == shape.resident_bytes_at(PROMPT + NEW - 1, double_buffer=True)
    # no reserve (a fresh runner): the buffers start at the prompt and double when a step does not fit
    fresh = open_onnxruntime(out, threads=1)
    toks2, logits2, ptrs2 = _steps(fresh, ids, new_tokens=None)
    np.testing.assert_array_equal(toks2, want)
    np.testing.assert_allclose(logits2, logits, atol=1e-5, rtol=0)
    # the prompt's buffers (37 rows) doubled once each at the first steps (74 rows hold the 60), then reused
    assert len(set(ptrs2)) == 2 and ptrs2[0::2] == [ptrs2[0]] * len(ptrs2[0::2])
    held = fresh.resident_bytes()
    assert held["kv"] == held["step_outputs"] == shape.bytes_at(2 * PROMPT)
    # a shorter sequence with its length known does not keep the longer one's buffers
    gen.generate(ids[:, :10], max_new_tokens=4)
    assert gen.resident_bytes() == shape.resident_bytes_at(10 + 3, double_buffer=True)
