# SPDX-License-Identifier: Apache-2.0
"""What every row's timing process shares, whichever venv runs it (no imports beyond NumPy and psutil, so the
Optimum and onnxruntime-genai venvs import it too): the prompt, RSS high-water marks, and the cell protocol.

Protocol (read by :mod:`benchmarks.runner`): one ``{"ready": true, "rss_loaded"}`` line once the row's model is
loaded and warmed up, then one ``{"context": c, "result": {...}}`` line per cell, contexts ascending.
"""

from __future__ import annotations

import json
import resource


def prompt_ids(n: int, vocab: int, seed: int = 1234):
    """The benchmark prompt: ``n`` token ids drawn once from a fixed seed (same for every row), (1, n) int64."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, size=(1, n), dtype=np.int64)


def peak_rss() -> int:
    """This process's RSS high-water mark: VmHWM of /proc/self/status (reset at exec, unlike ``ru_maxrss``,
    which Linux carries over from the parent that forked us)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rss_now() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux ``/proc/self/clear_refs``), so each cell has its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def serve_cells(cell, spec: dict) -> int:
    """Run ``cell(n) -> result dict`` for each (context, n) of ``spec["cells"]`` under the protocol above."""
    rss_loaded = rss_now()
    print(json.dumps({"ready": True, "rss_loaded": rss_loaded}), flush=True)
    for ctx, n in spec["cells"]:
        reset_peak()
        start = rss_now()
        out = cell(int(n))
        out.update(peak_rss=peak_rss(), rss_start=start, rss_loaded=rss_loaded)
        print(json.dumps({"context": ctx, "result": out}), flush=True)
    return 0


def generate_cell(model, spec: dict):
    """A cell of a model with HF's ``generate`` (transformers in PyTorch, Optimum's ORTModelForCausalLM): a streamer
    stamps each token as it is emitted (the first stamp is the prompt, the second the first new token, so prefill =
    stamp 1 - stamp 0 and step i = stamp i+1 - stamp i). Warms the model up once; -> ``cell(n) -> result``."""
    import time

    import numpy as np
    import torch
    from transformers.generation.streamers import BaseStreamer

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

    def cell(n: int) -> dict:
        ids = torch.from_numpy(prompt_ids(n, spec["vocab"]))
        st = Stamps()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                       do_sample=False, streamer=st)
        t = np.array(st.t)
        t[0] = t0
        return {"prefill_s": float(t[1] - t[0]), "decode_ms": (np.diff(t[1:]) * 1e3).tolist(), "tokens": st.toks[:16],
                "cache_bytes": None}

    return cell
