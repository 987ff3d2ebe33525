# SPDX-License-Identifier: Apache-2.0
"""Quiet libraries: what kvexport's commands (and their child processes) switch off before any work."""

from __future__ import annotations

import logging
import os
import sys


def quiet_libraries() -> None:
    """No progress bars or chatter from the libraries kvexport drives: transformers' ``Loading weights`` bar
    (it reads HF_HUB_DISABLE_PROGRESS_BARS when imported; switched off directly when already imported) and
    accelerate's ``Removed shared tensor`` warning when a checkpoint of a model with tied weights is saved."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)


__all__ = ["quiet_libraries"]
