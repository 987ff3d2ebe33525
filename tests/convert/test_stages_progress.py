# SPDX-License-Identifier: Apache-2.0
"""Progress of long stages: :func:`with_eta` adds the time left to counted sub-steps, at the pace measured so far;
:func:`release` drops the models a later stage does not read."""

from __future__ import annotations

import pytest

from kvexport.convert import stages


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(stages.time, "perf_counter", lambda: now[0])
    return now


def test_eta_at_the_pace_of_the_steps_so_far(clock):
    shown: list[str] = []
    progress = stages.with_eta(shown.append)
    for t, msg in [(0, "exporting prefill.onnx (1/4)"), (10, "exporting decode.onnx (2/4)"),
                   (30, "exporting compact_prefill.onnx (3/4)"), (36, "exporting compact.onnx (4/4)")]:
        clock[0] = t
        progress(msg)
    # step k starts when its message comes: n - k + 1 steps are left, each at the mean pace since the first one
    assert shown == ["exporting prefill.onnx (1/4)",
                     "exporting decode.onnx (2/4) · ~30s left",  # 10 s a step, steps 2..4
                     "exporting compact_prefill.onnx (3/4) · ~30s left",  # 15 s a step, steps 3..4
                     "exporting compact.onnx (4/4) · ~12s left"]  # 12 s a step, step 4


def test_eta_restarts_with_a_new_phase_or_count(clock):
    shown: list[str] = []
    progress = stages.with_eta(shown.append)
    script = [(0, "parity: prompt 1/3"), (100, "parity: prompt 2/3"),
              (101, "loading the PyTorch reference"),  # no count: shown as it is, the phase ends
              (102, "fidelity: window 1/50"), (104, "fidelity: window 2/50"),
              (200, "fidelity: window 1/50"),  # the count starts again (a second model): no stale pace
              (201, "fidelity: window 3-4/50")]  # a range counts by its first number
    for t, msg in script:
        clock[0] = t
        progress(msg)
    assert shown == ["parity: prompt 1/3", "parity: prompt 2/3 · ~3m20s left", "loading the PyTorch reference",
                     "fidelity: window 1/50", "fidelity: window 2/50 · ~1m38s left", "fidelity: window 1/50",
                     "fidelity: window 3-4/50 · ~24s left"]


@pytest.mark.parametrize("seconds,text", [(0.4, "0s"), (59.6, "1m00s"), (75, "1m15s"), (3599, "59m59s"),
                                          (3600, "1h00m"), (3 * 3600 + 61, "3h01m")])
def test_duration(seconds, text):
    assert stages._duration(seconds) == text


def test_load_keeps_only_what_the_rewrite_reads(tiny_hf_dir, tmp_path):
    """Without MLA the load stage reads the checkpoint's headers only (the export loads the directory itself, in
    its dtype); with MLA the rewrite gets the loaded model and drops it."""
    from transformers import AutoModelForCausalLM

    from kvexport.convert.config import ConvertConfig

    for mla, kept in ((None, False), (16, True)):
        kw = {"mla_rank": mla, "rope_dim": 8} if mla else {"press": "snapkv"}  # eviction only: no rewrite
        cfg = ConvertConfig(model=str(tiny_hf_dir), **kw)
        cfg, path, spec = stages.resolve_settings(cfg)
        work = tmp_path / f"w{mla}"
        work.mkdir()
        st = stages.ConvertState(cfg=cfg, model_path=path, work=work, spec=spec)
        stages.stage_load(st)
        assert (st.decoder is not None, st.hf is not None) == (kept, kept)
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir))
        assert st.notes["parameters"] == sum(p.numel() for p in hf.parameters())
        assert st.notes["weight_bytes"] == 4 * st.notes["parameters"]  # an fp32 checkpoint
        if mla:
            stages.stage_rewrite(st)
            assert st.decoder is None and st.hf is None and st.mla_decoder is not None
