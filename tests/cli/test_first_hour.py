# SPDX-License-Identifier: Apache-2.0
"""What a new user meets in the first hour, run as a user runs it (a subprocess, output not a terminal):
``generate --press none`` keeps every token, no library progress bars or warnings on stderr, the validate
table is not cut when piped."""

from __future__ import annotations

import os
import subprocess
import sys

from kvexport.paths import DEFAULT_MODEL

NOISE = ("Loading weights", "Removed shared tensor", "Writing model shards")


def _kvexport(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    return subprocess.run([sys.executable, "-m", "kvexport", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_generate_press_none_keeps_every_token():
    r = _kvexport("generate", str(DEFAULT_MODEL), "--press", "none", "-p", "def parse(", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert "'def parse(' ->" in r.stdout and "press=none budget=None" in r.stdout
    for n in NOISE:
        assert n not in r.stderr, r.stderr


def test_generate_with_a_press_defaults_its_budget():
    r = _kvexport("generate", str(DEFAULT_MODEL), "--press", "knorm", "-p", "import os", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert "press=knorm budget=256" in r.stdout


def test_generate_reports_the_quantized_cache_as_held():
    """The memory line of an int8 run counts the codes, their scales and every other resident buffer. By hand for
    the student (4 layers, 2 KV heads, 4 query heads, head_dim 32), budget 8 + window 2 = 10 slots: codes
    4 x 2 (K, V) x 2 x 10 x 32 x 1 B = 5120 B; scales 4 x 2 x 2 x 10 x 2 B = 320 B; int64 positions
    4 x 2 x 10 x 8 = 640 B; fp32 query ring 4 heads x 2 x 32 x 4 layers x 4 B = 4096 B and its positions 2 x 8 B:
    10 192 B."""
    r = _kvexport("generate", str(DEFAULT_MODEL), "--press", "knorm", "--budget", "8", "--window", "2",
                  "--kv-dtype", "int8", "-p", "import os", "-n", "4")
    assert r.returncode == 0, r.stderr
    line = " ".join(r.stdout.split())
    assert f"cache {5440 / 1024:.1f} KiB (K/V {5120 / 1024:.1f} + scales {320 / 1024:.1f}), " \
           f"{10192 / 1024:.1f} KiB resident" in line, line


def test_bad_kv_dtype_is_one_line(tmp_path):
    """An unknown --kv-dtype: one line naming the accepted formats, a non-zero exit, no traceback, nothing
    written."""
    out = tmp_path / "x"
    for args in (("export", str(DEFAULT_MODEL), "--out", str(out), "--press", "knorm", "--budget", "8",
                  "--kv-dtype", "int4"),
                 ("generate", str(DEFAULT_MODEL), "-p", "x", "-n", "1", "--kv-dtype", "int4")):
        r = _kvexport(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "--kv-dtype 'int4' unknown" in lines[0], r.stderr
        for name in ("fp32", "fp16", "bf16", "int8", "fp8"):
            assert name in lines[0]
    assert not out.exists()
