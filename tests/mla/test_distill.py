# SPDX-License-Identifier: Apache-2.0
"""Distillation: the held-out KL to the teacher drops; resuming equals an uninterrupted run (multi-process:
test_distill_ddp.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kvexport.mla import load_mla
from kvexport.mla.distill import DistillConfig, distill, evaluate_kl
from tests.mla.distill_fixtures import student_and_teacher


def test_distillation_lowers_heldout_kl(distill_setup, tmp_path):
    d, teacher_dir, train, held = distill_setup
    student, teacher = student_and_teacher(teacher_dir)
    before = evaluate_kl(student, teacher, held, 64)
    cfg = DistillConfig(tokens=16 * 4 * 64, seq_len=64, batch_size=4, lr=3e-3, save_every=8)
    summary = distill(student, teacher, train, tmp_path / "out", cfg, cpu=True, progress=False,
                      tokenizer_dir=teacher_dir)
    after = evaluate_kl(student.eval(), teacher, held, 64)
    assert summary["steps"] == 16
    assert after < 0.7 * before, (before, after)
    log = [json.loads(line) for line in (tmp_path / "out" / "distill_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 17)) and log[-1]["tokens"] == 16 * 256
    assert log[-1]["kl"] < log[0]["kl"]
    # the output directory is an MLA model with the distilled weights and the tokenizer
    back = load_mla(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert evaluate_kl(back, teacher, held, 64) == pytest.approx(after, abs=1e-6)


def test_resume_equals_uninterrupted(distill_setup, tmp_path):
    d, teacher_dir, train, _ = distill_setup
    kw = dict(seq_len=32, batch_size=2, lr=1e-3, save_every=3)
    s1, t = student_and_teacher(teacher_dir)
    full = distill(s1, t, train, tmp_path / "a", DistillConfig(tokens=6 * 64, **kw), cpu=True, progress=False)
    s2, t = student_and_teacher(teacher_dir)
    distill(s2, t, train, tmp_path / "b", DistillConfig(tokens=3 * 64, **kw), cpu=True, progress=False)
    s3, t = student_and_teacher(teacher_dir)  # fresh weights: everything must come from the checkpoint
    resumed = distill(s3, t, train, tmp_path / "b", DistillConfig(tokens=6 * 64, **kw), resume=True, cpu=True,
                      progress=False)
    assert resumed["steps"] == 6 and resumed["tokens"] == 6 * 64
    assert resumed["fingerprint"] == full["fingerprint"]
    log = [json.loads(line)["step"] for line in (tmp_path / "b" / "distill_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]


def test_ce_mix_is_logged_and_added(distill_setup, tmp_path):
    """loss = KL + w · CE, with CE the next-token cross-entropy of the student (checked at step 1 by hand)."""
    import torch.nn.functional as F

    from kvexport.mla.distill import forward_kl, global_batches

    d, teacher_dir, train, _ = distill_setup
    student, teacher = student_and_teacher(teacher_dir)
    cfg = DistillConfig(tokens=2 * 2 * 32, seq_len=32, batch_size=2, lr=1e-3, ce_weight=0.5)
    x = global_batches(train, cfg)[:2]
    pos = torch.arange(32).expand(2, 32)
    with torch.no_grad():
        s, t = student(x, pos), teacher(x, pos)
        kl0 = forward_kl(t, s).item()
        ce0 = F.cross_entropy(s[:, :-1].reshape(-1, s.shape[-1]), x[:, 1:].reshape(-1)).item()
    distill(student, teacher, train, tmp_path / "o", cfg, cpu=True, progress=False)
    first = json.loads((tmp_path / "o" / "distill_log.jsonl").read_text().splitlines()[0])
    assert first["kl"] == pytest.approx(kl0, rel=1e-5) and first["ce"] == pytest.approx(ce0, rel=1e-5)
    assert first["loss"] == pytest.approx(kl0 + 0.5 * ce0, rel=1e-5)
