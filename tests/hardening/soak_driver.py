# SPDX-License-Identifier: Apache-2.0
"""Long decode through onnxruntime, checked at every step: ``python -m tests.hardening.soak_driver DIR STEPS``.

Drives an export directory's graphs like :class:`kvexport.export.runtime.OrtGenerator` does (same buffers,
same host bookkeeping) but keeps nothing per step, so the process's memory can be compared before and after:
``OrtGenerator.generate`` returns every step's logits and has no streaming form, and its decode loop has no
hook per step, so this loop re-implements the host side with the generator's buffers (``_run``,
``_positions_now``). Prints one JSON line: steps, compactions, the RSS after warm-up and at the end, and
the first violation found (None when every check held).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import psutil


def soak(path: str, steps: int, warmup: int | None = None, prompt_len: int = 21) -> dict:
    from kvexport.export.runtime import OrtGenerator

    gen = OrtGenerator(path, providers=["CPUExecutionProvider"], threads=1)
    s = gen.settings
    assert gen.press is not None, "the soak needs a static export with a press"
    C, B, L = int(s["chunk"]), gen.batch, len(gen.layers)
    budgets, caps = gen.budgets, gen.caps
    ids = np.random.default_rng(0).integers(3, int(s["vocab_size"]), (B, prompt_len))
    pos = np.broadcast_to(np.arange(prompt_len), (B, prompt_len)).astype(np.int64)
    n = math.ceil(prompt_len / C)
    ids_p = np.concatenate([ids, np.zeros((B, n * C - prompt_len), np.int64)], 1)
    pos_p = np.concatenate([pos, np.full((B, n * C - prompt_len), -1, np.int64)], 1)
    gen.reset()
    fill = [0] * L
    for c in range(n):
        last_index = (prompt_len - 1 - c * C) if c == n - 1 else C - 1
        gen._run("prefill", {"input_ids": ids_p[:, c * C:(c + 1) * C], "positions": pos_p[:, c * C:(c + 1) * C],
                             "last_index": np.array([last_index], np.int64), "fill": np.array(fill, np.int64)})
        fill = [min(f + C, b) for f, b in zip(fill, budgets, strict=True)]
    proc = psutil.Process()
    warmup = steps // 10 if warmup is None else warmup
    rss_warm = None
    problem = None
    compactions = 0
    next_pos = prompt_len
    logits = gen.logits.numpy()
    for step in range(steps):
        if not np.isfinite(logits).all():
            problem = f"non-finite logits at step {step}"
            break
        tok = logits.argmax(-1).astype(np.int64)
        gen._run("decode", {"input_ids": tok[:, None], "positions": np.full((B, 1), next_pos, np.int64),
                            "slot": np.array(fill, np.int64)})
        logits = gen.logits.numpy()
        fill = [f + 1 for f in fill]
        if any(f >= c for f, c in zip(fill, caps, strict=True)):
            gen._run("compact", {"fill": np.array(fill, np.int64)})
            fill = [min(f, b) for f, b in zip(fill, budgets, strict=True)]
            compactions += 1
            for i, p in enumerate(gen._positions_now()):  # (B, Hc, cap)
                kept = p[..., : budgets[i]]
                if (p >= 0).sum(-1).min() != budgets[i] or (p >= 0).sum(-1).max() != budgets[i]:
                    problem = f"compaction {compactions} layer {i}: kept {(p >= 0).sum(-1).tolist()} != {budgets[i]}"
                elif (kept < 0).any():
                    problem = f"compaction {compactions} layer {i}: kept slots are not [0, budget)"
                elif (np.diff(kept, axis=-1) <= 0).any():
                    problem = f"compaction {compactions} layer {i}: positions not strictly increasing {kept.tolist()}"
                elif kept.max() > next_pos:
                    problem = f"compaction {compactions} layer {i}: kept position {kept.max()} from the future"
                if problem:
                    break
            if problem:
                break
        next_pos += 1
        if step + 1 == warmup:
            rss_warm = proc.memory_info().rss
    return {"steps": step + 1, "compactions": compactions, "rss_warm": rss_warm,
            "rss_end": proc.memory_info().rss, "last_position": next_pos - 1, "problem": problem}


if __name__ == "__main__":
    print(json.dumps(soak(sys.argv[1], int(sys.argv[2]))))
