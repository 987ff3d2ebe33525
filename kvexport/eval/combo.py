# SPDX-License-Identifier: Apache-2.0
"""Eviction, MLA, and both, at equal KV-cache memory per sequence.

Memory of one sequence's context cache = Σ_layers (elements per token and layer) × (context tokens the
layer holds): ``L · 2·n_kv·d_h · P`` for the original full cache; a press keeping ``b`` of the ``P``
context tokens holds ``b``; an MLA latent cache holds ``r_kv + d_rope`` elements per token
(:mod:`kvexport.mla.accounting`). The decode window (the same few slots in every configuration) is not
counted. For each target compression x (memory = full / x):

- eviction alone: the original model, a press keeping ``b = round(P / x)`` tokens;
- MLA alone: the distilled MLA student whose per-token ratio is x (no eviction), labelled ``MLA r_kv+d_rope``;
- MLA + eviction: each distilled MLA student of per-token ratio y < x, with a press keeping
  ``b = round(P · y / x)`` tokens of its latent cache.

All rows are scored on the same task set (:mod:`kvexport.eval.tasks`); the memory actually held is
reported next to each row (it differs from the target only by the rounding of b and r_kv).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvexport.errors import BadUsage

#: memory targets = the MLA study's middle and extreme points
DEFAULT_TARGETS = (3.556, 6.4, 12.8)


def context_elements(spec, per_token_layer: int, kept: int) -> int:
    """Elements of one sequence's context cache: layers × per-token-and-layer elements × tokens kept."""
    return spec.num_layers * per_token_layer * kept


def combo_plan(context_len: int, orig: int, plan: dict, targets, press: str) -> list[dict]:
    """The rows to score, at equal memory: per target t (a key of ``plan``, whose MLA point gives the exact
    ratio x), eviction keeping round(P / x) tokens, MLA alone, and every milder MLA point y (ratio x_y < x)
    with eviction keeping round(P · x_y / x). ``plan``: target -> {kv_rank, rope_dim, ratio}
    (:func:`kvexport.eval.mla_study.ranks_for_ratios`). -> [{target, method, mla, kv_rank, per_token_layer, kept}]."""
    P, rows = context_len, []
    for t in targets:
        p = plan[t]
        x = p["ratio"]  # the MLA point's exact ratio: every row of this target holds the same memory
        rows.append({"target": x, "method": f"eviction ({press})", "mla": None, "kv_rank": None,
                     "per_token_layer": orig, "kept": round(P / x)})
        rows.append({"target": x, "method": f"MLA {p['kv_rank']}+{p['rope_dim']}", "mla": t, "kv_rank": p["kv_rank"],
                     "per_token_layer": p["kv_rank"] + p["rope_dim"], "kept": P})
        for y in sorted(plan):
            q = plan[y]
            if y < t and q["ratio"] < x * 0.95:
                rows.append({"target": x, "method": f"MLA {q['kv_rank']}+{q['rope_dim']} + eviction ({press})", "mla": y,
                             "kv_rank": q["kv_rank"], "per_token_layer": q["kv_rank"] + q["rope_dim"],
                             "kept": round(P * q["ratio"] / x)})
    return rows


def combo_study(model_path: str, taskset, press: str = "expected_attention", targets=DEFAULT_TARGETS,
                rope_dim: int | None = None, distill_settings=None, cache_dir=None, log=None) -> dict:
    """-> {"rows": [...], "table": markdown, ...}. MLA students are distilled from the model itself
    (``distill_settings.budgets[-1]`` tokens) with :func:`kvexport.eval.mla_study.distilled_students`."""
    from kvexport.eval.mla_study import (
        DEFAULT_CACHE,
        DistillSettings,
        distilled_students,
        load_mla,
        original_elements,
        plan_ranks,
        rewrite_settings,
        study_data,
    )
    from kvexport.eval.tasks import evaluate_tasks
    from kvexport.mla.io import load_decoder
    from kvexport.presses import make_press

    if any(x <= 1 for x in targets):
        raise BadUsage(f"memory targets {list(targets)} must be > 1 (full cache / compressed cache)")
    ds = distill_settings or DistillSettings()
    cache_dir = Path(cache_dir or DEFAULT_CACHE)
    t0 = time.perf_counter()
    model, _ = load_decoder(model_path)
    spec = model.spec
    P = taskset.settings.context_len
    orig = original_elements(spec)
    full_mem = context_elements(spec, orig, P)
    # MLA students: one per target, plus the milder ratios used under eviction
    mla_points = sorted({1.882, *targets})
    data = study_data(taskset.tok, ds)
    plan = {p["target"]: p for p in plan_ranks(model, mla_points, rope_dim, data, ds.seq_len, log)}
    mla_dirs = {x: distilled_students(model_path, model_path, rewrite_settings(p["kv_rank"], p["rope_dim"], ds.seq_len),
                                      ds, data["distill"], cache_dir, data["calib"], log)[ds.budgets[-1]]
                for x, p in plan.items()}
    mla_models: dict = {}

    def mla(x):
        if x not in mla_models:
            mla_models[x] = load_mla(mla_dirs[x])
        return mla_models[x]

    rows = []
    full = evaluate_tasks(model, taskset)
    rows.append({"target": 1.0, "method": "full cache", "mla": None, "kv_rank": None, "per_token_layer": orig,
                 "kept": P, "elements": full_mem, "memory_ratio": 1.0, **full})

    for row in combo_plan(P, orig, plan, targets, press):
        dec = model if row["mla"] is None else mla(row["mla"])
        pr = make_press(press, budget=row["kept"]) if row["kept"] < P else None
        scores = evaluate_tasks(dec, taskset, pr)
        mem = context_elements(spec, row["per_token_layer"], row["kept"])
        rows.append({**row, "elements": mem, "memory_ratio": full_mem / mem, **scores})
        if log:
            log(f"{row['target']:.2f}x {row['method']}: accuracy {scores['accuracy']:.4f} "
                f"(memory {full_mem / mem:.2f}x)")
    return {
        "study": "eviction vs MLA vs MLA + eviction at equal KV-cache memory per sequence",
        "model": Path(model_path).name,
        "press": press,
        "context_len": P,
        "memory": "elements of one sequence's context cache = layers x elements per token and layer x context "
                  "tokens held; decode window not counted; memory_ratio = full / this",
        "mla_ranks": list(plan.values()),
        "distill": {"teacher": "the model itself", "tokens": ds.budgets[-1], "seq_len": ds.seq_len,
                    "batch_size": ds.batch_size, "lr": ds.lr, "warmup": ds.warmup, "min_lr": ds.min_lr,
                    "copy_fraction": ds.copy_fraction},
        "tasks": taskset.describe(),
        "rows": rows,
        "table": combo_table(rows),
        "wall_s": time.perf_counter() - t0,
    }


def combo_table(rows: list[dict]) -> str:
    """Markdown table: target, method, kept tokens, memory ratio, the four task scores and their mean."""
    head = ("| memory target | method | context tokens kept | memory vs full | next-token acc | code recall EM | "
            "passkey EM | span recall EM | accuracy |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        tgt = "full" if r["target"] == 1.0 else f"{r['target']:.2f}×"
        mem = f"{r.get('memory_ratio', 1.0):.2f}×"
        lines.append(f"| {tgt} | {r['method']} | {r['kept']} | {mem} | {r['next_token']:.3f} | "
                     f"{r['code_recall']:.3f} | {r['passkey']:.3f} | {r['span_recall']:.3f} | **{r['accuracy']:.3f}** |")
    return head + "\n".join(lines) + "\n"
