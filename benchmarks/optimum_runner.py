# SPDX-License-Identifier: Apache-2.0
"""Row 2's timed cell, run by the Optimum venv's python (standalone: imports neither kvexport nor benchmarks).

    <venv>/bin/python benchmarks/optimum_runner.py '<json spec>'

Loads Optimum's export with ``ORTModelForCausalLM`` (what Optimum's docs show users), warms up, then runs
``generate`` greedily with a streamer stamping each emitted token, exactly like the HF row of
:mod:`benchmarks.cell`. Prints ``{"result": {...}}`` with the same fields.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np


def prompt_ids(n: int, vocab: int, seed: int = 1234) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(1, n), dtype=np.int64)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    import psutil
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = ORTModelForCausalLM.from_pretrained(spec["export_dir"], provider="CPUExecutionProvider", use_cache=True)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t: list[float] = []
            self.toks: list[int] = []

        def put(self, value):
            self.t.append(time.perf_counter())
            if len(self.t) > 1:
                self.toks.append(int(value.reshape(-1)[0]))

        def end(self):
            pass

    n_new = spec["steps"] + 1
    warm = torch.from_numpy(prompt_ids(16, spec["vocab"]))
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    rss_loaded = int(psutil.Process().memory_info().rss)
    ids = torch.from_numpy(prompt_ids(spec["prompt_tokens"], spec["vocab"]))
    st = Stamps()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                   do_sample=False, streamer=st)
    t = np.array(st.t)
    t[0] = t0
    out = {"prefill_s": float(t[1] - t[0]), "decode_ms": (np.diff(t[1:]) * 1e3).tolist(), "rss_loaded": rss_loaded,
           "tokens": st.toks[:16], "cache_bytes": None,
           "peak_rss": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}
    print(json.dumps({"result": out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
