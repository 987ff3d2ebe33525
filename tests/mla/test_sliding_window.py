# SPDX-License-Identifier: Apache-2.0
"""The MLA attention attends to every cached token, so a model whose layers use a sliding window is refused
(one line, BadModel naming sliding_window) rather than rewritten into a model that would ignore the window:
Mistral (sliding_window on every layer), Qwen2 (the layers past max_window_layers), Qwen3."""

from __future__ import annotations

import pytest

from kvexport.errors import BadModel
from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model

CASES = {
    "mistral": ("mistral", dict(sliding_window=16)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, head_dim=32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_windowed_model_is_refused(name):
    family, kw = CASES[name]
    hf = tiny_model(family, **kw)
    spec = Decoder.from_hf(hf).spec
    assert any(spec.sliding_window_of(i) == 16 for i in range(spec.num_layers))
    for model in (hf, Decoder.from_hf(hf)):
        with pytest.raises(BadModel, match="sliding_window") as err:
            rewrite_to_mla(model, MLASettings(kv_rank=16, rope_dim=8))
        assert "\n" not in str(err.value)
        assert "window 16" in str(err.value)


@pytest.mark.parametrize("name", list(CASES))
def test_same_family_without_window_is_rewritten(name):
    family, kw = CASES[name]
    kw = {k: v for k, v in kw.items() if k == "head_dim"}
    mla = rewrite_to_mla(tiny_model(family, **kw), MLASettings(kv_rank=16, rope_dim=8))
    assert mla.layers[0].self_attn.key_dim == 24


def test_cli_refuses_a_windowed_model(tmp_path, capsys):
    from kvexport.cli import main

    tiny_model("mistral", sliding_window=16).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["rewrite", str(tmp_path / "hf"), "--mla-rank", "16", "--rope-dim", "8", "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert code == 3 and len(err) == 1 and err[0].startswith("error: ") and "sliding_window" in err[0], err
    assert not (tmp_path / "o").exists()
