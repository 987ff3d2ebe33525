# SPDX-License-Identifier: Apache-2.0
"""The X-EcoMLA study (Li et al., 2025, "X-EcoMLA: Upcycling Pre-Trained Attention into MLA for Efficient and
Extreme KV Compression", Fig. "accuracy vs KV compression for 1B/3B/8B teachers") at small scale.

For each latent rank r_kv (chosen from the cache accounting so that the per-token KV-cache compression
ratio ``2·n_kv·d_h / (r_kv + d_rope)`` is ≈ 1.9×, 3.6×, 6.4×, 10.6×, 12.8×), the student is rewritten to MLA
by SVD (:func:`kvexport.mla.rewrite_to_mla`) and distilled (:func:`kvexport.mla.distill.distill`, forward KL
to the teacher's logits, no CE) from each teacher on train-split tokens, to two token budgets: the run to
the larger budget passes through the smaller one (constant learning rate, same data order: the
checkpoint at the smaller budget *is* a run with that budget). Each distilled model is scored on the task
set of :mod:`kvexport.eval.tasks` with a full (non-evicting) latent cache; the original student is the
baseline. d_rope defaults to the paper's proportion: Llama-3.2-1B keeps d_rope = 32 of a 1024-element
cache per token and layer (1/32); the student's 128-element cache gives d_rope = 4, and then the ranks are
the paper's divided by 8 (512, 256, 128, 64, 48 -> 64, 32, 16, 8, 6).

Distilled models are cached in ``cache_dir`` keyed by everything that determines them, so the combination
study (:mod:`kvexport.eval.combo`) and reruns reuse them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvexport.errors import BadUsage

#: X-EcoMLA's compression points for Llama-3.2-1B (r_kv 512, 256, 128, 64, 48 with d_rope 32): 1024 / (r + 32),
#: shown in the paper as 1.9x, 3.6x, 6.4x, 10.6x, 12.8x
PAPER_RATIOS = (1.882, 3.556, 6.4, 10.667, 12.8)
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "kvexport_eval_cache"


def original_elements(spec) -> int:
    """Cache elements per token and layer of the original GQA/MHA model: 2 · n_kv · d_h."""
    from kvexport.mla.accounting import cache_report

    return cache_report(spec, context=1).original_elements_per_token_layer


def default_rope_dim(spec) -> int:
    """d_rope in X-EcoMLA's proportion to the original cache (32 of 1024): even, >= 2, <= head_dim."""
    d = max(2, round(original_elements(spec) / 32 / 2) * 2)
    return min(d, spec.head_dim - spec.head_dim % 2)


def ranks_for_ratios(spec, ratios=PAPER_RATIOS, rope_dim: int | None = None) -> list[dict]:
    """Per target ratio x: r_kv = round(orig / x) − d_rope (clamped to [1, max rank]) and the ratio it
    really gives by :func:`kvexport.mla.accounting.cache_report`. -> [{target, kv_rank, rope_dim, ratio}]."""
    from kvexport.mla.accounting import cache_report
    from kvexport.mla.config import max_kv_rank

    d = default_rope_dim(spec) if rope_dim is None else int(rope_dim)
    orig = original_elements(spec)
    top = max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, d)
    out = []
    for x in ratios:
        if x <= 1:
            raise BadUsage(f"compression ratio {x} must be > 1 (original cache / MLA cache)")
        r = min(top, max(1, round(orig / x) - d))
        rep = cache_report(spec, mla_ranks=[r], rope_dim=d, context=1).to_dict()
        out.append({"target": x, "kv_rank": r, "rope_dim": d, "ratio": rep["per_token_ratio"]})
    return out


@dataclass
class DistillSettings:
    """Token budgets (ascending; each run passes through the smaller ones), sequence length, batch, lr, seed."""

    budgets: tuple[int, ...] = (65536, 262144)
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        self.budgets = tuple(sorted(int(b) for b in self.budgets))
        step = self.seq_len * self.batch_size
        if not self.budgets or self.budgets[0] < step:
            raise BadUsage(f"distillation budgets {list(self.budgets)} must hold at least one batch ({step} tokens)")


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fingerprint(path: str) -> str:
    p = Path(path)
    f = p / "model.safetensors"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.exists() else str(p.resolve())


def distilled_students(student_path: str, teacher_path: str, kv_rank: int, rope_dim: int, ds: DistillSettings,
                       train_ids: torch.Tensor, cache_dir: Path = DEFAULT_CACHE, log=None) -> dict[int, Path]:
    """Rewrite ``student_path`` to MLA (r_kv, d_rope) and distil it from ``teacher_path`` to every budget of
    ``ds``; -> {budget: MLA model directory (loadable with :func:`kvexport.mla.io.load_mla`)}. Cached."""
    from kvexport.mla import MLASettings, rewrite_to_mla
    from kvexport.mla.distill import DistillConfig, check_teacher, distill
    from kvexport.mla.io import save_mla
    from kvexport.models.loading import load_decoder

    key = _key(_fingerprint(student_path), _fingerprint(teacher_path), kv_rank, rope_dim, ds.seq_len,
               ds.batch_size, ds.lr, ds.seed, int(train_ids.numel()), int(train_ids[:64].sum()))
    base = Path(cache_dir) / key
    out = {b: base / f"tokens-{b}" for b in ds.budgets}
    if all((p / "model.safetensors").exists() for p in out.values()):
        return out
    student, _ = load_decoder(student_path)
    teacher, _ = load_decoder(teacher_path)
    check_teacher(student, teacher)
    work = base / "run"
    shutil.rmtree(work, ignore_errors=True)
    model = rewrite_to_mla(student, MLASettings(kv_rank=kv_rank, rope_dim=rope_dim))
    for i, b in enumerate(ds.budgets):
        t0 = time.perf_counter()
        cfg = DistillConfig(tokens=b, seq_len=ds.seq_len, batch_size=ds.batch_size, lr=ds.lr, seed=ds.seed,
                            save_every=10**9)
        summary = distill(model, teacher, train_ids, work, cfg, resume=i > 0, tokenizer_dir=student_path, cpu=True,
                          progress=False)
        model = load_mla(work)
        shutil.rmtree(out[b], ignore_errors=True)
        save_mla(model, out[b], tokenizer_dir=student_path)
        (out[b] / "distill_summary.json").write_text(json.dumps(summary, indent=1))
        if log:
            log(f"distilled r_kv={kv_rank} from {Path(teacher_path).name} to {b} tokens: "
                f"kl {summary['final'].get('kl', float('nan')):.4f} ({time.perf_counter() - t0:.0f}s)")
    shutil.rmtree(work, ignore_errors=True)
    return out


def load_mla(path):
    from kvexport.mla.io import load_mla as _load

    return _load(path)


@dataclass
class MLAStudy:
    """What to run: target ratios, d_rope (None: :func:`default_rope_dim`), distillation settings."""

    ratios: tuple[float, ...] = PAPER_RATIOS
    rope_dim: int | None = None
    distill: DistillSettings = field(default_factory=DistillSettings)


def mla_study(student_path: str, teacher_paths: list[str], study: MLAStudy, taskset, cache_dir: Path = DEFAULT_CACHE,
              log=None) -> dict:
    """-> the JSON-able result: baseline task scores of the student, then per teacher, budget and rank the
    task scores of the distilled MLA student (``results[teacher][budget][rank]``)."""
    from kvexport.eval.data import train_tokens
    from kvexport.eval.tasks import evaluate_tasks
    from kvexport.models.loading import load_decoder

    student, _ = load_decoder(student_path)
    spec = student.spec
    plan = ranks_for_ratios(spec, study.ratios, study.rope_dim)
    ds = study.distill
    ids = train_tokens(taskset.tok, ds.budgets[-1] + ds.seq_len, seed=ds.seed)
    t0 = time.perf_counter()
    baseline = evaluate_tasks(student, taskset)
    if log:
        log(f"baseline {Path(student_path).name}: accuracy {baseline['accuracy']:.4f}")
    results: dict = {}
    for tp in teacher_paths:
        tname = Path(tp).name
        results[tname] = {str(b): {} for b in ds.budgets}
        for p in plan:
            dirs = distilled_students(student_path, tp, p["kv_rank"], p["rope_dim"], ds, ids, cache_dir, log)
            for b, d in dirs.items():
                scores = evaluate_tasks(load_mla(d), taskset)
                summ = json.loads((d / "distill_summary.json").read_text())
                results[tname][str(b)][str(p["kv_rank"])] = {**scores, "ratio": p["ratio"],
                                                              "final_kl": summ["final"].get("kl")}
                if log:
                    log(f"  {tname} {b} tok r_kv={p['kv_rank']} ({p['ratio']:.2f}x): accuracy {scores['accuracy']:.4f}")
    return {
        "study": "MLA upcycling: accuracy vs KV-cache compression per teacher and distillation budget "
                 "(X-EcoMLA, Li et al. 2025)",
        "student": Path(student_path).name,
        "teachers": [Path(t).name for t in teacher_paths],
        "ranks": plan,
        "original_elements_per_token_layer": original_elements(spec),
        "distill": {**asdict(ds), "loss": "forward KL(teacher || student) per token, no CE",
                    "data": "train split of the stdlib corpus (scripts/train_reference.py), seeded file order"},
        "tasks": taskset.describe(),
        "baseline": baseline,
        "results": results,
        "wall_s": time.perf_counter() - t0,
    }
