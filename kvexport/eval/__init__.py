# SPDX-License-Identifier: Apache-2.0
"""Quality studies on trained models: press discrepancy vs compression ratio (Expected Attention), MLA
accuracy vs compression per teacher (X-EcoMLA), eviction + MLA at equal memory, and an lm-eval adapter."""

from __future__ import annotations

from kvexport.eval.combo import combo_study, combo_table
from kvexport.eval.data import corpus_files, heldout_stream, heldout_windows, train_tokens
from kvexport.eval.mla_study import DistillSettings, MLAStudy, mla_study, ranks_for_ratios
from kvexport.eval.plots import plot_mla_study, plot_press_study
from kvexport.eval.press_study import STUDY_PRESSES, PressStudy, press_study, run_window
from kvexport.eval.tasks import TASKS, TaskSet, TaskSettings, evaluate_tasks, exact_match, extract_answer

__all__ = [
    "STUDY_PRESSES",
    "TASKS",
    "DistillSettings",
    "MLAStudy",
    "PressStudy",
    "TaskSet",
    "TaskSettings",
    "combo_study",
    "combo_table",
    "corpus_files",
    "evaluate_tasks",
    "exact_match",
    "extract_answer",
    "heldout_stream",
    "heldout_windows",
    "mla_study",
    "plot_mla_study",
    "plot_press_study",
    "press_study",
    "ranks_for_ratios",
    "run_window",
    "train_tokens",
]
