# SPDX-License-Identifier: Apache-2.0
"""Long decode through onnxruntime, checked at every step: ``python -m tests.hardening.soak_driver DIR STEPS``.

Drives an export directory (:class:`kvexport.runtime.OrtGenerator`) through a :class:`kvexport.runtime.Stream`
(``prefill``, ``decode``, the driver's ``kept_positions``, the ``on_compaction`` callback) and keeps nothing per step, so the process's
memory can be compared before and after. Prints one JSON line: steps, compactions, the RSS after warm-up and
at the end, and the first violation found (None when every check held).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import psutil


def check_kept(gen, budgets: list[int], n: int, next_pos: int) -> str | None:
    """The invariants after compaction ``n``: exactly budget slots per head, in [0, budget), increasing, past."""
    for i, p in enumerate(gen.kept_positions()):  # (B, Hc, cap)
        kept = p[..., : budgets[i]]
        if (p >= 0).sum(-1).min() != budgets[i] or (p >= 0).sum(-1).max() != budgets[i]:
            return f"compaction {n} layer {i}: kept {(p >= 0).sum(-1).tolist()} != {budgets[i]}"
        if (kept < 0).any():
            return f"compaction {n} layer {i}: kept slots are not [0, budget)"
        if (np.diff(kept, axis=-1) <= 0).any():
            return f"compaction {n} layer {i}: positions not strictly increasing {kept.tolist()}"
        if kept.max() > next_pos:
            return f"compaction {n} layer {i}: kept position {kept.max()} from the future"
    return None


def soak(path: str, steps: int, warmup: int | None = None, prompt_len: int = 21) -> dict:
    from kvexport.runtime import OrtGenerator, Stream

    gen = OrtGenerator(path, providers=["CPUExecutionProvider"], threads=1)
    assert gen.press is not None, "the soak needs a static export with a press"
    B = gen.batch
    ids = np.random.default_rng(0).integers(3, int(gen.settings["vocab_size"]), (B, prompt_len))
    problems: list[str] = []
    state = {"next_pos": prompt_len}

    stream = Stream(gen, ids)
    logits = stream.prefill()

    def on_compaction(where):
        if not problems:
            p = check_kept(gen, list(gen.plan.budgets), stream.compactions, state["next_pos"])
            if p:
                problems.append(p)

    stream.on_compaction = on_compaction
    proc = psutil.Process()
    warmup = steps // 10 if warmup is None else warmup
    rss_warm = None
    compactions_after_prefill = stream.compactions
    for step in range(steps):
        if not np.isfinite(logits).all():
            problems.append(f"non-finite logits at step {step}")
            break
        logits = stream.decode(logits.argmax(-1))
        if problems:
            break
        state["next_pos"] += 1
        if step + 1 == warmup:
            rss_warm = proc.memory_info().rss
    return {"steps": step + 1, "compactions": stream.compactions - compactions_after_prefill, "rss_warm": rss_warm,
            "rss_end": proc.memory_info().rss, "last_position": state["next_pos"] - 1,
            "problem": problems[0] if problems else None}


if __name__ == "__main__":
    print(json.dumps(soak(sys.argv[1], int(sys.argv[2]))))
