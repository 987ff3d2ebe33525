# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert``: one command from a Hugging Face checkpoint to validated, profiled artifacts.

:class:`ConvertConfig` holds and checks the settings, :func:`run_convert` runs the stages
(:mod:`kvexport.convert.stages`); :mod:`kvexport.layout` says what the output directory holds.
"""

from __future__ import annotations

from kvexport.convert.config import ConvertConfig, parse_contexts
from kvexport.layout import BASELINE_DIR, CONVERT_JSON, ENGINE_DIR, MLA_DIR, ONNX_DIR, PARITY_JSON, PROFILE_JSON


def run_convert(*args, **kwargs):
    """See :func:`kvexport.convert.stages.run_convert` (imported lazily: it pulls in torch)."""
    from kvexport.convert.stages import run_convert as _run

    return _run(*args, **kwargs)


__all__ = ["ConvertConfig", "parse_contexts", "run_convert", "CONVERT_JSON", "ONNX_DIR", "BASELINE_DIR", "ENGINE_DIR",
           "MLA_DIR", "PARITY_JSON", "PROFILE_JSON"]
