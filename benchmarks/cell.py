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


#: the graphs a static export runs the prompt with (a prompt's chunks, the last one's graph with a lookahead, and the
#: compactions between them): the prompt's time ends with the last of them
PREFILL_GRAPHS = ("prefill", "prefill_last", "compact_prefill", "compact_prefill_tail")


def run_kvx(spec: dict):
    from kvexport.runtime import generate, open_onnxruntime
    from kvexport.runtime.sessions import LazySessions

    gen = open_onnxruntime(spec["export_dir"], providers=["CPUExecutionProvider"], threads=int(spec.get("threads") or 1))
    log: list = []
    made = gen.graphs.sessions  # stamps each call; a session is still made when its graph first runs
    gen.graphs.sessions = LazySessions(lambda n: _TimedSession(made[n], n, log), made)
    generate(gen, prompt_ids(16, spec["vocab"]), max_new_tokens=3)  # warm-up
    n_new = spec["steps"] + 1

    if spec.get("synthesize"):
        return _synthesized_cells(gen, spec, log)

    def cell(n: int) -> dict:
        log.clear()
        res = generate(gen, prompt_ids(n, spec["vocab"]), max_new_tokens=n_new)
        if gen.dynamic:  # one call per prompt chunk (the whole prompt when the export has no chunk), then per token
            k = len(log) - spec["steps"]  # the last `steps` calls are the decode steps
            prefill_end, t_start = log[k - 1][2], log[0][1]
            ends = [e for _, _, e in log[k:]]
        else:
            pre = [i for i, (g, _, _) in enumerate(log) if g in PREFILL_GRAPHS]
            t_start, prefill_end = log[0][1], log[pre[-1]][2]
            ends = [e for g, _, e in log[pre[-1] + 1:] if g == gen.decode_graph]
        ends = np.array([prefill_end, *ends])
        return {"prefill_s": float(prefill_end - t_start), "decode_ms": (np.diff(ends) * 1e3).tolist(),
                "tokens": [int(x) for x in res.tokens[0, :16]], "cache_bytes": int(res.cache_bytes),
                "resident_bytes": res.resident_bytes, "compactions": int(res.compactions),
                "prefill_calls": (len(log) - spec["steps"]) if gen.dynamic
                else sum(1 for g, _, _ in log if g in ("prefill", "prefill_last"))}

    return cell


def _synthesized_cells(gen, spec: dict, log: list):
    """Cells that start from a synthesised, compacted cache (module docstring): the driver's ``synthesize``, then
    the one loop's decoding from the first token 5."""
    from kvexport.runtime import Stream
    from kvexport.runtime.loop import generate_from

    rng = np.random.default_rng(7)
    first = np.zeros((gen.batch, int(spec["vocab"])), np.float32)
    first[:, 5] = 1.0

    def cell(n: int) -> dict:
        stream = Stream.resume(gen, gen.synthesize(n, rng))
        log.clear()
        t0 = time.perf_counter()
        res = generate_from(stream, first, spec["steps"] + 1)
        ends = [e for g, _, e in log if g == gen.decode_graph]
        return {"prefill_s": None, "decode_ms": (np.diff(np.array([t0, *ends])) * 1e3).tolist(),
                "tokens": [int(x) for x in res.tokens[0, 1:17]], "cache_bytes": int(res.cache_bytes),
                "resident_bytes": res.resident_bytes, "compactions": int(res.compactions), "synthesized": True}

    return cell


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    return serve_cells({"hf": run_hf, "kvx": run_kvx}[spec["kind"]](spec), spec)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
