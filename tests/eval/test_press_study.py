# SPDX-License-Identifier: Apache-2.0
"""``kvexport eval presses``: the metric definitions, checked against HF and against themselves."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvexport.eval.data import HELDOUT_BYTE, corpus_files
from kvexport.eval.press_study import STUDY_PRESSES, PressStudy, press_study, run_window
from kvexport.models.decoder import Decoder
from kvexport.paths import DEFAULT_MODEL

P, F = 40, 6


@pytest.fixture(scope="module")
def tiny(tiny_models):
    hf = tiny_models("llama")
    windows = torch.randint(3, 128, (3, P + F + 1), generator=torch.Generator().manual_seed(0))
    return hf, Decoder.from_hf(hf), windows


def test_full_cache_run_is_hf_forward(tiny):
    """The reference run (press=None) gives HF's logits and HF's per-layer outputs at the future tokens."""
    hf, dec, w = tiny
    h, logits = run_window(dec, w, P, F)
    with torch.no_grad():
        out = hf(w[:, : P + F], output_hidden_states=True)
    assert (logits - out.logits[:, P : P + F]).abs().max().item() < 1e-4
    L = dec.spec.num_layers
    for layer in range(L - 1):  # HF's last hidden state has the final norm applied; ours does not
        assert (h[layer] - out.hidden_states[layer + 1][:, P : P + F]).abs().max().item() < 1e-4


def test_ratio_zero_is_exactly_the_full_cache(tiny):
    _, dec, w = tiny
    res = press_study(dec, w, PressStudy(ratios=(0.0,), presses=STUDY_PRESSES, prompt_len=P, future_len=F, batch=2))
    for press, by_ratio in res["results"].items():
        r = by_ratio["0"]
        assert r["discrepancy"] == 0.0 and r["relative_discrepancy"] == 0.0, press
        assert r["agreement"] == 1.0 and r["ppl"] == pytest.approx(res["full_cache"]["ppl"], rel=1e-9), press


def test_metrics_match_their_definition(tiny):
    """discrepancy = mean over windows, future tokens, layers of the L2 norm; ppl and agreement by hand."""
    hf, dec, w = tiny
    study = PressStudy(ratios=(0.6,), presses=("knorm",), prompt_len=P, future_len=F, batch=2)
    res = press_study(dec, w, study)["results"]["knorm"]["0.6"]
    from kvexport.presses import make_press

    h_ref, lg_ref = run_window(dec, w, P, F)
    h, lg = run_window(dec, w, P, F, make_press("knorm", compression_ratio=0.6))
    d = (h - h_ref).norm(dim=-1)  # (L, B, F)
    assert res["discrepancy"] == pytest.approx(d.mean().item(), rel=1e-5)
    assert res["discrepancy_per_layer"] == pytest.approx(d.mean((1, 2)).tolist(), rel=1e-5)
    assert res["discrepancy"] > 0
    ce = torch.nn.functional.cross_entropy(lg.flatten(0, 1), w[:, P + 1 :].flatten())
    assert res["ppl"] == pytest.approx(math.exp(ce.item()), rel=1e-5)
    assert res["agreement"] == pytest.approx((lg.argmax(-1) == lg_ref.argmax(-1)).float().mean().item())


@pytest.mark.parametrize("press", ["knorm", "pyramidkv", "optimal"])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.9])
def test_ratio_maps_to_budget(tiny, press, ratio):
    """The cache holds int(P (1 - ratio)) prompt tokens per layer after the one-shot prefill compression
    (kvpress's rule; PyramidKV: its per-layer budgets), and the JSON reports those numbers."""
    _, dec, w = tiny
    study = PressStudy(ratios=(ratio,), presses=(press,), prompt_len=P, future_len=F, batch=3)
    res = press_study(dec, w, study)["results"][press][f"{ratio:g}"]
    from kvexport.eval.press_study import _press

    pr = _press(press, ratio, dec, w, study)
    L = dec.spec.num_layers
    budgets = pr.layer_budgets(L, P)
    if press != "pyramidkv":
        assert budgets == [int(P * (1 - ratio))] * L
    assert res["kept_per_layer"] == budgets
    cache = dec.new_cache(w.shape[0], pr, budgets, F + 1)
    pos = torch.arange(P).expand(w.shape[0], P)
    dec(w[:, :P], pos, cache, mode="prefill")
    for layer, b in zip(cache.layers, budgets, strict=True):
        held = (layer.occupied()[2] >= 0).sum(-1)  # (B, Hc) real tokens per head
        assert (held == min(b, P)).all(), (press, ratio)


def test_split_is_deterministic_and_disjoint():
    train, held = corpus_files()
    assert not set(train) & set(held) and train == sorted(train) and held == sorted(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.1  # HELDOUT_BYTE / 256 ≈ 5 %
    assert HELDOUT_BYTE == 13 and corpus_files() == (train, held)
    assert not any(p.startswith(("test/", "site-packages/")) for p in train + held)


@pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="bundled student not trained")
def test_cli_on_student_optimal_beats_random(tmp_path):
    """On the trained student the oracle's outputs drift less than random eviction; full-cache ppl = HF's."""
    from kvexport.cli import main
    from kvexport.eval.data import heldout_windows
    from kvexport.models.loading import load_hf_model, load_tokenizer

    out = tmp_path
    rc = main(
        [
            "eval",
            "presses",
            str(DEFAULT_MODEL),
            "--ratios",
            "0.5,0.8",
            "--presses",
            "random,optimal",
            "--windows",
            "2",
            "--prompt-len",
            "64",
            "--future-len",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and (out / "presses_kvx-student.png").stat().st_size > 0
    res = json.loads((out / "presses_kvx-student.json").read_text())
    for r in ("0.5", "0.8"):
        assert res["results"]["optimal"][r]["discrepancy"] < res["results"]["random"][r]["discrepancy"]
    w = heldout_windows(load_tokenizer(DEFAULT_MODEL), 2, 64 + 8 + 1)
    with torch.no_grad():
        logits = load_hf_model(DEFAULT_MODEL)(w[:, :72]).logits[:, 64:72]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 65:73].flatten())
    assert res["full_cache"]["ppl"] == pytest.approx(math.exp(ce.item()), rel=1e-4)


def test_cli_press_kwargs_reach_the_press(tmp_path):
    """--press-kwargs gives Expected Attention its n_future_positions: the CLI's JSON equals press_study with
    the same setting, and differs from the default's."""
    from kvexport.cli import main
    from kvexport.eval.data import heldout_windows
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import load_tokenizer

    kw = {"expected_attention": {"n_future_positions": 8}}
    args = ["eval", "presses", str(DEFAULT_MODEL), "--ratios", "0.5", "--presses", "expected_attention", "--windows",
            "2", "--prompt-len", "48", "--future-len", "8", "--press-kwargs", json.dumps(kw), "--out", str(tmp_path)]
    assert main(args) == 0
    res = json.loads((tmp_path / "presses_kvx-student.json").read_text())
    assert res["settings"]["press_kwargs"] == kw and "--press-kwargs" in res["command"]
    dec, _ = load_decoder(DEFAULT_MODEL)
    w = heldout_windows(load_tokenizer(DEFAULT_MODEL), 2, 48 + 8 + 1)
    study = dict(ratios=(0.5,), presses=("expected_attention",), prompt_len=48, future_len=8)
    ref = press_study(dec, w, PressStudy(**study, press_kwargs=kw))["results"]["expected_attention"]["0.5"]
    default = press_study(dec, w, PressStudy(**study))["results"]["expected_attention"]["0.5"]
    got = res["results"]["expected_attention"]["0.5"]
    assert got["discrepancy"] == pytest.approx(ref["discrepancy"], rel=1e-5)
    assert got["discrepancy"] != pytest.approx(default["discrepancy"], rel=1e-3)
