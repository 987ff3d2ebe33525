# SPDX-License-Identifier: Apache-2.0
"""The compression sweep's measures (kvexport.eval.sweep) against transformers on the bundled student: a full fp32
cache is the original (agreement 1, KL 0, the perplexity transformers computes on the same window), and the
original's measures are kept in a reference cache that a fresh machine does not have yet."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvexport.eval.sweep import Setting, SweepSpec, run

STUDENT = Path(__file__).resolve().parents[2] / "models" / "kvx-student"
SPEC = dict(windows=1, context=192, scored=16, probe_lengths=(192,), probe_kinds=("passkey",), depths=(0.5,))


def test_full_cache_is_the_original_and_the_reference_cache_is_made(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvexport.eval.sweep import Sweep

    ref_cache = tmp_path / "not" / "yet"  # a directory that does not exist: the sweep makes it
    logs: list[str] = []
    rows = run(STUDENT, [Setting(chunk=64), Setting("snapkv", 96, window=8, chunk=64)], tmp_path / "s.jsonl",
               SweepSpec(**SPEC), log=logs.append, ref_cache=ref_cache)
    assert any("original measured" in m for m in logs)
    assert len(list(ref_cache.glob("reference-*.pt"))) == 1
    full, snap = rows
    assert full["setting"] == "full/c64" and snap["setting"] == "snapkv/b96/w8/c64"
    t = full["text"]
    assert t["agreement"] == 1.0 and abs(t["kl"]) < 1e-5 and abs(t["ppl_increase"]) < 1e-5

    # the original's perplexity on the scored tokens, by transformers over the same window
    sw = Sweep(STUDENT, SweepSpec(**SPEC), log=lambda m: None)
    win = sw.windows[0]
    hf = AutoModelForCausalLM.from_pretrained(STUDENT, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = hf(win[None]).logits[0].float().log_softmax(-1)
    C, T = SPEC["context"], SPEC["scored"]
    nll = -lp[C - 1 : C + T - 1].gather(-1, win[C : C + T, None]).mean().item()
    assert math.isclose(t["ppl_original"], math.exp(nll), rel_tol=1e-4), (t["ppl_original"], math.exp(nll))
    assert math.isclose(t["ppl"], math.exp(nll), rel_tol=1e-4)

    # a press past its budget holds fewer bytes than the full cache at the probe's length
    p = snap["probes"]["passkey@192"]
    assert p["slots"] < p["full_slots"] and sum(p["resident_bytes"].values()) < sum(p["full_bytes"].values())

    # a second run reads the kept reference instead of measuring the original again, and skips the rows done
    logs.clear()
    again = run(STUDENT, [Setting(chunk=64), Setting("knorm", 96, window=8, chunk=64)], tmp_path / "s.jsonl",
                SweepSpec(**SPEC), log=logs.append, ref_cache=ref_cache)
    assert not any("original measured" in m for m in logs) and len(again) == 3
    assert sum("[1/1]" in m for m in logs) == 1
