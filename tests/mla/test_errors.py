# SPDX-License-Identifier: Apache-2.0
"""Bad input: one clear line, the right exit code, nothing written."""

from __future__ import annotations

import pytest
import torch

from kvexport.cli import main
from kvexport.errors import BadModel, BadUsage
from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.models.decoder import Decoder


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.mla.distill_fixtures import make_text, model_dir

    d = tmp_path_factory.mktemp("bad")
    model_dir(d / "hf")  # llama: hidden 64, 2 KV heads, head_dim 16 -> max r_kv min(64, 2*32 - 8) = 56 at d_rope 8
    from kvexport.models.tiny import tiny_model

    tiny_model("llama", vocab_size=96).save_pretrained(d / "other_vocab")
    (d / "data.txt").write_text(make_text(400, 3))
    (d / "empty.txt").write_text("")
    return d


CASES = [
    (["rewrite", "{hf}", "--mla-rank", "57", "--rope-dim", "8"], 2, "larger than the rank of the stacked no-RoPE"),
    (["rewrite", "{hf}", "--mla-rank", "16", "--rope-dim", "7"], 2, "must be even"),
    (["rewrite", "{hf}", "--mla-rank", "16", "--rope-dim", "34"], 2, "larger than the model's n_kv * head_dim 32"),
    (["rewrite", "{hf}", "--mla-rank", "16", "--rope-dim", "18", "--rope-init", "xeco"], 2,
     "larger than the model's head_dim 16"),
    (["rewrite", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--rope-init", "pca"], 2, "rope init 'pca' unknown"),
    (["rewrite", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--kv-fit", "x"], 2, "latent fit 'x' unknown"),
    (["rewrite", "{hf}", "--mla-energy", "0", "--rope-dim", "8"], 2, "outside (0, 1]"),
    (["rewrite", "{hf}", "--mla-energy", "1.5", "--rope-dim", "8"], 2, "outside (0, 1]"),
    (["rewrite", "{hf}", "--rope-dim", "8"], 2, "exactly one of"),
    (["rewrite", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--refit-steps", "-1"], 2,
     "--refit-steps -1 must be >= 0"),
    (["rewrite", "{d}/nope", "--mla-rank", "8", "--rope-dim", "8"], 3, "does not exist"),
    (["distill", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--teacher", "{d}/other_vocab", "--data",
      "{d}/data.txt", "--tokens", "64", "--seq-len", "16"], 3, "teacher vocabulary (96 tokens) differs"),
    (["distill", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--teacher", "{hf}", "--data", "{d}/missing.txt",
      "--tokens", "64"], 2, "does not exist"),
    (["distill", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--teacher", "{hf}", "--data", "{d}/empty.txt",
      "--tokens", "64"], 2, "is empty"),
    (["distill", "{hf}", "--teacher", "{hf}", "--data", "{d}/data.txt", "--tokens", "64"], 2, "not an MLA directory"),
    (["distill", "{hf}", "--mla-rank", "16", "--rope-dim", "8", "--teacher", "{hf}", "--data", "{d}/data.txt",
      "--tokens", "64", "--resume"], 2, "no checkpoint"),
    (["inspect", "{hf}", "--rope-dim", "8"], 2, "--rope-dim needs --mla-rank"),
    (["inspect", "{hf}", "--mla-rank", "8", "--rope-dim", "8", "--context", "0"], 2, "--context 0"),
]


@pytest.mark.parametrize("argv,code,text", CASES, ids=[f"{c[0][0]}-{c[2][:24]}" for c in CASES])
def test_cli_bad_input(dirs, tmp_path, capsys, argv, code, text):
    out = tmp_path / "out"
    argv = [a.format(hf=dirs / "hf", d=dirs) for a in argv]
    if argv[0] in ("rewrite", "distill"):
        argv += ["--out", str(out)]
    rc = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert rc == code, err
    assert len(err) == 1 and err[0].startswith("error: ") and text in err[0], err
    assert not out.exists()  # nothing half-written


def test_model_without_rope(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    dec.rotary = None
    with pytest.raises(BadModel, match="no RoPE"):
        rewrite_to_mla(dec, MLASettings(kv_rank=8, rope_dim=8))


def test_hf_config_without_rope_is_refused(tmp_path):

    from kvexport.models.spec import ModelSpec

    cfg = type("Cfg", (), dict(model_type="llama", vocab_size=8, hidden_size=8, num_hidden_layers=1,
                               num_attention_heads=1, intermediate_size=8, rope_parameters=None, rope_theta=None))
    with pytest.raises(BadModel, match="no RoPE"):
        ModelSpec.from_hf_config(cfg)


def test_rank_too_large_api(tiny_models):
    with pytest.raises(BadUsage, match="stacked no-RoPE keys and values"):
        rewrite_to_mla(tiny_models("llama"), MLASettings(kv_rank=57, rope_dim=8))
    mla = rewrite_to_mla(tiny_models("llama"), MLASettings(kv_rank=56, rope_dim=8))
    assert mla.mla_plans[0].kv_rank == 56 and torch.is_tensor(mla.rotary.inv_freq)
