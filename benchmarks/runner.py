# SPDX-License-Identifier: Apache-2.0
"""Run one cell in a child process under a memory and a time limit; OOM and timeout are results.

The watchdog samples the child's RSS (psutil, every 20 ms) and kills it when RSS passes ``mem_limit`` bytes
(status ``"oom"``) or when it runs longer than ``time_limit`` seconds (``"timeout"``). An address-space
rlimit is not used: torch and onnxruntime reserve far more virtual memory than they touch. The child's own
``getrusage`` high-water mark is the peak reported when it finishes; the watchdog's largest sample when it
is killed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_child(cmd: list[str], mem_limit: int, time_limit: float, env: dict | None = None) -> dict:
    """Run ``cmd``; returns {"status": "ok"|"oom"|"timeout"|"error", "wall_s", "watch_peak_rss", "result"?,
    "error"?}. The child prints ``{"result": ...}`` as its last JSON line on stdout."""
    import psutil

    e = dict(os.environ)
    e.setdefault("PYTHONPATH", str(REPO))
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update({"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"})
    if env:
        e.update(env)
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=str(REPO))
    ps = psutil.Process(p.pid)
    peak, status = 0, None
    while p.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
        except psutil.Error:
            rss = 0
        peak = max(peak, rss)
        if rss > mem_limit:
            status = "oom"
        elif time.time() - t0 > time_limit:
            status = "timeout"
        if status:
            for c in ps.children(recursive=True):
                c.kill()
            p.kill()
            break
        time.sleep(0.02)
    out, err = p.communicate()
    wall = time.time() - t0
    rec: dict = {"wall_s": round(wall, 2), "watch_peak_rss": peak}
    if status:
        rec["status"] = status
        return rec
    result = None
    for line in reversed(out.splitlines()):
        if line.startswith('{"result"'):
            result = json.loads(line)["result"]
            break
    if p.returncode != 0 or result is None:
        tail = (err or out).strip().splitlines()[-3:]
        # a child killed by the kernel's OOM killer (SIGKILL) is an OOM too
        rec["status"] = "oom" if p.returncode in (-9, 137) or "MemoryError" in err else "error"
        rec["error"] = " | ".join(tail)[-400:]
        return rec
    rec["status"] = "ok"
    rec["result"] = result
    return rec


def summarize(rec: dict) -> dict:
    """Cell record -> the table's numbers (medians etc.), keeping the raw per-step times."""
    if rec.get("status") != "ok":
        return rec
    r = rec["result"]
    d = r["decode_ms"]
    rec["prefill_s"] = r["prefill_s"]
    rec["decode_ms_median"] = statistics.median(d) if d else None
    rec["decode_ms_mean"] = statistics.fmean(d) if d else None
    rec["decode_ms_p90"] = sorted(d)[int(0.9 * (len(d) - 1))] if d else None
    rec["decode_steps"] = len(d)
    rec["peak_rss"] = max(int(r.get("peak_rss") or 0), 0) or rec["watch_peak_rss"]
    rec["rss_loaded"] = r.get("rss_loaded")
    return rec


def cell_cmd(spec: dict) -> list[str]:
    return [sys.executable, "-m", "benchmarks.cell", json.dumps(spec)]


def optimum_cmd(venv_python: Path, spec: dict) -> list[str]:
    return [str(venv_python), str(REPO / "benchmarks" / "optimum_runner.py"), json.dumps(spec)]
