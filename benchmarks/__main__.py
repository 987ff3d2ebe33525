# SPDX-License-Identifier: Apache-2.0
"""kvexport against what users would pick instead, side by side in one run.

    python -m benchmarks                 # full table: 2 shapes × 7 rows × contexts 512..32k (< 20 min, exports cached)
    python -m benchmarks --quick         # student only, contexts 512 and 2k, 32 steps (< 3 min with a warm cache)
    python -m benchmarks --tiny          # CI smoke size: tiny random model, contexts 64 and 128
    python -m benchmarks --rows hf,kvx-snapkv --shapes student --contexts 512,8192 --out /tmp/b
    python -m benchmarks --shapes smollm2 --rows ortgenai,ortgenai-int4,llamacpp --contexts 512,2048,8192 --rounds 2

Writes ``results.json``, ``results.md`` and ``decode_ms.png`` / ``peak_memory.png`` into ``--out``. Each row runs
in its own process (model loaded once, contexts ascending, the RSS high-water mark reset before each cell) under a
memory limit (``--mem-limit-gb``) and a per-cell time limit; running out of either is recorded as that cell's
result, and the row's larger contexts are then marked as skipped. Each cell records how quiet the machine was
while its row ran (``quiet``: load average, copy bandwidth before). With ``--rounds N`` the rows run N times,
interleaved (A B C, then C B A, ...); each row keeps its quietest run (lowest mean 1-min load average sampled while
it ran), the others go to ``results.json``'s ``other_rounds``.
Exports (kvexport's and Optimum's) are built once and cached (``KVEXPORT_BENCH_CACHE``, default
``~/.cache/kvexport/bench``); their build time is reported apart from the timed cells.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks import bandwidth, prepare, quality, report, runner
from benchmarks.rows import CONTEXTS_FULL, CONTEXTS_QUICK, CONTEXTS_TINY, ROWS, SHAPES, prompt_tokens
from benchmarks.side_venv import VENVS


def machine_info() -> dict:
    import psutil

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import onnxruntime
    import torch
    import transformers

    return {"cpu": model, "logical_cores": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__,
            "loadavg_start": list(os.getloadavg())}


class LoadSampler:
    """The 1-min load average every ``period`` seconds while a row runs (a context manager), and the copy bandwidth
    just before it: how quiet the machine was for that row."""

    def __init__(self, period: float = 5.0):
        self.period, self.samples, self._stop = period, [], threading.Event()

    def __enter__(self):
        self.copy_gbps = bandwidth.copy_bandwidth(repeats=3)["copy_gbps"]
        self.samples.append(os.getloadavg()[0])
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.samples.append(os.getloadavg()[0])

    def record(self, rnd: int) -> dict:
        return {"round": rnd, "load_mean": round(statistics.fmean(self.samples), 2),
                "load_max": round(max(self.samples), 2), "copy_gbps_before": round(self.copy_gbps, 2)}


def keep_quietest(cells: list[dict]) -> tuple[list[dict], list[dict]]:
    """Cells of several rounds -> (kept, others): per (shape, row), the round with the lowest ``quiet.load_mean``."""
    best: dict[tuple, tuple[float, int]] = {}
    for c in cells:
        q = c.get("quiet")
        if q is None:
            continue
        key = (c["shape"], c["row"])
        if key not in best or q["load_mean"] < best[key][0]:
            best[key] = (q["load_mean"], q["round"])
    kept, others = [], []
    for c in cells:
        q = c.get("quiet")
        (kept if q is None or best[(c["shape"], c["row"])][1] == q["round"] else others).append(c)
    return kept, others


def _k(c: int) -> str:
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="student only, contexts 512/2k, 32 steps; the Optimum row "
                   "runs only if its venv is already built")
    g.add_argument("--tiny", action="store_true", help="smoke size: tiny random model, contexts 64/128, 8 steps")
    ap.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--rows", help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--contexts", help="comma list of context lengths (tokens)")
    ap.add_argument("--steps", type=int, help="decode steps timed per cell (median over them); default 64")
    ap.add_argument("--out", default="/tmp/kvexport-bench", help="output directory")
    ap.add_argument("--mem-limit-gb", type=float, default=8.0, help="RSS limit of each cell's process")
    ap.add_argument("--cell-timeout", type=float, help="seconds per cell (default 150; 60 with --quick/--tiny)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every row (torch and onnxruntime); "
                    "default 1: on a shared CPU, multi-threaded kernels stall whenever another job holds a core")
    ap.add_argument("--rounds", type=int, default=1, help="run the rows this many times, interleaved, and keep each "
                    "row's quietest run (lowest load average while it ran)")
    ap.add_argument("--no-optimum", action="store_true", help="skip row 2 (Optimum's export)")
    ap.add_argument("--build-only", action="store_true", help="build and cache the models and exports, time nothing")
    ap.add_argument("--rebuild", action="store_true", help="re-export even when a cached export exists")
    ap.add_argument("--cache", help="cache directory for models and exports")
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only re-render results.md, the goals and the plots "
                    "from an earlier (possibly partial) results.json into --out")
    a = ap.parse_args(argv)
    a.contexts_given = a.contexts is not None
    if a.tiny:
        a.shapes, a.contexts, a.steps = a.shapes or "tiny", a.contexts or ",".join(map(str, CONTEXTS_TINY)), a.steps or 8
        a.cell_timeout = a.cell_timeout or 60
    elif a.quick:
        a.shapes, a.contexts, a.steps = a.shapes or "student", a.contexts or ",".join(map(str, CONTEXTS_QUICK)), a.steps or 32
        a.cell_timeout = a.cell_timeout or 60
    a.shapes = [s.strip() for s in (a.shapes or "student,llama1b").split(",") if s.strip()]
    real = any(SHAPES[s].gguf for s in a.shapes if s in SHAPES)  # the real-model peers join the default rows
    default_rows = (r for r, row in ROWS.items() if (real or not row.real_model_peer) and not row.on_request)
    a.rows = [r.strip() for r in (a.rows or ",".join(default_rows)).split(",") if r.strip()]
    a.contexts = [int(c) for c in (a.contexts or ",".join(map(str, CONTEXTS_FULL))).split(",") if c.strip()]
    a.steps = a.steps or 64
    a.cell_timeout = a.cell_timeout or 150.0
    for s in a.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; accepted: {', '.join(SHAPES)}")
    for r in a.rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; accepted: {', '.join(ROWS)}")
    return a


def render(res: dict, out: Path) -> None:
    # the bound uses the best bandwidth sample of the run: other jobs on a shared CPU only ever lower it
    samples = [res["bandwidth"]["copy_gbps"], *res.get("bandwidth_samples", []),
               *([res["bandwidth_end"]["copy_gbps"]] if "bandwidth_end" in res else [])]
    res["bandwidth_best_gbps"] = best = max(samples)
    for c in res["cells"]:
        if c.get("status") == "ok" and c.get("bound"):
            c["bound"] = bandwidth.decode_bound(c["bound"]["bytes_per_step"] - c["kv_bytes"], c["kv_bytes"],
                                                c["decode_ms_median"], best)
    res["goals"] = report.goals(res)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(report.markdown(res))
    try:
        report.plots(res, out)
    except Exception as e:  # plotting is a convenience; the JSON and markdown are the result
        print(f"plots failed: {e}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.render:
        render(json.loads(Path(a.render).read_text()), out)
        return 0
    cache = Path(a.cache) if a.cache else prepare.default_cache()
    t_run = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_run:6.0f}s] {msg}", flush=True)

    mode = "tiny" if a.tiny else "quick" if a.quick else "full"
    res: dict = {"command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
                 "mode": mode, "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine_info(), "settings": {"steps": a.steps, "contexts": a.contexts,
                 "mem_limit_gb": a.mem_limit_gb, "threads": a.threads, "cell_timeout_s": a.cell_timeout, "batch": 1,
                 "greedy": True, "rounds": a.rounds},
                 "notes": [], "shapes": {}, "rows": {r: ROWS[r].label for r in a.rows}, "builds": [], "cells": []}
    res["bandwidth"] = bandwidth.copy_bandwidth()
    log(f"memory bandwidth (numpy copy, read+write): {res['bandwidth']['copy_gbps']:.1f} GB/s")

    vpys: dict[str, Path] = {}  # rows timed in their own venv: optimum, ortgenai, llamacpp
    for kind, venv in VENVS.items():
        if not any(ROWS[r].kind == kind for r in a.rows):
            continue
        if kind == "optimum" and a.no_optimum:
            res["notes"].append("Optimum row skipped (--no-optimum)")
            continue
        if kind == "llamacpp" and not any(SHAPES[s].gguf for s in a.shapes):
            res["notes"].append("llama.cpp row skipped: none of the shapes ships a GGUF (--shapes smollm2 does)")
            continue
        py = venv.python()
        if py is None and mode == "full" and venv.auto_build:
            try:
                py = venv.ensure(log=log)
            except Exception as e:  # record and go on without the row
                res["notes"].append(f"{kind} venv could not be built: {str(e).splitlines()[0]}")
        elif py is None:
            how = "a full run builds it" if venv.auto_build else "no run builds it (it compiles for ~10 min)"
            res["notes"].append(f"{kind} row skipped: its venv ({venv.root}) is not built yet; {how} "
                                f"(python -m benchmarks.side_venv {kind})")
        if py is not None:
            vpys[kind] = py
            res["machine"][f"{kind}_venv"] = venv.versions()
    rows = [r for r in a.rows if ROWS[r].kind not in VENVS or ROWS[r].kind in vpys]
    studies = quality.load_studies()

    for sname in a.shapes:
        shape = SHAPES[sname]
        mdir = prepare.model_dir(shape, cache)
        wbytes = prepare.weight_bytes(mdir)
        res["shapes"][sname] = {**shape.to_dict(), "model_dir": str(mdir), "weight_bytes": wbytes,
                                "mla_ratio": shape.mla_ratio()}
        log(f"shape {sname}: {mdir} ({wbytes / 2**20:.1f} MiB of weights)")
        res.setdefault("bandwidth_samples", []).append(bandwidth.copy_bandwidth()["copy_gbps"])
        targets: dict[str, dict] = {}
        ctxs = [c for c in a.contexts if a.contexts_given or not shape.max_context or c <= shape.max_context]
        capacity = max(prompt_tokens(shape, c, a.steps) for c in ctxs) + a.steps + 1  # the static full rows' slots
        skip: dict[str, str] = {}  # rows that do not apply to this shape -> why
        for rname in rows:
            row = ROWS[rname]
            if row.kind == "llamacpp" and shape.gguf is None:
                skip[rname] = "no GGUF for this shape"
                continue
            try:
                if row.kind == "kvx":
                    d, secs = prepare.kvx_export(row, shape, cache, log=log, rebuild=a.rebuild, capacity=capacity)
                    targets[rname] = {"export_dir": str(d), "weight_bytes": prepare.weight_bytes(d),
                                      "export_bytes": sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()),
                                      "synthesize": bool(shape.extra.get("synthesize")) and row.static_budget}
                elif row.kind == "optimum":
                    d, secs = prepare.optimum_export(shape, cache, vpys["optimum"], log=log, rebuild=a.rebuild)
                    targets[rname] = {"export_dir": str(d), "weight_bytes": wbytes}
                elif row.kind == "ortgenai":
                    d, secs = prepare.ortgenai_build(shape, cache, vpys["ortgenai"], log=log, rebuild=a.rebuild,
                                                     precision=row.precision)
                    targets[rname] = {"export_dir": str(d),
                                      "weight_bytes": wbytes if row.precision == "fp32" else prepare.weight_bytes(d)}
                elif row.kind == "llamacpp":
                    gguf, secs = prepare.gguf_path(shape), None
                    targets[rname] = {"gguf": str(gguf), "weight_bytes": gguf.stat().st_size}  # the tensors, as stored
                else:
                    secs = None
                    targets[rname] = {"model_dir": str(mdir), "weight_bytes": wbytes}
                res["builds"].append({"shape": sname, "row": rname, "seconds": secs, "cached": secs is None})
            except Exception as e:
                msg = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
                log(f"  build of {rname}/{sname} failed: {msg}")
                res["builds"].append({"shape": sname, "row": rname, "error": msg})
        if len(ctxs) < len(a.contexts):
            res["notes"].append(f"{sname}: contexts above {_k(shape.max_context)} not run by default (prefill is "
                                "compute-bound on this shape; --contexts runs them)")
        runs = [(rnd, rname) for rnd in range(a.rounds) for rname in (rows if rnd % 2 == 0 else rows[::-1])]
        for rnd, rname in [] if a.build_only else runs:
            row = ROWS[rname]
            if rname in skip and rnd > 0:
                continue
            full_max = shape.extra.get("full_rows_max_context")
            row_ctxs = ctxs if row.static_budget or not full_max else [c for c in ctxs if c <= full_max]
            if len(row_ctxs) < len(ctxs) and rnd == 0:
                res["notes"].append(f"{sname}: {rname} runs contexts up to {_k(full_max)} (a full cache prefills every "
                                    "token; the static-budget rows start from a synthesised cache)")
            ns = [prompt_tokens(shape, ctx, a.steps) for ctx in row_ctxs]
            quiet = None
            if rname in skip:
                recs = [{"status": "skipped", "reason": skip[rname]} for _ in ctxs]
            elif rname not in targets:
                recs = [{"status": "build-failed"} for _ in ctxs]
            else:
                spec = {"kind": "hf" if row.kind == "hf" else "kvx", "vocab": shape.vocab, "steps": a.steps,
                        "threads": a.threads, "cells": list(zip(row_ctxs, ns, strict=False)), **targets[rname]}
                cmd = (runner.side_cmd(row.kind, vpys[row.kind], spec) if row.kind in vpys
                       else runner.cell_cmd(spec))
                log(f"  {sname} {rname}: contexts {', '.join(map(str, row_ctxs))}"
                    + (f" (round {rnd + 1}/{a.rounds})" if a.rounds > 1 else ""))
                with LoadSampler() as ls:
                    recs = runner.run_row(cmd, row_ctxs, int(a.mem_limit_gb * 2**30), a.cell_timeout,
                                          threads=a.threads)
                quiet = ls.record(rnd)
            for ctx, n, rec in zip(row_ctxs, ns, recs, strict=False):
                cell = {"shape": sname, "row": rname, "context": ctx, "prompt_tokens": n,
                        "kv_bytes": shape.kv_bytes(row, n + a.steps, capacity), **runner.summarize(rec)}
                if quiet is not None:
                    cell["quiet"] = quiet
                if rname in targets and targets[rname].get("export_bytes"):
                    cell["export_bytes"] = targets[rname]["export_bytes"]
                if cell["status"] == "ok":
                    r = cell["result"]
                    if r.get("cache_bytes"):
                        cell["kv_bytes_measured"] = r["cache_bytes"]
                    if r.get("resident_bytes"):
                        cell["resident_bytes"] = r["resident_bytes"]
                    cell["prefill_tok_s"] = n / cell["prefill_s"] if cell["prefill_s"] else None
                    cell["bound"] = bandwidth.decode_bound(targets[rname]["weight_bytes"], cell["kv_bytes"],
                                                           cell["decode_ms_median"], res["bandwidth"]["copy_gbps"])
                cell["quality"] = quality.lookup(studies, row.press, shape.budget if row.press else None, n)
                res["cells"].append(cell)
                log(f"  {sname:8s} {ctx:>6} {rname:15s} {report.cell_brief(cell)}")
            (out / "results.json").write_text(json.dumps(res, indent=1))
    if a.rounds > 1:
        res["cells"], res["other_rounds"] = keep_quietest(res["cells"])
    res["bandwidth_end"] = bandwidth.copy_bandwidth()
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = round(time.time() - t_run, 1)
    render(res, out)
    log(f"done in {res['wall_s']:.0f} s -> {out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
