# SPDX-License-Identifier: Apache-2.0
"""``kvexport inspect`` on an export and on a conversion's export: the cache as exported, held to what the runtime
itself allocates for a sequence, and to the full cache worked out by hand from the model's config."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvexport.cli import main
from tests.hardening.conftest import run_cli


def _inspect(path, capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["inspect", str(path), "--json", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("prompt_tokens", [5, 60])
def test_inspect_export_is_what_the_runtime_holds(export_dir, model_dir, prompt_tokens, capsys):
    from kvexport.cli.export_cmds import open_generator

    new = 3
    gen = open_generator(export_dir)
    ids = (np.arange(prompt_tokens, dtype=np.int64) % 200 + 10)[None]
    res = gen.generate(ids, np.ones_like(ids), new, eos_token_id=None, track_kept=False)
    assert res.tokens.shape[1] == new
    # the runtime's resident bytes are measured from its own buffers after the last step: the cache then holds
    # prompt + new - 1 tokens (the last token is returned, not yet fed)
    d = _inspect(export_dir, capsys, "--context", prompt_tokens + new - 1)
    assert d["resident_bytes"] == {k: int(v) for k, v in res.resident_bytes.items()}
    assert d["press"] == "streaming_llm" and d["budgets"] == [16, 16] and d["window"] == 8
    # the full cache by hand from config.json: keys and values, every KV head, fp32, every token of the context
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    assert d["original_bytes_per_token"] == per_token
    assert d["original_bytes_per_sequence"] == per_token * (prompt_tokens + new - 1)
    assert d["bytes_per_sequence"] == d["resident_bytes"]["kv"] + d["resident_bytes"]["scales"]


def test_inspect_a_conversion_reads_its_onnx_dir(export_dir, tmp_path, capsys):
    conv = tmp_path / "conv"
    conv.mkdir()
    shutil.copytree(export_dir, conv / "onnx")
    assert _inspect(conv, capsys, "--context", 100) == {**_inspect(export_dir, capsys, "--context", 100),
                                                       "export": str(conv)}
    capsys.readouterr()
    assert main(["inspect", str(conv)]) == 0  # the table
    out = capsys.readouterr().out
    assert "this export" in out and "streaming_llm, budget 16 + window 8" in out


@pytest.mark.parametrize("flag", [["--budget", "8"], ["--mla-rank", "4"], ["--dtype", "float16"], ["--window", "4"]])
def test_inspect_export_refuses_sizing_flags(export_dir, flag, capsys):
    rc, err = run_cli(["inspect", export_dir, *flag], capsys)
    assert rc == 2 and len(err) == 1 and "is an export" in err[0] and flag[0] in err[0], err
