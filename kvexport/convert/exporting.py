# SPDX-License-Identifier: Apache-2.0
"""The convert stages' calls into kvexport.export: the converted export and the baseline."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from kvexport.convert import layout


def _kwargs(fn, **kw) -> dict[str, Any]:
    """Only the keyword arguments ``fn`` accepts (keeps convert working across small API changes)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def export_converted(st) -> Path:
    """DIR/onnx: the MLA decoder (when rewritten) or the source model, with the press's static cache."""
    from kvexport.export import export_model

    cfg = st.cfg
    model = st.mla_decoder if st.mla_decoder is not None else st.model_path
    press = cfg.press if cfg.uses_press else None
    kw = _kwargs(export_model, press=press, budget=cfg.budget if press else None,
                 window=cfg.window if press else 32, chunk=cfg.chunk, dtype="fp16" if cfg.fp16 else "fp32",
                 ops="custom", force=False, max_positions=cfg.max_positions, kv_dtype=cfg.kv_dtype,
                 source=st.work / layout.MLA_DIR if st.mla_decoder is not None else None,
                 tokenizer_dir=st.model_path, original=st.model_path, progress=getattr(st, "progress", None))
    return export_model(model, st.work / layout.ONNX_DIR, **kw)


def export_baseline(st) -> Path:
    """DIR/baseline: the original model, full cache with a growing past (``--press none --dynamic-cache``)."""
    from kvexport.export import export_model

    kw = _kwargs(export_model, press=None, chunk=st.cfg.chunk, dtype="fp16" if st.cfg.fp16 else "fp32",
                 dynamic_cache=True, ops="custom", force=False, progress=getattr(st, "progress", None))
    return export_model(st.model_path, st.work / layout.BASELINE_DIR, **kw)


__all__ = ["export_converted", "export_baseline"]
