# SPDX-License-Identifier: Apache-2.0
"""``kvexport generate`` piped (not a terminal, no COLUMNS): each completion is one line however long, and a prompt
or completion that looks like Rich markup (``[bold]``, ``[/]``) is printed as it is. The printed completion is the
library's greedy generation decoded by the tokenizer (kvexport.generation.generate, called here)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "[bold]x[/bold] = [i for i in range(3)] + [/] and"  # markup-like on purpose
N = 96  # far past 80 columns


def test_piped_completion_is_one_line_as_generated():
    import torch

    from kvexport.cli.generate_cmd import DEFAULT_BUDGET
    from kvexport.generation import generate
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import load_tokenizer
    from kvexport.paths import DEFAULT_MODEL
    from kvexport.presses import make_press

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    r = subprocess.run([sys.executable, "-m", "kvexport", "generate", "-p", PROMPT, "-n", str(N)], capture_output=True,
                       text=True, timeout=600, env={**env, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"{N} tokens in "), r.stdout
    head = f"{PROMPT!r} -> "
    assert lines[0].startswith(head), lines[0]
    printed = ast.literal_eval(lines[0][len(head):])
    tok = load_tokenizer(DEFAULT_MODEL)
    decoder, _ = load_decoder(DEFAULT_MODEL)
    ids = torch.tensor([tok(PROMPT, add_special_tokens=True)["input_ids"]])
    res = generate(decoder, ids, press=make_press("snapkv", budget=DEFAULT_BUDGET), window=32,
                   max_new_tokens=N, eos_token_id=tok.eos_token_id)
    want = tok.decode(res.tokens[0].tolist())
    assert printed == want and len(lines[0]) > 80
