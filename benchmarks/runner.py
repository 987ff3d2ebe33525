# SPDX-License-Identifier: Apache-2.0
"""Run a row's cells in a child process under a memory and a per-cell time limit; OOM and timeout are results.

The watchdog samples the child's RSS (psutil, every 20 ms) and kills it when RSS passes ``mem_limit`` bytes
(status ``"oom"``) or when a cell runs longer than ``time_limit`` seconds (``"timeout"``). An address-space
rlimit is not used: torch and onnxruntime reserve far more virtual memory than they touch. A finished cell's
peak is the child's own VmHWM (reset before each cell); a killed cell's is the watchdog's largest sample.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_row(cmd: list[str], contexts: list[int], mem_limit: int, time_limit: float, load_limit: float = 300.0,
            threads: int = 1, env: dict | None = None) -> list[dict]:
    """Run one row's child (it loads once, then prints a ``{"context", "result"}`` line per cell in order).

    Returns one record per context: {"status": "ok"|"oom"|"timeout"|"error"|"skipped", "wall_s",
    "watch_peak_rss", "result"?, "error"?, "reason"?}. A cell over ``mem_limit`` RSS or ``time_limit`` seconds
    kills the child; that cell gets "oom"/"timeout" and the larger contexts "skipped".
    """
    import psutil

    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update({"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(threads),
              "MKL_NUM_THREADS": str(threads)})
    if env:
        e.update(env)
    lines: queue.Queue = queue.Queue()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=str(REPO))
    err_tail: list[str] = []

    def pump(stream, sink):
        for line in stream:
            sink(line)

    threading.Thread(target=pump, args=(p.stdout, lines.put), daemon=True).start()
    threading.Thread(target=pump, args=(p.stderr, lambda ln: (err_tail.append(ln), err_tail.__delitem__(
        slice(0, -40)) if len(err_tail) > 80 else None)), daemon=True).start()
    ps = psutil.Process(p.pid)
    out: list[dict] = []
    ready = False
    t_mark = time.time()
    peak = 0
    failure: str | None = None

    def take_lines() -> None:
        nonlocal ready, t_mark, peak
        while True:
            try:
                line = lines.get_nowait()
            except queue.Empty:
                return
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            now = time.time()
            if msg.get("ready"):
                ready = True
            elif "result" in msg:
                out.append({"status": "ok", "wall_s": round(now - t_mark, 2), "watch_peak_rss": peak,
                            "result": msg["result"]})
            t_mark, peak = now, 0

    while p.poll() is None:
        take_lines()
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
        except psutil.Error:
            rss = 0
        peak = max(peak, rss)
        limit = time_limit if ready else load_limit
        if rss > mem_limit:
            failure = "oom"
        elif time.time() - t_mark > limit:
            failure = "timeout"
        if failure:
            for c in ps.children(recursive=True):
                c.kill()
            p.kill()
            break
        time.sleep(0.02)
    p.wait()
    time.sleep(0.05)
    take_lines()
    if failure is None and len(out) < len(contexts):
        tail = " | ".join(x.strip() for x in err_tail[-3:])[-400:]
        killed = p.returncode in (-9, 137) or "MemoryError" in tail or "bad_alloc" in tail
        failure = "oom" if killed else "error"
    if failure is not None and len(out) < len(contexts):
        rec = {"status": failure, "wall_s": round(time.time() - t_mark, 2), "watch_peak_rss": peak}
        if failure == "error" or not ready:
            rec["error"] = " | ".join(x.strip() for x in err_tail[-3:])[-400:] or f"exit code {p.returncode}"
            if not ready:
                rec["error"] = "while loading: " + rec["error"]
        out.append(rec)
        where = contexts[len(out) - 1]
        while len(out) < len(contexts):
            out.append({"status": "skipped", "reason": f"{failure} at {where}"})
    return out


def summarize(rec: dict) -> dict:
    """Cell record -> the table's numbers (medians etc.), keeping the raw per-step times."""
    if rec.get("status") != "ok":
        return rec
    r = rec["result"]
    d = r["decode_ms"]
    rec["prefill_s"] = r["prefill_s"]
    rec["decode_ms_median"] = statistics.median(d) if d else None
    rec["decode_ms_mean"] = statistics.fmean(d) if d else None
    rec["decode_ms_min"] = min(d) if d else None
    rec["decode_ms_p90"] = sorted(d)[int(0.9 * (len(d) - 1))] if d else None
    rec["decode_steps"] = len(d)
    rec["peak_rss"] = int(r.get("peak_rss") or 0) or rec["watch_peak_rss"]
    rec["rss_loaded"] = r.get("rss_loaded")
    return rec


def cell_cmd(spec: dict) -> list[str]:
    return [sys.executable, "-m", "benchmarks.cell", json.dumps(spec)]


def side_cmd(kind: str, venv_python: Path, spec: dict) -> list[str]:
    """A row timed in its own venv: ``benchmarks/<kind>_runner.py`` run by that venv's python."""
    return [str(venv_python), str(REPO / "benchmarks" / f"{kind}_runner.py"), json.dumps(spec)]
