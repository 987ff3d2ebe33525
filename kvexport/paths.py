# SPDX-License-Identifier: Apache-2.0
"""Where the bundled reference models live."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_MODEL = MODELS_DIR / "kvx-student"
