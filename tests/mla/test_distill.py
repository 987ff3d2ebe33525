# SPDX-License-Identifier: Apache-2.0
"""Distillation: the held-out KL to the teacher drops; resuming equals an uninterrupted run (multi-process:
test_distill_ddp.py)."""

from __future__ import annotations

import json
import math

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


def test_resume_equals_uninterrupted(distill_setup, tmp_path, monkeypatch):
    """A run killed after its step-3 checkpoint and resumed (same settings, cosine schedule, copy-augmented
    batches) ends bit-identical to an uninterrupted run."""
    import kvexport.mla.distill as dmod

    d, teacher_dir, train, _ = distill_setup
    cfg = DistillConfig(tokens=6 * 64, seq_len=32, batch_size=2, lr=1e-3, save_every=3, warmup=0.2)
    s1, t = student_and_teacher(teacher_dir)
    full = distill(s1, t, train, tmp_path / "a", cfg, cpu=True, progress=False)
    real, calls = dmod.forward_kl, []

    def dies_at_step_4(*a):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(dmod, "forward_kl", dies_at_step_4)
    s2, t = student_and_teacher(teacher_dir)
    with pytest.raises(KeyboardInterrupt):
        distill(s2, t, train, tmp_path / "b", cfg, cpu=True, progress=False)
    monkeypatch.setattr(dmod, "forward_kl", real)
    s3, t = student_and_teacher(teacher_dir)  # fresh weights: everything must come from the checkpoint
    resumed = distill(s3, t, train, tmp_path / "b", cfg, resume=True, cpu=True, progress=False)
    assert resumed["steps"] == 6 and resumed["tokens"] == 6 * 64
    assert resumed["fingerprint"] == full["fingerprint"]
    log = [json.loads(line) for line in (tmp_path / "b" / "distill_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in log] == pytest.approx([cfg.lr_at(i) for i in range(6)])


def test_schedule_warms_up_and_decays():
    cfg = DistillConfig(tokens=100 * 8 * 256, lr=1e-3, warmup=0.05, min_lr=0.1)
    lrs = [cfg.lr_at(i) for i in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-3 / 5) and lrs[4] == pytest.approx(1e-3)  # 5 warm-up steps
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))  # then never rises
    assert lrs[52] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    flat = DistillConfig(tokens=10 * 8 * 256, warmup=0.0, min_lr=1.0)
    assert {flat.lr_at(i) for i in range(flat.steps)} == {flat.lr}


def test_copy_augmentation_repeats_a_span():
    """copy_augment: the chosen rows hold a span of their first half again, later, and nothing else changed."""
    from kvexport.mla.recall_data import copy_augment

    seqs = torch.arange(8 * 256).view(8, 256)  # every token unique
    out = copy_augment(seqs, 0.5, seed=3)
    changed = (out != seqs).any(1)
    assert int(changed.sum()) == 4
    for row in changed.nonzero().flatten().tolist():
        diff = (out[row] != seqs[row]).nonzero().flatten()
        dst, n = int(diff[0]), len(diff)
        assert 48 <= n <= 120 and int(diff[-1]) == dst + n - 1  # one contiguous span of 48..120 tokens
        src = int(out[row, dst]) - row * 256
        assert 1 <= src and src + n <= 128 and dst >= src + n + 8  # from the first half, at least 8 tokens later
        assert torch.equal(out[row, dst : dst + n], seqs[row, src : src + n])


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
