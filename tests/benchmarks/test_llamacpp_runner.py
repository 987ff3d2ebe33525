# SPDX-License-Identifier: Apache-2.0
"""The llama.cpp row (benchmarks/llamacpp_runner.py in its side venv) against transformers on the real model.

The runner runs SmolLM2-135M-Instruct's GGUF (Q4_1) as shipped; transformers runs kvexport's fp32 dequantization of
the same file (the same weights), so the two differ only by llama.cpp's arithmetic: 8-bit activations in its
quantized matmuls and an fp16 K/V cache. Checked: the greedy answer to a chat prompt, the prompt's logits, and that
the timed cells (the protocol :mod:`benchmarks.runner` reads) decode what the check path decodes. No timing is
asserted. Skips without the llama.cpp venv (``python -m benchmarks.side_venv llamacpp``, ~10 min of compiling) or
the model (``kvexport get smollm2``).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from benchmarks import runner
from benchmarks.proc import prompt_ids
from benchmarks.side_venv import LLAMACPP

PY = LLAMACPP.python()
pytestmark = pytest.mark.skipif(PY is None, reason=f"no llama.cpp venv at {LLAMACPP.root} "
                                "(python -m benchmarks.side_venv llamacpp)")
RUNNER = str(runner.REPO / "benchmarks" / "llamacpp_runner.py")
NEW = 12


@pytest.fixture(scope="module")
def model():
    from kvexport.models import fetch

    gguf = fetch.cached("smollm2")
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not cached (kvexport get smollm2)")
    return gguf, fetch.hf_dir("smollm2")


def llamacpp_check(gguf, ids: list[int], tmp_path) -> tuple[list[int], np.ndarray]:
    npy = tmp_path / "logits.npy"
    spec = {"gguf": str(gguf), "ids": ids, "new": NEW, "threads": 1, "logits_npy": str(npy)}
    out = subprocess.run([str(PY), RUNNER, "--check", json.dumps(spec)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens"], np.load(npy)


def hf_greedy(hf_dir, ids: list[int]) -> tuple[list[int], np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = m(x).logits[0].numpy()
        gen = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False)
    return gen[0, len(ids):].tolist(), logits


def test_greedy_and_logits_match_transformers(model, tmp_path):
    """Greedy continuations of two plain prompts agree with transformers' for the first tokens; the logits of every
    position of a chat prompt agree in ranking. (The chat answer's first token is a near tie in fp32, "The" 25.33
    against "L" 25.24, which llama.cpp's arithmetic flips: greedy chat answers are not compared.)"""
    from transformers import AutoTokenizer

    gguf, hf_dir = model
    tok = AutoTokenizer.from_pretrained(hf_dir)
    for text, must in (("The capital of France is", "Paris"), ("Water boils at a temperature of", "°C")):
        ids = tok(text)["input_ids"]
        lc_toks, _ = llamacpp_check(gguf, ids, tmp_path)
        hf_toks, _ = hf_greedy(hf_dir, ids)
        agree = next((i for i, (a, b) in enumerate(zip(lc_toks, hf_toks, strict=True)) if a != b), NEW)
        print(f"{text!r}: llama.cpp {tok.decode(lc_toks)!r}, transformers {tok.decode(hf_toks)!r}, first {agree} agree")
        assert must in tok.decode(lc_toks) and agree >= 4, (lc_toks, hf_toks)

    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    _, lc_logits = llamacpp_check(gguf, list(chat), tmp_path)
    _, hf_logits = hf_greedy(hf_dir, list(chat))
    assert lc_logits.shape == hf_logits.shape
    diff = np.abs(lc_logits - hf_logits)
    top1 = (lc_logits.argmax(-1) == hf_logits.argmax(-1)).mean()
    corr = np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(lc_logits, hf_logits, strict=True)])
    print(f"chat prompt, {len(chat)} positions: |logit diff| max {diff.max():.2f} mean {diff.mean():.3f} (logit std "
          f"{hf_logits.std():.2f}); top-1 agreement {top1:.3f}; mean per-position correlation {corr:.4f}")
    assert top1 >= 0.9 and corr > 0.99 and diff.mean() < 0.2 * hf_logits.std()


def test_timed_cells_protocol(model, tmp_path):
    """The timed path through benchmarks.runner: one record per context, 4 steps each, the fp16 cache of n_ctx
    cells, and the same greedy tokens as the check path on the benchmark's prompt."""
    gguf, _ = model
    spec = {"gguf": str(gguf), "vocab": 49152, "steps": 4, "threads": 1, "cells": [[32, 32], [64, 64]]}
    recs = runner.run_row(runner.side_cmd("llamacpp", PY, spec), [32, 64], 4 * 2**30, 120.0)
    assert [r["status"] for r in recs] == ["ok", "ok"], recs
    for (_, n), rec in zip(spec["cells"], recs, strict=True):
        r = runner.summarize(rec)["result"]
        assert len(r["decode_ms"]) == 4 and all(t > 0 for t in r["decode_ms"]) and r["prefill_s"] > 0
        assert r["n_ctx"] >= n + 5 and r["n_ctx"] % 256 == 0
        assert r["cache_bytes"] == 2 * 30 * 3 * 64 * r["n_ctx"] * 2  # K and V, 30 layers, 3 KV heads of 64, fp16
        ref, _ = llamacpp_check(gguf, prompt_ids(n, 49152)[0].tolist(), tmp_path)
        assert r["tokens"] == ref[:5]  # the prefill's token, then one per decode step
