# SPDX-License-Identifier: Apache-2.0
"""The MLA study's rank choice (against X-EcoMLA's table), the combination's equal-memory plan, and the
distillation-budget bookkeeping on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvexport.eval.combo import combo_plan, context_elements
from kvexport.eval.mla_study import DistillSettings, default_rope_dim, distilled_students, ranks_for_ratios
from kvexport.models.spec import ModelSpec


def _spec(heads, kv, d, hidden, layers):
    return ModelSpec(model_type="llama", vocab_size=128, hidden_size=hidden, intermediate_size=4 * hidden,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=d, rms_norm_eps=1e-5,
                     max_position_embeddings=4096, rope={"rope_theta": 1e4, "rope_type": "default"})


def test_ranks_reproduce_xecomla_table_for_llama_3_2_1b():
    """Llama-3.2-1B (8 KV heads, d_h 64, d_rope 32): r_kv 512/256/128/64/48 -> 1.88/3.56/6.4/10.67/12.8x."""
    plan = ranks_for_ratios(_spec(32, 8, 64, 2048, 16), rope_dim=32)
    assert [p["kv_rank"] for p in plan] == [512, 256, 128, 64, 48]
    assert [p["ratio"] for p in plan] == pytest.approx([1024 / 544, 1024 / 288, 6.4, 1024 / 96, 12.8])
    assert default_rope_dim(_spec(32, 8, 64, 2048, 16)) == 32


def test_ranks_for_the_student_shape():
    """The student (2 KV heads, d_h 32): 128 elements per token and layer, d_rope 4, ranks = the paper's / 8."""
    spec = _spec(4, 2, 32, 128, 4)
    assert default_rope_dim(spec) == 4
    plan = ranks_for_ratios(spec)
    assert [p["kv_rank"] for p in plan] == [64, 32, 16, 8, 6]
    for p in plan:
        assert p["ratio"] == pytest.approx(128 / (p["kv_rank"] + 4))
        assert abs(p["ratio"] - p["target"]) / p["target"] < 0.03


def test_combo_rows_hold_equal_memory():
    spec = _spec(4, 2, 32, 128, 4)
    plan = {p["target"]: p for p in ranks_for_ratios(spec, (1.882, 3.556, 6.4, 12.8))}
    P, orig = 192, 128
    rows = combo_plan(P, orig, plan, (3.556, 6.4, 12.8), "knorm")
    full = context_elements(spec, orig, P)
    assert full == 4 * 128 * 192
    by_target: dict = {}
    for r in rows:
        by_target.setdefault(r["target"], []).append(r)
        mem = context_elements(spec, r["per_token_layer"], r["kept"])
        assert full / mem == pytest.approx(r["target"], rel=0.03), r  # equal memory up to rounding of b
    assert [len(v) for v in by_target.values()] == [3, 4, 5]  # eviction, MLA, MLA(milder) + eviction
    ev = [r for r in rows if r["mla"] is None]
    assert [r["kept"] for r in ev] == [round(192 / (128 / 36)), round(192 / 6.4), round(192 / 12.8)]
    mla_only = [r for r in rows if r["mla"] is not None and r["kept"] == P]
    assert [r["kv_rank"] for r in mla_only] == [32, 16, 6]


def test_distilled_budgets_pass_through_and_cache(tmp_path, tiny_models):
    """The run to the larger budget passes through the smaller: its checkpoint equals a separate run with the
    smaller budget; a second call returns the cached models without training."""
    from kvexport.mla.io import load_mla

    hf = tiny_models("llama")
    src = tmp_path / "m"
    hf.save_pretrained(src)
    ids = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(0))
    ds = DistillSettings(budgets=(128, 256), seq_len=32, batch_size=2, lr=1e-3)
    dirs = distilled_students(str(src), str(src), 8, 4, ds, ids, tmp_path / "c")
    one = distilled_students(str(src), str(src), 8, 4, DistillSettings(budgets=(128,), seq_len=32, batch_size=2,
                                                                       lr=1e-3), ids, tmp_path / "c1")
    a, b = load_mla(dirs[128]).state_dict(), load_mla(one[128]).state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    c = load_mla(dirs[256]).state_dict()
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 0  # more steps changed the weights
    mtime = (dirs[256] / "model.safetensors").stat().st_mtime_ns
    again = distilled_students(str(src), str(src), 8, 4, ds, ids, tmp_path / "c")
    assert again == dirs and (dirs[256] / "model.safetensors").stat().st_mtime_ns == mtime
