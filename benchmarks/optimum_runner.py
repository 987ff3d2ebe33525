# SPDX-License-Identifier: Apache-2.0
"""The Optimum row's timed cells, run by the Optimum venv's python (imports no kvexport; from the benchmarks only
:mod:`benchmarks.proc`, which needs NumPy and psutil).

    <venv>/bin/python benchmarks/optimum_runner.py '<json spec>'

Loads Optimum's export with ``ORTModelForCausalLM`` (what Optimum's docs show users) and times ``generate`` exactly
like the HF row (:func:`benchmarks.proc.generate_cell`, the protocol of :mod:`benchmarks.proc`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.proc (NumPy and psutil only)
from benchmarks.proc import generate_cell, serve_cells  # noqa: E402


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    threads = int(spec.get("threads") or 1)
    torch.set_num_threads(threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    model = ORTModelForCausalLM.from_pretrained(spec["export_dir"], provider="CPUExecutionProvider", use_cache=True,
                                                session_options=so)
    return serve_cells(generate_cell(model, spec), spec)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
