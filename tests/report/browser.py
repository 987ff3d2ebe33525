# SPDX-License-Identifier: Apache-2.0
"""Headless Chromium for the report tests: dump the DOM after scripts ran, take screenshots."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--virtual-time-budget=5000"]


def find_chromium() -> str | None:
    for name in CANDIDATES:
        p = shutil.which(name)
        if p:
            return p
    return None


def _run(args: list[str], timeout: int = 90) -> subprocess.CompletedProcess:
    exe = find_chromium()
    assert exe is not None
    with tempfile.TemporaryDirectory(prefix="kvx-chromium-") as ud:
        return subprocess.run([exe, *FLAGS, f"--user-data-dir={ud}", *args], capture_output=True, text=True,
                              timeout=timeout)


def dump_dom(page: Path) -> str:
    """The page's DOM after its load handlers ran (``--dump-dom``)."""
    r = _run(["--dump-dom", page.resolve().as_uri()])
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def screenshot(page: Path, out: Path, width: int = 1280, height: int = 2000) -> Path:
    r = _run([f"--window-size={width},{height}", f"--screenshot={out.resolve()}", page.resolve().as_uri()])
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    return out
