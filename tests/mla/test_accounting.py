# SPDX-License-Identifier: Apache-2.0
"""Cache accounting: X-EcoMLA's ratio table for the Llama-3.2-1B shape (from a config alone), budgets, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvexport.cli import app
from kvexport.mla import MLASettings, rewrite_to_mla, save_mla
from kvexport.mla.accounting import cache_report
from kvexport.models.decoder import Decoder

# REFERENCE.md §2: r_kv -> ratio, d_rope 32, 2·8·64 = 1024 elements per token and layer originally
TABLE = {48: 12.8, 64: 10.67, 128: 6.4, 256: 3.56, 512: 1.88}


@pytest.fixture(scope="module")
def llama_1b_dir(tmp_path_factory):
    """The Llama-3.2-1B shape as a config.json only (no weights: accounting needs none)."""
    import transformers as tf

    d = tmp_path_factory.mktemp("llama-3.2-1b-shape")
    tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                   tie_word_embeddings=True, dtype="bfloat16").save_pretrained(d)
    return d


@pytest.mark.parametrize("rank,ratio", sorted(TABLE.items()))
def test_ratio_table_cli(llama_1b_dir, rank, ratio):
    res = CliRunner().invoke(app, ["inspect", str(llama_1b_dir), "--mla-rank", str(rank), "--rope-dim", "32",
                                   "--context", "2048", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["original_elements_per_token_layer"] == 1024
    assert d["elements_per_token_layer"] == [rank + 32] * 16
    assert round(d["ratio"], 2) == ratio and round(d["per_token_ratio"], 2) == ratio
    assert d["bytes_per_element"] == 2  # bfloat16 from the config
    assert d["bytes_per_token"] == 16 * (rank + 32) * 2
    assert d["original_bytes_per_sequence"] == 2048 * 16 * 1024 * 2
    assert d["bytes_per_sequence"] == 2048 * 16 * (rank + 32) * 2


def test_budget_and_window(llama_1b_dir):
    """A static budget holds budget + window slots whatever the context; ratios multiply."""
    res = CliRunner().invoke(app, ["inspect", str(llama_1b_dir), "--mla-rank", "64", "--rope-dim", "32",
                                   "--budget", "480", "--window", "32", "--context", "8192", "--json"])
    d = json.loads(res.output)
    assert d["tokens_held"] == 512
    assert d["bytes_per_sequence"] == 512 * 16 * 96 * 2
    assert d["ratio"] == pytest.approx(1024 / 96 * 8192 / 512)
    plain = json.loads(CliRunner().invoke(app, ["inspect", str(llama_1b_dir), "--budget", "480", "--context",
                                                "8192", "--json"]).output)
    assert plain["ratio"] == pytest.approx(16.0) and plain["elements_per_token_layer"] == [1024] * 16


def test_inspect_saved_mla_dir_matches_its_cache(tiny_models, tmp_path):
    """For a saved MLA model the accounting equals the bytes its real static cache allocates."""
    mla = rewrite_to_mla(Decoder.from_hf(tiny_models("qwen2")), MLASettings(energy=0.9, rope_dim=8))
    save_mla(mla, tmp_path / "m")
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "m"), "--budget", "20", "--window", "4",
                                   "--dtype", "float32", "--json"])
    d = json.loads(res.output)
    assert d["elements_per_token_layer"] == [p.kv_rank + 8 for p in mla.mla_plans]
    cache = mla.new_cache(1, None, 20, 4)
    assert d["bytes_per_sequence"] == cache.nbytes()
    assert cache_report(mla.spec, mla_ranks=[p.kv_rank for p in mla.mla_plans], rope_dim=8, context=24,
                        dtype="float32").bytes_per_element == torch.float32.itemsize


def test_inspect_energy_uses_the_weights(tmp_path):
    """--mla-energy reads the weights: per-layer elements = the ranks the rewrite picks + d_rope."""
    from kvexport.mla.io import load_decoder
    from kvexport.models.tiny import tiny_model

    tiny_model("mistral", seed=4).save_pretrained(tmp_path / "hf")
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "hf"), "--mla-energy", "0.7", "--rope-dim", "8",
                                   "--json"])
    d = json.loads(res.output[res.output.index("{"):])
    plans = rewrite_to_mla(load_decoder(tmp_path / "hf")[0], MLASettings(energy=0.7, rope_dim=8)).mla_plans
    assert d["elements_per_token_layer"] == [p.kv_rank + 8 for p in plans]
    assert d["mla"]["energy"] == 0.7


def test_report_by_hand_and_inspect_text(llama_1b_dir):
    """Numbers written out: r_kv 224 + d_rope 32 = 256 of 1024 elements, bf16, 16 layers, context 2048.
    K/V 2048 x 16 x 256 x 2 = 16,777,216 bytes (original 67,108,864); resident adds the int64 positions of a
    growing cache, 2048 x 8 = 16,384. With budget 480 + window 32 the MLA cache holds 512 slots: 4,194,304 bytes."""
    from kvexport.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config(__import__("transformers").AutoConfig.from_pretrained(llama_1b_dir))
    d = cache_report(spec, mla_ranks=[224], rope_dim=32, context=2048, dtype="bfloat16").to_dict()
    assert (d["bytes_per_token"], d["original_bytes_per_token"]) == (8_192, 32_768)
    assert (d["bytes_per_sequence"], d["original_bytes_per_sequence"]) == (16_777_216, 67_108_864)
    assert (d["resident_bytes"], d["original_resident_bytes"]) == (16_793_600, 67_125_248)
    assert d["ratio"] == d["per_token_ratio"] == 4.0
    b = cache_report(spec, mla_ranks=[224], rope_dim=32, context=8192, budget=480, window=32, dtype="bfloat16")
    assert b.tokens_held == 512 and b.to_dict()["bytes_per_sequence"] == 4_194_304
    res = CliRunner().invoke(app, ["inspect", str(llama_1b_dir), "--mla-rank", "224", "--rope-dim", "32",
                                   "--context", "2048"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "4.00x (per token 4.00x)" in res.output
    assert "resident bytes / sequence" in res.output
    assert "16,793,600" in res.output and "67,125,248" in res.output
