# SPDX-License-Identifier: Apache-2.0
"""The llama.cpp row's timed cells, run by the llama.cpp venv's python (imports no kvexport; from the benchmarks only
:mod:`benchmarks.proc`, which needs NumPy and psutil).

    <venv>/bin/python benchmarks/llamacpp_runner.py '<json spec>'           # timed cells (protocol of benchmarks.proc)
    <venv>/bin/python benchmarks/llamacpp_runner.py --check '<json spec>'   # greedy tokens + every prompt logit

Runs the GGUF as shipped with llama-cpp-python's ``Llama`` at its defaults (K/V cache fp16, ``n_batch`` =
``n_ubatch`` = 512, flash attention off unless the spec says ``"flash_attn": true``), one thread for prompt and
decode (``n_threads`` = ``n_threads_batch``). Each cell gets a fresh context of ``n_ctx`` = prompt + new tokens
(llama.cpp rounds it up to 256), like onnxruntime-genai's ``max_length``; the model stays loaded (mmap).
``Llama.eval`` takes the prompt (batches of 512) and each one-token step; the next token is the argmax of the last
position's logits (``llama_get_logits_ith(ctx, -1)``), inside the timed span.

Without ``logits_all=True`` llama.cpp keeps logits for the last position of a batch only: ``Llama.scores`` is never
written, ``llama_get_logits_ith`` returns NULL for any other position, and reading ``llama_get_logits`` as
prompt × vocab reads past that one row. That read, not ``eval``, is what crashes with SIGSEGV (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.proc (NumPy and psutil only)
from benchmarks.proc import prompt_ids, serve_cells  # noqa: E402

KV_BYTES = 2  # fp16 K and V, llama.cpp's default cache type


def open_llama(spec: dict, n_ctx: int, logits_all: bool = False):
    from llama_cpp import Llama

    threads = int(spec.get("threads") or 1)
    return Llama(spec["gguf"], n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, flash_attn=bool(spec.get("flash_attn")), verbose=False)


def last_logits(llm) -> np.ndarray:
    """The logits of the last evaluated position, (vocab,) float32 (a view of llama.cpp's output buffer)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    if not ptr:
        raise RuntimeError("llama.cpp returned no logits for the last position")
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def cache_shape(llm) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from the GGUF's metadata."""
    md = llm.metadata
    arch = md["general.architecture"]
    heads = int(md[f"{arch}.attention.head_count"])
    head = int(md.get(f"{arch}.attention.key_length") or int(md[f"{arch}.embedding_length"]) // heads)
    return int(md[f"{arch}.block_count"]), int(md.get(f"{arch}.attention.head_count_kv") or heads), head


def decode(llm, ids: list[int], steps: int) -> dict:
    """Prompt ``ids``, then ``steps`` greedy one-token steps; -> prefill seconds, per-step ms, tokens."""
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = int(np.argmax(last_logits(llm)))
    t1 = time.perf_counter()
    toks, ms = [tok], []
    for _ in range(steps):
        a = time.perf_counter()
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
        ms.append((time.perf_counter() - a) * 1e3)
        toks.append(tok)
    return {"prefill_s": t1 - t0, "decode_ms": ms, "tokens": toks}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--check":
        return check(json.loads(argv[1]))
    spec = json.loads(argv[0])
    n_new = spec["steps"] + 1
    warm = open_llama(spec, 256)
    decode(warm, prompt_ids(16, spec["vocab"])[0].tolist(), 2)
    layers, kv_heads, head = cache_shape(warm)
    warm.close()

    def run(n: int) -> dict:
        llm = open_llama(spec, n + n_new)
        try:
            out = decode(llm, prompt_ids(n, spec["vocab"])[0].tolist(), spec["steps"])
            out["tokens"] = out["tokens"][:16]  # the first new tokens, the prefill's first (like the other rows)
            out["n_ctx"] = llm.n_ctx()
            out["flash_attn"] = bool(spec.get("flash_attn"))
            out["cache_bytes"] = 2 * layers * kv_heads * head * llm.n_ctx() * KV_BYTES  # allocated for n_ctx cells
        finally:
            llm.close()
        return out

    return serve_cells(run, spec)


def check(spec: dict) -> int:
    """Greedy continuation of ``spec["ids"]`` and the logits of every prompt position (``logits_all=True``), saved
    to ``spec["logits_npy"]`` ((n, vocab) float32); prints {"tokens": [...]} (the prompt's next token first)."""
    ids = [int(t) for t in spec["ids"]]
    llm = open_llama(spec, len(ids) + int(spec["new"]) + 1, logits_all=True)
    llm.eval(ids)
    np.save(spec["logits_npy"], np.array(llm.scores[: len(ids)], dtype=np.float32))
    tok = int(np.argmax(llm.scores[len(ids) - 1]))
    toks = [tok]
    for _ in range(int(spec["new"]) - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
        toks.append(tok)
    llm.close()
    print(json.dumps({"tokens": toks}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
