# SPDX-License-Identifier: Apache-2.0
"""The convert stages' calls into kvexport.export: the converted export and the baseline, in this process or in a
child (:data:`CHILD_EXPORT_BYTES`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvexport import layout

#: checkpoints at least this large (bytes, in their own dtype) are exported in a child process (kvexport.convert.isolate):
#: the exporter's libraries and graphs leave ≈ 0.2-0.35 GB in the process that exports (a 12- to 28-layer Qwen3), which
#: validate and profile would otherwise start with; below it, starting a process costs more time than it saves memory
CHILD_EXPORT_BYTES = 256 * 2**20


def export_in_child(st) -> bool:
    """Whether this conversion's exports run in a child process (:data:`CHILD_EXPORT_BYTES`)."""
    return int(st.notes.get("weight_bytes") or 0) >= CHILD_EXPORT_BYTES


def converted_job(st, in_memory: bool = True) -> tuple[Any, Path, dict[str, Any]]:
    """(model, out, export_model keywords) of DIR/onnx: the MLA decoder (when rewritten) or the source model, with
    the press's static cache and the weight format (``--weights``). ``in_memory=False`` names the saved MLA directory instead of the decoder in memory
    (for a child process: the same weights, memory-mapped)."""
    cfg = st.cfg
    mla_dir = st.work / layout.MLA_DIR
    if not cfg.uses_mla:
        model, source = st.model_path, None
    elif in_memory and st.mla_decoder is not None:
        model, source = st.mla_decoder, mla_dir
    else:  # written by the rewrite (or distill) stage
        model, source = mla_dir, None
    kw = dict(export_settings(cfg), ops="custom", force=False, source=source, tokenizer_dir=st.model_path,
              original=st.model_path)
    return model, st.work / layout.ONNX_DIR, kw


def export_settings(cfg) -> dict[str, Any]:
    """The ``export_model`` keywords that a resolved :class:`~kvexport.convert.config.ConvertConfig` sets: press
    (with its budget and neighbours), window, chunk, lookahead, batched decode rows, dtype, capacity, cache format
    and weight format. What DIR/onnx is exported with, and what the benchmark's ``kvx-default`` rows export."""
    press = None
    if cfg.uses_press:
        from kvexport.presses import make_press

        press = make_press(cfg.press, budget=cfg.budget, neighbors=int(cfg.neighbors or 0))
    return dict(press=press, budget=None, window=cfg.window if press else 32, chunk=cfg.chunk,
                lookahead=int(cfg.lookahead or 0) if press else 0, batch=1,
                decode_batch=int(cfg.decode_batch) if cfg.decode_batch else None,
                dtype="fp16" if cfg.fp16 else "fp32", max_positions=cfg.max_positions, kv_dtype=cfg.kv_dtype,
                weights=cfg.weights)


def baseline_job(st) -> tuple[Any, Path, dict[str, Any]]:
    """(model, out, export_model keywords) of DIR/baseline: the original model, full cache with a growing past
    (``--press none --dynamic-cache``)."""
    kw = dict(press=None, chunk=st.cfg.chunk, dtype="fp16" if st.cfg.fp16 else "fp32", dynamic_cache=True,
              ops="custom", force=False)
    return st.model_path, st.work / layout.BASELINE_DIR, kw


def run_jobs(jobs: list[tuple[Any, Path, dict[str, Any]]], progress=None) -> list[str]:
    """Export each (model, out, keywords) in turn, memory given back after each; -> the output directories.
    What :func:`kvexport.convert.isolate.call_in_child` runs (module level, plain arguments)."""
    from kvexport.export import export_model
    from kvexport.models.release import free_memory
    from kvexport.quiet import quiet_libraries

    quiet_libraries()  # in a child process too: no library progress bars between the stage lines
    outs = []
    for model, out, kw in jobs:
        outs.append(str(export_model(model, out, progress=progress, **kw)))
        del model
        free_memory()
    return outs


__all__ = ["CHILD_EXPORT_BYTES", "export_in_child", "converted_job", "export_settings", "baseline_job", "run_jobs"]
