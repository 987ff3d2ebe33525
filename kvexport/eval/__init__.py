# SPDX-License-Identifier: Apache-2.0
"""Quality studies on trained models: press discrepancy vs compression ratio (more to come)."""

from __future__ import annotations

from kvexport.eval.data import corpus_files, heldout_stream, heldout_windows
from kvexport.eval.press_study import STUDY_PRESSES, PressStudy, plot_press_study, press_study, run_window

__all__ = [
    "STUDY_PRESSES",
    "PressStudy",
    "corpus_files",
    "heldout_stream",
    "heldout_windows",
    "plot_press_study",
    "press_study",
    "run_window",
]
