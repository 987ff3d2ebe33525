# SPDX-License-Identifier: Apache-2.0
"""The onnxruntime-genai row's timed cells, run by that venv's python (imports no kvexport; from the benchmarks only
:mod:`benchmarks.proc`, which needs NumPy and psutil).

    <venv>/bin/python benchmarks/ortgenai_runner.py '<json spec>'

Loads the model the genai builder wrote (GroupQueryAttention with a preallocated, shared past/present buffer),
with ``intra_op_num_threads`` set in its genai_config.json like every other row, warms up, then for each context
runs a fresh ``Generator`` (``max_length`` = prompt + new tokens, the buffer it preallocates): ``append_tokens``
times the prefill, each ``generate_next_token`` one decode step (the protocol of :mod:`benchmarks.proc`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.proc (NumPy and psutil only)
from benchmarks.proc import prompt_ids, serve_cells  # noqa: E402


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
    return serve_cells(run, spec)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
