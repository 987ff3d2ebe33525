# SPDX-License-Identifier: Apache-2.0
"""One row's timed cells in a fresh process: ``python -m benchmarks.cell '<json spec>'``.

The row's model (or export) is loaded once and warmed up, then the contexts run in ascending order. Before each
cell the kernel's RSS high-water mark is reset (``/proc/self/clear_refs``), so a cell's peak is VmHWM at its end:
the loaded model plus what that cell allocated. One JSON line per cell, ``{"context": c, "result": {...}}``:
prefill seconds, per-step decode milliseconds, peak RSS, RSS after loading, the first generated tokens, cache
bytes. The parent (:mod:`benchmarks.runner`) enforces the memory and per-cell time limits.

Timing. HF ``generate``: a streamer stamps each token as it is emitted (the first stamp is the prompt, the
second the first new token, so prefill = stamp 1 − stamp 0 and step i = stamp i+1 − stamp i). onnxruntime:
every session's ``run_with_iobinding`` is wrapped and stamped at its end; prefill = first call's start to the
last prefill call's end (all chunks and their compactions), a decode step = end of one decode call to the end
of the next, so compaction calls, host work and argmax fall inside the step they delay.

Synthesised caches (``"synthesize": true``, the static-budget rows of a shape whose long prefill would not fit
the run): the cell skips the prompt and fills the cache as a compacted prefill leaves it — ``budget`` slots per
layer holding random keys/values at positions drawn from [0, n) — then times the decode steps at position n
(compactions every ``window`` steps included, scoring those keys). A static budget's step touches the same slots
whatever the context, so this is its decode cost at context n; prefill is not measured (``prefill_s`` null).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from benchmarks.proc import generate_cell, prompt_ids, serve_cells


def run_hf(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    torch.set_num_threads(int(spec.get("threads") or 1))
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return generate_cell(model, spec)


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


def run_kvx(spec: dict):
    from kvexport.export import OrtGenerator

    gen = OrtGenerator(spec["export_dir"], providers=["CPUExecutionProvider"], threads=int(spec.get("threads") or 1))
    log: list = []
    gen.sessions = {n: _TimedSession(s, n, log) for n, s in gen.sessions.items()}
    gen.generate(prompt_ids(16, spec["vocab"]), max_new_tokens=3, track_kept=False)  # warm-up
    n_new = spec["steps"] + 1

    if spec.get("synthesize"):
        return _synthesized_cells(gen, spec, log)

    def cell(n: int) -> dict:
        log.clear()
        res = gen.generate(prompt_ids(n, spec["vocab"]), max_new_tokens=n_new, track_kept=False)
        if gen.dynamic:  # one call per prompt chunk (the whole prompt when the export has no chunk), then per token
            k = len(log) - spec["steps"]  # the last `steps` calls are the decode steps
            prefill_end, t_start = log[k - 1][2], log[0][1]
            ends = [e for _, _, e in log[k:]]
        else:
            pre = [i for i, (g, _, _) in enumerate(log) if g in ("prefill", "compact_prefill")]
            t_start, prefill_end = log[0][1], log[pre[-1]][2]
            ends = [e for g, _, e in log[pre[-1] + 1:] if g == gen.decode_graph]
        ends = np.array([prefill_end, *ends])
        return {"prefill_s": float(prefill_end - t_start), "decode_ms": (np.diff(ends) * 1e3).tolist(),
                "tokens": [int(x) for x in res.tokens[0, :16]], "cache_bytes": int(res.cache_bytes),
                "resident_bytes": res.resident_bytes, "compactions": int(res.compactions),
                "prefill_calls": (len(log) - spec["steps"]) if gen.dynamic else sum(1 for g, _, _ in log if g == "prefill")}

    return cell


def _synthesized_cells(gen, spec: dict, log: list):
    """Cells that start from a synthesised, compacted cache (module docstring)."""
    rng = np.random.default_rng(7)

    def cell(n: int) -> dict:
        gen.reset()
        for i, b in enumerate(gen.plan.budgets):
            for name in (f"k_{i}", f"v_{i}"):
                arr = gen.cache[name]
                arr[:, :, :b] = rng.standard_normal(arr[:, :, :b].shape).astype(arr.dtype)
            keep = np.sort(rng.choice(n, size=min(b, n), replace=False))
            gen.cache[f"pos_{i}"][:, :, : keep.size] = keep
            gen.state.fills[i] = int(keep.size)
        gen.next_pos = np.full(gen.batch, n, np.int64)
        gen.last_logits = np.zeros((gen.batch, 1), np.float32)
        log.clear()
        tok, toks = 5, []
        t0 = time.perf_counter()
        for _ in range(spec["steps"]):
            tok = int(gen.decode(tok).argmax(-1)[0])
            toks.append(tok)
        ends = [e for g, _, e in log if g == gen.decode_graph]
        return {"prefill_s": None, "decode_ms": (np.diff(np.array([t0, *ends])) * 1e3).tolist(), "tokens": toks[:16],
                "cache_bytes": int(gen.current_cache_bytes()), "resident_bytes": gen.resident_bytes(),
                "compactions": int(gen.compactions), "synthesized": True}

    return cell


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    return serve_cells({"hf": run_hf, "kvx": run_kvx}[spec["kind"]](spec), spec)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
