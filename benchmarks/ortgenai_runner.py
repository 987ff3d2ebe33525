# SPDX-License-Identifier: Apache-2.0
"""The onnxruntime-genai row's timed cells, run by that venv's python (standalone: imports neither kvexport nor
benchmarks).

    <venv>/bin/python benchmarks/ortgenai_runner.py '<json spec>'

Loads the model the genai builder wrote (GroupQueryAttention with a preallocated, shared past/present buffer),
with ``intra_op_num_threads`` set in its genai_config.json like every other row, warms up, then for each context
runs a fresh ``Generator`` (``max_length`` = prompt + new tokens, the buffer it preallocates): ``append_tokens``
times the prefill, each ``generate_next_token`` one decode step. Same protocol as :mod:`benchmarks.cell`: a
``ready`` line, then one ``{"context", "result"}`` line per cell.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def prompt_ids(n: int, vocab: int, seed: int = 1234) -> np.ndarray:
    """The benchmark prompt (the same ids as benchmarks.cell.prompt_ids)."""
    return np.random.default_rng(seed).integers(3, vocab, size=(1, n), dtype=np.int64)


def set_threads(model_dir: str, threads: int) -> None:
    path = f"{model_dir}/genai_config.json"
    cfg = json.load(open(path))
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    if so.get("intra_op_num_threads") != threads or so.get("inter_op_num_threads") != 1:
        so["intra_op_num_threads"], so["inter_op_num_threads"] = threads, 1
        json.dump(cfg, open(path, "w"), indent=2)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    import onnxruntime_genai as og
    import psutil

    set_threads(spec["export_dir"], int(spec.get("threads") or 1))
    model = og.Model(spec["export_dir"])
    cfg = json.load(open(f"{spec['export_dir']}/genai_config.json"))["model"]
    layers, kv_heads, head = (cfg["decoder"][k] for k in ("num_hidden_layers", "num_key_value_heads", "head_size"))
    n_new = spec["steps"] + 1

    def run(n: int) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=n + n_new, do_sample=False)
        gen = og.Generator(model, params)
        ids = prompt_ids(n, spec["vocab"])[0].astype(np.int32)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        t1 = time.perf_counter()
        steps, toks = [], []
        for _ in range(spec["steps"]):
            a = time.perf_counter()
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
            steps.append((time.perf_counter() - a) * 1e3)
        return {"prefill_s": t1 - t0, "decode_ms": steps, "tokens": toks[:16],
                "cache_bytes": 2 * layers * kv_heads * head * (n + n_new) * 4}  # the shared past/present buffer

    run(16)
    rss_loaded = int(psutil.Process().memory_info().rss)
    print(json.dumps({"ready": True, "rss_loaded": rss_loaded}), flush=True)
    for ctx, n in spec["cells"]:
        reset_peak()
        start = int(psutil.Process().memory_info().rss)
        out = run(int(n))
        out.update(peak_rss=peak_rss(), rss_start=start, rss_loaded=rss_loaded)
        print(json.dumps({"context": ctx, "result": out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
