# SPDX-License-Identifier: Apache-2.0
"""The MLA study's rank choice (against X-EcoMLA's table), the measured latent/RoPE split, the combination's
equal-memory plan, and the distillation-budget bookkeeping on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvexport.eval.combo import combo_plan, context_elements
from kvexport.eval.mla_study import DistillSettings, distilled_students, ranks_for_ratios, rewrite_settings
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


def test_ranks_for_the_student_shape():
    """The student (2 KV heads, d_h 32): 128 elements per token and layer; at d_rope 4 the ranks are the paper's / 8."""
    spec = _spec(4, 2, 32, 128, 4)
    plan = ranks_for_ratios(spec, rope_dim=4)
    assert [p["kv_rank"] for p in plan] == [64, 32, 16, 8, 6]
    for p in plan:
        assert p["ratio"] == pytest.approx(128 / (p["kv_rank"] + 4))
        assert abs(p["ratio"] - p["target"]) / p["target"] < 0.03


def test_combo_rows_hold_equal_memory():
    spec = _spec(4, 2, 32, 128, 4)
    plan = {p["target"]: p for p in ranks_for_ratios(spec, (1.882, 3.556, 6.4, 12.8), rope_dim=4)}
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


def test_split_is_chosen_by_measured_kl(tiny_models):
    """choose_split returns the candidate with the smallest KL to the original, recomputed here; at the GQA
    cache size the exact split (d_rope = n_kv · D) wins with KL ~ 0."""
    from kvexport.mla import rewrite_to_mla
    from kvexport.mla.split import choose_split, rope_candidates
    from kvexport.models.decoder import Decoder

    dec = Decoder.from_hf(tiny_models("llama"))  # 2 KV heads x 16: 64 elements per token and layer
    g = torch.Generator().manual_seed(0)
    calib, held = torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g)
    base = rewrite_settings(1, 2, 32)
    best, rows = choose_split(dec, 20, base, calib, held)
    assert [r["rope_dim"] for r in rows] == rope_candidates(20, 2, 16) == [2, 4, 6, 8, 12, 16]
    pos = torch.arange(32).expand(4, 32)
    with torch.no_grad():
        ref = dec(held, pos).log_softmax(-1)
        kls = []
        for r in rows:
            assert r["kv_rank"] + r["rope_dim"] == 20
            got = rewrite_to_mla(dec, rewrite_settings(r["kv_rank"], r["rope_dim"], 32), calib)(held, pos).log_softmax(-1)
            kls.append((ref.exp() * (ref - got)).sum(-1).mean().item())
    assert [r["kl"] for r in rows] == pytest.approx(kls, abs=1e-5)
    assert best.rope_dim == rows[kls.index(min(kls))]["rope_dim"]
    exact, rows = choose_split(dec, 64, base, calib, held)
    assert (exact.kv_rank, exact.rope_dim) == (32, 32) and min(r["kl"] for r in rows) < 1e-6


def test_distilled_budgets_and_cache(tmp_path, tiny_models):
    """One run per budget: the smaller budget's model equals a separate call with that budget alone; the larger
    differs; a second call returns the cached models without training."""
    from kvexport.mla.io import load_mla

    hf = tiny_models("llama")
    src = tmp_path / "m"
    hf.save_pretrained(src)
    ids = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(0))
    ds = DistillSettings(budgets=(128, 256), seq_len=32, batch_size=2, lr=1e-3)
    settings = rewrite_settings(8, 4, 32)
    dirs = distilled_students(str(src), str(src), settings, ds, ids, tmp_path / "c")
    one = distilled_students(str(src), str(src), settings, DistillSettings(budgets=(128,), seq_len=32, batch_size=2,
                                                                           lr=1e-3), ids, tmp_path / "c1")
    a, b = load_mla(dirs[128]).state_dict(), load_mla(one[128]).state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    c = load_mla(dirs[256]).state_dict()
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 0  # more steps changed the weights
    mtime = (dirs[256] / "model.safetensors").stat().st_mtime_ns
    again = distilled_students(str(src), str(src), settings, ds, ids, tmp_path / "c")
    assert again == dirs and (dirs[256] / "model.safetensors").stat().st_mtime_ns == mtime
