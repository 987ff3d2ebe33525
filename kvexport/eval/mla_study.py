# SPDX-License-Identifier: Apache-2.0
"""The X-EcoMLA study (Li et al., 2025, "X-EcoMLA: Upcycling Pre-Trained Attention into MLA for Efficient and
Extreme KV Compression", Fig. "accuracy vs KV compression for 1B/3B/8B teachers") at small scale.

For each target ratio x (the paper's 1.9x, 3.6x, 6.4x, 10.6x, 12.8x), the per-token budget is
``E = round(2·n_kv·d_h / x)`` elements; it is split between the latent and the RoPE part by measurement
(:func:`kvexport.mla.split.choose_split`: the split with the smallest KL to the original on train-split
windows; or a fixed d_rope), the student is rewritten (:func:`kvexport.mla.rewrite_to_mla`, RoRoPE + weighted
PCA, calibrated on train-split text, RoPE horizon = the distillation sequence length) and distilled
(:func:`kvexport.mla.distill.distill`: forward KL to the teacher's logits, warm-up and cosine decay, half of
every batch copy-augmented) from each teacher on train-split tokens, once per token budget. Each model,
and the undistilled rewrite, is scored on the task set of :mod:`kvexport.eval.tasks` with a full
(non-evicting) latent cache; the original student is the baseline.

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


def ranks_for_ratios(spec, ratios=PAPER_RATIOS, rope_dim: int = 32) -> list[dict]:
    """Per target ratio x and a fixed d_rope: r_kv = round(orig / x) − d_rope (clamped to [1, max rank]) and the
    ratio it really gives by :func:`kvexport.mla.accounting.cache_report`. -> [{target, kv_rank, rope_dim, ratio}]."""
    from kvexport.mla.config import max_kv_rank

    orig = original_elements(spec)
    top = max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, rope_dim, spec.qk_norm)
    out = []
    for x in ratios:
        if x <= 1:
            raise BadUsage(f"compression ratio {x} must be > 1 (original cache / MLA cache)")
        r = min(top, max(1, round(orig / x) - rope_dim))
        out.append(_point(spec, x, r, rope_dim))
    return out


def _point(spec, target: float, kv_rank: int, rope_dim: int, **extra) -> dict:
    from kvexport.mla.accounting import cache_report

    rep = cache_report(spec, mla_ranks=[kv_rank], rope_dim=rope_dim, context=1).to_dict()
    return {"target": target, "kv_rank": kv_rank, "rope_dim": rope_dim, "ratio": rep["per_token_ratio"], **extra}


def rewrite_settings(kv_rank: int, rope_dim: int, seq_len: int):
    """The study's rewrite: the library defaults (RoRoPE, weighted PCA), RoPE horizon = the training windows."""
    from kvexport.mla import MLASettings

    return MLASettings(kv_rank=kv_rank, rope_dim=rope_dim, rope_horizon=seq_len)


def study_data(tok, ds: "DistillSettings") -> dict[str, torch.Tensor]:
    """Train-split token ids: ``distill`` (the largest budget + one window), ``calib`` (16 windows for the rewrite's
    statistics) and ``split`` (8 other windows that score the latent/RoPE splits); nothing from the held-out split."""
    from kvexport.eval.data import train_tokens

    T = ds.seq_len
    ids = train_tokens(tok, ds.budgets[-1] + T, seed=ds.seed)
    extra = train_tokens(tok, 24 * T, seed=ds.seed + 1)[: 24 * T].view(24, T)
    return {"distill": ids, "calib": extra[:16], "split": extra[16:]}


def plan_ranks(dec, ratios, rope_dim: int | None, data: dict, seq_len: int, log=None) -> list[dict]:
    """Per target ratio: the budget E = round(orig / x) and its split, fixed (``rope_dim``) or measured
    (:func:`kvexport.mla.split.choose_split`, KL on ``data['split']``). -> [{target, kv_rank, rope_dim, ratio,
    split_kl?}]."""
    from kvexport.mla.split import choose_split

    spec = dec.spec
    if rope_dim is not None:
        return ranks_for_ratios(spec, ratios, int(rope_dim))
    orig = original_elements(spec)
    out = []
    for x in ratios:
        if x <= 1:
            raise BadUsage(f"compression ratio {x} must be > 1 (original cache / MLA cache)")
        total = max(3, round(orig / x))
        best, rows = choose_split(dec, total, rewrite_settings(1, 2, seq_len), data["calib"], data["split"])
        out.append(_point(spec, x, best.kv_rank, best.rope_dim, split_kl={r["rope_dim"]: r["kl"] for r in rows}))
        if log:
            log(f"split of {total} elements ({x:.2f}x): r_kv {best.kv_rank} + d_rope {best.rope_dim} "
                f"(KL {min(r['kl'] for r in rows):.3f})")
    return out


@dataclass
class DistillSettings:
    """Token budgets (ascending; one run each), sequence length, batch, peak lr, seed, and the recipe of
    :class:`kvexport.mla.distill.DistillConfig` (warm-up, final lr fraction, copy-augmented fraction, CE weight)."""

    budgets: tuple[int, ...] = (65536, 262144)
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    warmup: float = 0.05
    min_lr: float = 0.1
    copy_fraction: float = 0.5
    ce_weight: float = 0.0

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


#: bump when the rewrite or the distillation changes what a cached student is
RECIPE_VERSION = 2


def distilled_students(student_path: str, teacher_path: str, settings, ds: DistillSettings, train_ids: torch.Tensor,
                       cache_dir: Path = DEFAULT_CACHE, calib_ids: torch.Tensor | None = None,
                       log=None) -> dict[int, Path]:
    """Rewrite ``student_path`` to MLA (``settings``, calibrated on ``calib_ids``) and distil it from ``teacher_path``
    once per budget of ``ds``; -> {budget: MLA model directory (loadable with :func:`kvexport.mla.io.load_mla`)}.
    Cached."""
    from kvexport.mla import rewrite_to_mla
    from kvexport.mla.distill import DistillConfig, check_teacher, distill
    from kvexport.mla.io import load_decoder, save_mla

    recipe = {k: v for k, v in asdict(ds).items() if k != "budgets"}
    key = _key(RECIPE_VERSION, _fingerprint(student_path), _fingerprint(teacher_path), settings.to_dict(), recipe,
               int(train_ids.numel()), int(train_ids[:64].sum()),
               None if calib_ids is None else [list(calib_ids.shape), int(calib_ids.sum())])
    base = Path(cache_dir) / key
    out = {b: base / f"tokens-{b}" for b in ds.budgets}
    if all((p / "model.safetensors").exists() for p in out.values()):
        return out
    student, _ = load_decoder(student_path)
    teacher, _ = load_decoder(teacher_path)
    check_teacher(student, teacher)
    for b in ds.budgets:
        if (out[b] / "model.safetensors").exists():
            continue
        t0 = time.perf_counter()
        work = base / f"run-{b}"
        shutil.rmtree(work, ignore_errors=True)
        model = rewrite_to_mla(student, settings, calib_ids)
        cfg = DistillConfig(tokens=b, seq_len=ds.seq_len, batch_size=ds.batch_size, lr=ds.lr, seed=ds.seed,
                            save_every=10**9, warmup=ds.warmup, min_lr=ds.min_lr, copy_fraction=ds.copy_fraction,
                            ce_weight=ds.ce_weight)
        summary = distill(model, teacher, train_ids, work, cfg, tokenizer_dir=student_path, cpu=True, progress=False)
        model = load_mla(work)
        shutil.rmtree(out[b], ignore_errors=True)
        save_mla(model, out[b], tokenizer_dir=student_path)
        (out[b] / "distill_summary.json").write_text(json.dumps(summary, indent=1))
        shutil.rmtree(work, ignore_errors=True)
        if log:
            log(f"distilled r_kv={settings.kv_rank} d_rope={settings.rope_dim} from {Path(teacher_path).name} to {b} "
                f"tokens: kl {summary['final'].get('kl', float('nan')):.4f} ({time.perf_counter() - t0:.0f}s)")
    return out


def load_mla(path):
    from kvexport.mla.io import load_mla as _load

    return _load(path)


@dataclass
class MLAStudy:
    """What to run: target ratios, d_rope (None: the measured split of :func:`plan_ranks`), distillation settings."""

    ratios: tuple[float, ...] = PAPER_RATIOS
    rope_dim: int | None = None
    distill: DistillSettings = field(default_factory=DistillSettings)


def point_key(p: dict) -> str:
    """The result key of one compression point: ``r<kv_rank>+d<rope_dim>``."""
    return f"r{p['kv_rank']}+d{p['rope_dim']}"


def mla_study(student_path: str, teacher_paths: list[str], study: MLAStudy, taskset, cache_dir: Path = DEFAULT_CACHE,
              log=None) -> dict:
    """-> the JSON-able result: baseline task scores of the student, the undistilled rewrite's scores per point
    (``undistilled[point]``), then per teacher, budget and point the distilled student's
    (``results[teacher][budget][point]``)."""
    from kvexport.eval.tasks import evaluate_tasks
    from kvexport.mla import rewrite_to_mla
    from kvexport.mla.io import load_decoder

    t0 = time.perf_counter()
    student, _ = load_decoder(student_path)
    spec = student.spec
    ds = study.distill
    data = study_data(taskset.tok, ds)
    plan = plan_ranks(student, study.ratios, study.rope_dim, data, ds.seq_len, log)
    baseline = evaluate_tasks(student, taskset)
    if log:
        log(f"baseline {Path(student_path).name}: accuracy {baseline['accuracy']:.4f}")
    undistilled = {}
    for p in plan:
        mla = rewrite_to_mla(student, rewrite_settings(p["kv_rank"], p["rope_dim"], ds.seq_len), data["calib"])
        undistilled[point_key(p)] = {**evaluate_tasks(mla, taskset), "ratio": p["ratio"]}
        if log:
            log(f"  undistilled {point_key(p)} ({p['ratio']:.2f}x): accuracy {undistilled[point_key(p)]['accuracy']:.4f}")
    results: dict = {}
    for tp in teacher_paths:
        tname = Path(tp).name
        results[tname] = {str(b): {} for b in ds.budgets}
        for p in plan:
            settings = rewrite_settings(p["kv_rank"], p["rope_dim"], ds.seq_len)
            dirs = distilled_students(student_path, tp, settings, ds, data["distill"], cache_dir, data["calib"], log)
            for b, d in dirs.items():
                scores = evaluate_tasks(load_mla(d), taskset)
                summ = json.loads((d / "distill_summary.json").read_text())
                results[tname][str(b)][point_key(p)] = {**scores, "ratio": p["ratio"],
                                                         "final_kl": summ["final"].get("kl")}
                if log:
                    log(f"  {tname} {b} tok {point_key(p)} ({p['ratio']:.2f}x): accuracy {scores['accuracy']:.4f}")
    return {
        "study": "MLA upcycling: accuracy vs KV-cache compression per teacher and distillation budget "
                 "(X-EcoMLA, Li et al. 2025), exact RoRoPE rewrite at the GQA size",
        "student": Path(student_path).name,
        "teachers": [Path(t).name for t in teacher_paths],
        "ranks": plan,
        "original_elements_per_token_layer": original_elements(spec),
        "rewrite": rewrite_settings(1, 2, ds.seq_len).to_dict() | {"kv_rank": "per point", "rope_dim": "per point"},
        "distill": {**asdict(ds), "loss": "forward KL(teacher || student) per token"
                    + (f" + {ds.ce_weight} x CE" if ds.ce_weight else ", no CE"),
                    "schedule": f"linear warm-up {ds.warmup:.0%} of the steps, cosine to {ds.min_lr:g} x lr",
                    "data": f"train split of the stdlib corpus (seeded file order), {ds.copy_fraction:.0%} of each "
                            "batch copy-augmented (kvexport.mla.recall_data)"},
        "tasks": taskset.describe(),
        "baseline": baseline,
        "undistilled": undistilled,
        "results": results,
        "wall_s": time.perf_counter() - t0,
    }
