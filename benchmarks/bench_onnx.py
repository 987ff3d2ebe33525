# SPDX-License-Identifier: Apache-2.0
"""onnxruntime decode time per token and process peak memory vs context, for three exports of a model:

- ``full``: the full-cache baseline with a growing past (``--press none --dynamic-cache``, Optimum-style),
- ``b256``: SnapKV, budget 256, window 32 (static cache of 288 slots per layer),
- ``b256+mla``: the same on the MLA-rewritten model (latent cache, LatentAttention decode).

Shapes: ``student`` (the bundled reference student, models/kvx-student) and ``llama1b`` (Llama-3.2-1B
layer shapes: hidden 2048, 32 heads, 8 KV heads, head_dim 64, MLP 8192, vocab 128256 tied; a few layers,
random weights). Each (export, context) runs in its own process so its peak RSS (``ru_maxrss``) is its own.
The prompt is fed for real (chunked prefill) unless ``--synthetic-from`` says otherwise for long contexts;
decode time is the median of ``--steps`` greedy steps (compactions included). Usage::

    python benchmarks/bench_onnx.py                       # both shapes, 512 / 2k / 8k / 16k
    python benchmarks/bench_onnx.py --shapes student --contexts 512,2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("full", "b256", "b256+mla")


def build_model(shape: str, layers: int):
    import torch

    from kvexport.models.tiny import tiny_model

    if shape == "student":
        from kvexport.models.loading import load_hf_model

        return load_hf_model(ROOT / "models" / "kvx-student"), {"rank": 64, "rope": 16}
    if shape == "llama1b":
        hf = tiny_model("llama", vocab_size=128256, hidden_size=2048, layers=layers, heads=32, kv_heads=8,
                        head_dim=64, intermediate_size=8192, max_positions=131072, tie_word_embeddings=True,
                        rope_theta=500000.0)
        return hf.to(torch.float32), {"rank": 128, "rope": 32}
    raise SystemExit(f"unknown shape {shape}")


def export_all(shape: str, layers: int, work: Path) -> dict[str, Path]:
    from kvexport.export import export_model
    from kvexport.presses import make_press

    hf, mla = build_model(shape, layers)
    out = {}
    for v in VARIANTS:
        d = work / f"{shape}-{v.replace('+', '_')}"
        out[v] = d
        if (d / "manifest.json").is_file():
            continue
        t0 = time.perf_counter()
        if v == "full":
            export_model(hf, d, dynamic_cache=True, chunk=512, force=True)
        else:
            kw = {"mla_rank": mla["rank"], "rope_dim": mla["rope"]} if v.endswith("mla") else {}
            export_model(hf, d, press=make_press("snapkv", budget=256, window_size=32), window=32, chunk=128,
                         force=True, **kw)
        print(f"  exported {d.name} in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return out


def peak_rss_mb(field: str = "VmHWM") -> float:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it does not inherit the parent's peak
    across fork + exec), or its current one with ``field="VmRSS"``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(directory: str, context: int, steps: int, threads: int) -> None:
    """One measurement in this process: prefill ``context`` random tokens, ``steps`` decode steps."""
    import numpy as np

    from kvexport.runtime import generate, open_onnxruntime

    gen = open_onnxruntime(directory, threads=threads)
    loaded = peak_rss_mb("VmRSS")  # the sessions one sequence runs + weights + (static) cache buffers
    V = int(gen.settings["vocab_size"])
    ids = np.random.default_rng(0).integers(3, V, (gen.batch, context))
    res = generate(gen, ids, None, steps + 1)
    dec = sorted(res.decode_seconds)
    print(json.dumps({"decode_ms": 1000 * dec[len(dec) // 2], "prefill_s": res.prefill_seconds,
                      "peak_rss_mb": peak_rss_mb(), "loaded_rss_mb": loaded,
                      "cache_mb": res.cache_bytes / 2**20, "compactions": res.compactions}))


def synthetic_worker(directory: str, context: int, steps: int, threads: int) -> None:
    """Like :func:`worker`, but the cache is put in the state a ``context``-token prompt leaves (random
    keys/values at positions < context, the driver's ``synthesize``) instead of running the prefill: decode cost
    only, through the same loop."""
    import numpy as np

    from kvexport.runtime import Stream, open_onnxruntime
    from kvexport.runtime.loop import generate_from

    gen = open_onnxruntime(directory, threads=threads)
    loaded = peak_rss_mb("VmRSS")
    rng = np.random.default_rng(0)
    stream = Stream.resume(gen, gen.synthesize(context, rng))
    first = np.zeros((gen.batch, int(gen.settings["vocab_size"])), np.float32)
    res = generate_from(stream, first, steps + 1)
    times = sorted(res.decode_seconds)
    print(json.dumps({"decode_ms": 1000 * times[len(times) // 2], "prefill_s": float("nan"),
                      "peak_rss_mb": peak_rss_mb(), "loaded_rss_mb": loaded,
                      "cache_mb": res.cache_bytes / 2**20, "compactions": res.compactions}))


def measure(d: Path, context: int, steps: int, threads: int, timeout: int, synthetic: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(d), "--context", str(context), "--steps", str(steps),
           "--threads", str(threads)] + (["--synthetic"] if synthetic else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s"}
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="student,llama1b")
    ap.add_argument("--contexts", default="512,2048,8192,16384")
    ap.add_argument("--layers", type=int, default=2, help="layers of the llama1b stack")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per measurement")
    ap.add_argument("--work", default="/tmp/kvx_bench_onnx")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--synthetic", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synthetic-shapes", default="llama1b", help="shapes whose cache state is synthesised instead "
                    "of prefilled (decode cost only; prefill of long prompts is slow on a shared CPU)")
    a = ap.parse_args()
    if a.worker:
        (synthetic_worker if a.synthetic else worker)(a.worker, a.context, a.steps, a.threads)
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    contexts = [int(c) for c in a.contexts.split(",")]
    rows = []
    for shape in a.shapes.split(","):
        print(f"[{shape}] exporting", file=sys.stderr, flush=True)
        dirs = export_all(shape, a.layers, work)
        for v in VARIANTS:
            for ctx in contexts:
                r = measure(dirs[v], ctx, a.steps, a.threads, a.timeout, shape in a.synthetic_shapes.split(","))
                rows.append({"shape": shape, "variant": v, "context": ctx, **r})
                print(f"  {shape:8} {v:9} {ctx:6} {r}", file=sys.stderr, flush=True)
    print("| shape | export | context | decode ms/token | prefill s | peak RSS MiB | RSS after load MiB | "
          "growth MiB | KV cache MiB | compactions |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['variant']} | {r['context']} | {r['error']} | | | | | | |")
            continue
        pre = "synthetic" if r["prefill_s"] != r["prefill_s"] else f"{r['prefill_s']:.2f}"
        print(f"| {r['shape']} | {r['variant']} | {r['context']} | {r['decode_ms']:.2f} | {pre} | "
              f"{r['peak_rss_mb']:.0f} | {r['loaded_rss_mb']:.0f} | {r['peak_rss_mb'] - r['loaded_rss_mb']:.0f} | "
              f"{r['cache_mb']:.2f} | {r['compactions']} |")


if __name__ == "__main__":
    main()
