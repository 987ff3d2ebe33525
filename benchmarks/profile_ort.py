# SPDX-License-Identifier: Apache-2.0
"""Where a static export's step spends its time: onnxruntime's profiler, summed by operator type.

    python -m benchmarks.profile_ort EXPORT_DIR [--graph decode] [--runs 32] [--threads 1] [--top 12]

Builds a session of one graph of an export directory (static shapes) with ``enable_profiling``, feeds it
zeros (position inputs -1 = empty slots; every static graph does the same work whatever the values), runs it
``runs`` times after a warm-up and prints the share of node time per op type (each node's median over the runs,
so a run preempted by another process does not count) and the largest single nodes, as markdown. Used by docs/benchmarks.md to explain missed goals.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
      "tensor(int32)": np.int32, "tensor(bool)": np.bool_, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


def feeds_for(sess, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Zeros for every input; symbolic dims take ``dims[name]`` (e.g. the growing past's length), else 1."""
    dims = dims or {}
    out = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else int(dims.get(str(d), 1)) for d in i.shape]
        dt = NP.get(i.type, np.float32)
        if i.name == "past_positions":
            arr = np.arange(shape[-1], dtype=dt)[None].repeat(shape[0], 0)
        elif i.name == "positions":
            arr = np.full(shape, int(dims.get("past", 0)), dt)
        elif i.name.startswith(("pos", "qpos")):
            arr = np.full(shape, -1, dt)
        else:
            arr = np.zeros(shape, dt)
        out[i.name] = arr
    return out


def profile(export_dir: str | Path, graph: str = "decode", runs: int = 32, threads: int = 1,
            dims: dict[str, int] | None = None) -> dict:
    """Returns {"total_us", "by_op": [(op, us, share)], "top_nodes": [(name, op, us)], "runs"}."""
    import onnxruntime as ort

    path = Path(export_dir) / f"{graph}.onnx"
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = os.path.join(tmp, "ort")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        feeds = feeds_for(sess, dims)
        for _ in range(3):
            sess.run(None, feeds)
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    durs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        durs[(e["name"][: -len("_kernel_time")], e.get("args", {}).get("op_name", "?"))].append(e["dur"])
    # per node, the median over the runs (robust to a run preempted by another process), summed per op type
    by_node = {k: float(np.median(v[3:] if len(v) > 3 else v)) for k, v in durs.items()}
    by_op: dict[str, float] = defaultdict(float)
    for (_, op), us in by_node.items():
        by_op[op] += us
    total = sum(by_op.values())
    return {"graph": graph, "runs": runs, "total_us_per_run": total,
            "by_op": sorted(((k, v, v / total) for k, v in by_op.items()), key=lambda x: -x[1]),
            "top_nodes": sorted(((k[0], k[1], v) for k, v in by_node.items()), key=lambda x: -x[2])[:12]}


def markdown(p: dict, top: int = 10) -> str:
    lines = [f"`{p['graph']}.onnx`: {p['total_us_per_run'] / 1e3:.3f} ms of kernel time per run (sum of per-node "
             f"medians over {p['runs']} runs)",
             "", "| op type | ms/run | share |", "|---|---:|---:|"]
    for op, us, share in p["by_op"][:top]:
        lines.append(f"| {op} | {us / 1e3:.3f} | {100 * share:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_ort")
    ap.add_argument("export_dir")
    ap.add_argument("--graph", default="decode")
    ap.add_argument("--runs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", help="also write the profile summary here")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=N",
                    help="value of a symbolic input dim, e.g. past=16384 for a --dynamic-cache model.onnx")
    a = ap.parse_args(argv)
    dims = {k: int(v) for k, v in (d.split("=", 1) for d in a.dim)}
    p = profile(a.export_dir, a.graph, a.runs, a.threads, dims)
    print(markdown(p, a.top))
    print()
    print("largest nodes:", ", ".join(f"{n} ({op}) {us / 1e3:.3f} ms" for n, op, us in p["top_nodes"][:6]))
    if a.json:
        Path(a.json).write_text(json.dumps(p, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
