# SPDX-License-Identifier: Apache-2.0
"""Row 2's timed cell, run by the Optimum venv's python (standalone: imports neither kvexport nor benchmarks).

    <venv>/bin/python benchmarks/optimum_runner.py '<json spec>'

Loads Optimum's export with ``ORTModelForCausalLM`` (what Optimum's docs show users), warms up, then for each
context runs ``generate`` greedily with a streamer stamping each emitted token, exactly like the HF row of
:mod:`benchmarks.cell` (same protocol: a ``ready`` line, then one ``{"context", "result"}`` line per cell).
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np


def peak_rss() -> int:
    """VmHWM of /proc/self/status (``ru_maxrss`` would carry the forking parent's peak over)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def prompt_ids(n: int, vocab: int, seed: int = 1234) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(1, n), dtype=np.int64)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    import onnxruntime as ort
    import psutil
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    threads = int(spec.get("threads") or 1)
    torch.set_num_threads(threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    model = ORTModelForCausalLM.from_pretrained(spec["export_dir"], provider="CPUExecutionProvider", use_cache=True,
                                                session_options=so)

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
    print(json.dumps({"ready": True, "rss_loaded": rss_loaded}), flush=True)
    for ctx, n in spec["cells"]:
        reset_peak()
        start = int(psutil.Process().memory_info().rss)
        ids = torch.from_numpy(prompt_ids(int(n), spec["vocab"]))
        st = Stamps()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                       do_sample=False, streamer=st)
        t = np.array(st.t)
        t[0] = t0
        out = {"prefill_s": float(t[1] - t[0]), "decode_ms": (np.diff(t[1:]) * 1e3).tolist(),
               "rss_loaded": rss_loaded, "rss_start": start, "tokens": st.toks[:16], "cache_bytes": None,
               "peak_rss": peak_rss()}
        print(json.dumps({"context": ctx, "result": out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
