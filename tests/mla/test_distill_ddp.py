# SPDX-License-Identifier: Apache-2.0
"""Distillation across processes: two gloo processes under ``accelerate launch`` take the same steps as one
process (same losses, bit-identical weights on both ranks, weights equal to the one-process run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvexport.mla import load_mla
from tests.mla.distill_fixtures import student_and_teacher

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_two_gloo_processes_match_one(distill_setup, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m kvexport distill ... --cpu` (torchrun underneath; DDP over
    gloo because kvexport's --cpu keeps the Accelerator on the CPU) vs `python -m kvexport distill`. (accelerate's
    own `--cpu` launch flag starts one process unless MPI is configured.)"""
    d, teacher_dir, _, _ = distill_setup
    args = ["distill", str(teacher_dir), "--teacher", str(teacher_dir), "--mla-rank", "12", "--rope-dim", "8",
            "--data", str(d / "train.txt"), "--tokens", str(4 * 4 * 32), "--seq-len", "32", "--batch-size", "4",
            "--lr", "1e-3", "--cpu", "--no-progress"]
    _run([sys.executable, "-m", "kvexport", *args, "--out", str(tmp_path / "one")], tmp_path)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "29517", "-m", "kvexport"]
    _run([*launch, *args, "--out", str(tmp_path / "two")], tmp_path)
    one = json.loads((tmp_path / "one" / "distill_summary.json").read_text())
    two = json.loads((tmp_path / "two" / "distill_summary.json").read_text())
    assert one["processes"] == 1 and two["processes"] == 2
    assert len(set(two["rank_fingerprints"])) == 1  # both ranks hold bit-identical weights
    l1 = [json.loads(x) for x in (tmp_path / "one" / "distill_log.jsonl").read_text().splitlines()]
    l2 = [json.loads(x) for x in (tmp_path / "two" / "distill_log.jsonl").read_text().splitlines()]
    assert len(l1) == len(l2) == 4
    for a, b in zip(l1, l2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    m1, m2 = load_mla(tmp_path / "one"), load_mla(tmp_path / "two")
    for (n, p1), (_, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert (p1 - p2).abs().max().item() < 1e-5, n
    start, _ = student_and_teacher(teacher_dir)  # training moved the weights
    assert (m1.layers[0].self_attn.kv_a_proj.weight - start.layers[0].self_attn.kv_a_proj.weight).abs().max() > 1e-4
