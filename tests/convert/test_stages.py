# SPDX-License-Identifier: Apache-2.0
"""Single convert stages on a tiny model: rewrite and distill write the MLA directory they promise."""

from __future__ import annotations

import json

import pytest
import torch

from kvexport.convert.config import ConvertConfig


@pytest.fixture
def state(tiny_hf_dir, tmp_path):
    from kvexport.convert.stages import ConvertState, resolve_settings, stage_load

    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    cfg = ConvertConfig(model=str(tiny_hf_dir), mla_rank=16, rope_dim=8, distill_teacher=str(tiny_hf_dir),
                        distill_data=str(data), distill_tokens=256)
    cfg, path, spec = resolve_settings(cfg)
    work = tmp_path / "work"
    work.mkdir()
    st = ConvertState(cfg=cfg, model_path=path, work=work, spec=spec)
    stage_load(st)
    return st


def test_rewrite_then_distill(state):
    from kvexport.convert.stages import stage_distill, stage_rewrite
    from kvexport.mla.io import load_mla

    note = stage_rewrite(state)
    assert "r_kv 16" in note and (state.work / "mla" / "kvexport_mla.json").is_file()
    before = load_mla(state.work / "mla")
    ids = torch.arange(3, 40)[None]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ref = before(ids, pos)
    # the saved MLA model is the rewritten decoder
    with torch.no_grad():
        torch.testing.assert_close(state.mla_decoder(ids, pos), ref)
    note = stage_distill(state)
    assert "tokens from tiny-llama" in note
    summary = json.loads((state.work / "distill_summary.json").read_text())
    assert summary["tokens"] >= 256 and summary["steps"] >= 1
    assert not (state.work / "distill").exists()
    after = load_mla(state.work / "mla")
    with torch.no_grad():
        out = after(ids, pos)
        torch.testing.assert_close(state.mla_decoder(ids, pos), out)
    assert not torch.allclose(out, ref)  # the weights were trained


def test_energy_rank_per_layer(tiny_hf_dir, tmp_path):
    """--mla-energy δ: per-layer ranks from the SVD energy, recorded in convert.json's notes and DIR/mla."""
    from kvexport.convert.stages import ConvertState, resolve_settings, stage_load, stage_rewrite
    from kvexport.mla.io import read_mla_config
    from kvexport.profile.run import cache_shape_of

    cfg, path, spec = resolve_settings(ConvertConfig(model=str(tiny_hf_dir), mla_energy=0.5))
    assert cfg.rope_dim == 16 and cfg.mla_rank is None  # d_rope = head_dim (16)
    work = tmp_path / "w"
    work.mkdir()
    st = ConvertState(cfg=cfg, model_path=path, work=work, spec=spec)
    stage_load(st)
    stage_rewrite(st)
    ranks = [layer["kv_rank"] for layer in read_mla_config(work / "mla")["layers"]]
    assert st.notes["mla_ranks"] == ranks and all(r % 8 == 0 for r in ranks)
    shape = cache_shape_of(work, cfg.to_dict(), spec)
    assert shape.bytes_per_token() == sum(r + 16 for r in ranks) * 4  # fp32 latent + d_rope per layer


def test_rewrite_with_refit(tiny_hf_dir, tmp_path):
    """--refit-steps: the rewrite stage fits every layer on the bundled calibration text, says so in its line, and
    keeps the per-layer numbers in DIR/refit.json; DIR/mla is the fitted model."""
    from kvexport.convert.stages import ConvertState, resolve_settings, stage_load, stage_rewrite
    from kvexport.layout import REFIT_JSON
    from kvexport.mla.io import load_mla

    cfg, path, spec = resolve_settings(ConvertConfig(model=str(tiny_hf_dir), mla_rank=8, rope_dim=4, refit_steps=5))
    work = tmp_path / "w"
    work.mkdir()
    st = ConvertState(cfg=cfg, model_path=path, work=work, spec=spec)
    stage_load(st)
    note = stage_rewrite(st)
    fit = json.loads((work / REFIT_JSON).read_text())
    assert f"refit 5 steps x {spec.num_layers} layers on 2048 tokens" in note
    assert len(fit["layers"]) == spec.num_layers and fit["steps"] == 5 and fit["tokens"] == 2048
    assert all(r["loss_after"] <= r["loss_before"] for r in fit["layers"])
    assert any(r["fitted"] for r in fit["layers"])
    assert st.notes["refit"]["loss_after"] == fit["loss_after"]
    ids = torch.arange(3, 40)[None]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(load_mla(work / "mla")(ids, pos), st.mla_decoder(ids, pos))
