# SPDX-License-Identifier: Apache-2.0
"""One timed cell (row × context) in a fresh process: ``python -m benchmarks.cell '<json spec>'``.

Prints one JSON line ``{"result": {...}}``: prefill seconds, per-step decode milliseconds, peak RSS
(``getrusage`` high-water mark of this process), RSS after loading, the first generated tokens, cache bytes.
The parent (:mod:`benchmarks.runner`) enforces the memory and time limits.

Timing. HF ``generate``: a streamer stamps each token as it is emitted (the first stamp is the prompt, the
second the first new token, so prefill = stamp 1 − stamp 0 and step i = stamp i+1 − stamp i). onnxruntime:
every session's ``run_with_iobinding`` is wrapped and stamped at its end; prefill = first call's start to the
last prefill call's end (all chunks), a decode step = end of one decode call to the end of the next, so
compaction calls, host work and argmax fall inside the step they delay.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np


def peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rss_now() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def prompt_ids(n: int, vocab: int, seed: int = 1234) -> np.ndarray:
    """The benchmark prompt: ``n`` token ids drawn once from a fixed seed (same for every row), (1, n) int64."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(1, n), dtype=np.int64)


def run_hf(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()

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
    model.generate(warm, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    rss_loaded = rss_now()
    ids = torch.from_numpy(prompt_ids(spec["prompt_tokens"], spec["vocab"]))
    st = Stamps()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                   do_sample=False, streamer=st)
    t = np.array(st.t)
    t[0] = t0
    return {"prefill_s": float(t[1] - t[0]), "decode_ms": (np.diff(t[1:]) * 1e3).tolist(),
            "rss_loaded": rss_loaded, "tokens": st.toks[:16], "cache_bytes": None}


class _TimedSession:
    """Wraps an onnxruntime InferenceSession; records (graph, start, end) of every IO-binding run."""

    def __init__(self, sess, name: str, log: list):
        self._sess, self._name, self._log = sess, name, log

    def run_with_iobinding(self, *a, **k):
        t0 = time.perf_counter()
        r = self._sess.run_with_iobinding(*a, **k)
        self._log.append((self._name, t0, time.perf_counter()))
        return r

    def __getattr__(self, item):
        return getattr(self._sess, item)


def run_kvx(spec: dict) -> dict:
    from kvexport.export import OrtGenerator

    gen = OrtGenerator(spec["export_dir"], providers=["CPUExecutionProvider"])
    log: list = []
    gen.sessions = {n: _TimedSession(s, n, log) for n, s in gen.sessions.items()}
    gen.generate(prompt_ids(16, spec["vocab"]), max_new_tokens=3, track_kept=False)  # warm-up
    rss_loaded = rss_now()
    log.clear()
    n_new = spec["steps"] + 1
    ids = prompt_ids(spec["prompt_tokens"], spec["vocab"])
    res = gen.generate(ids, max_new_tokens=n_new, track_kept=False)
    if gen.dynamic:  # one call per token, the first holds the whole prompt
        prefill_end, t_start = log[0][2], log[0][1]
        ends = [e for _, _, e in log[1:]]
    else:
        pre = [i for i, (n, _, _) in enumerate(log) if n == "prefill"]
        t_start, prefill_end = log[0][1], log[pre[-1]][2]
        ends = [e for n, _, e in log[pre[-1] + 1:] if n == "decode"]
    ends = np.array([prefill_end, *ends])
    out = {"prefill_s": float(prefill_end - t_start), "decode_ms": (np.diff(ends) * 1e3).tolist(),
           "rss_loaded": rss_loaded, "tokens": [int(x) for x in res.tokens[0, :16]],
           "cache_bytes": int(res.cache_bytes), "compactions": int(res.compactions),
           "prefill_calls": sum(1 for n, _, _ in log if n == "prefill") or 1}
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    threads = spec.get("threads")
    if threads:
        import os

        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    fn = {"hf": run_hf, "kvx": run_kvx}[spec["kind"]]
    out = fn(spec)
    out["peak_rss"] = peak_rss()
    print(json.dumps({"result": out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
