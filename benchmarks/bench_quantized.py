# SPDX-License-Identifier: Apache-2.0
"""Quantized caches (int8, fp8) against their fp32 twins on the trained reference student (issue 18).

Configurations (PyTorch library path, :func:`kvexport.generation.generate`):

- ``mla+press``: the student rewritten to MLA with convert's default settings (``showcase_mla``: r_kv 32 + d_rope 32, SVD/PCA rewrite, not distilled) and a press with a token budget;
- ``press``: eviction only (no MLA), the same press;
- ``mla``: (diagnostic) MLA with a full cache (no eviction): the quantization error alone, without eviction
  decisions that diverge.

For each and each quantized format: next-token agreement with the fp32-cache twin over ``--windows`` held-out
windows (:func:`kvexport.eval.data.heldout_windows`) of ``--context`` tokens, teacher-forced ``--steps`` steps
(:func:`kvexport.export.twin.twin_compare`), and the recall tasks of the studies' task set
(:mod:`kvexport.eval.tasks`: code_recall, passkey, span_recall, exact match, greedy) with the fp32 and the
quantized cache. Targets: agreement >= 98 %, recall within 5 points of fp32.

    python benchmarks/bench_quantized.py [--context 4096] [--windows 8] [--steps 64] [--recall 192:32 192:32:64 1400:8]
        [--formats int8 fp8 fp16 bf16] [--equalize auto|on|off] [--out docs/quantized_results.json]
    python benchmarks/bench_quantized.py --runtime onnxruntime --configs mla+press   # exports against the fp32 export
    python benchmarks/bench_quantized.py --model models/kvx-teacher-2x ...           # another reference model

MLA models are rewritten with the latent equalized for int8 (``--equalize auto``, as convert does) and plain for the
other formats.

At the defaults it runs in about 6-9 minutes on 2 shared CPU cores (16k contexts would take about 4x as long).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from kvexport.cache.plan import DEFAULT_WINDOW

ROOT = Path(__file__).resolve().parent.parent
#: the cache formats each configuration is run with, unless --formats says otherwise
FORMATS = {"mla+press": ("int8", "fp8"), "press": ("int8",), "mla": ("int8",)}


def build(mla: bool, equalize: bool = False, mla_dir: str | None = None, distill_tokens: int | None = None,
          model: str = "models/kvx-student"):
    """The student (fp32), rewritten to MLA when ``mla`` (convert's default rank; ``equalize``: the latent equalized)
    or, with ``mla_dir``, the saved MLA model there (e.g. a distilled one) as it is; ``distill_tokens``: the
    rewrite then distilled from the original student on that many train-split tokens (kvexport.mla.distill, lr 1e-3,
    the other settings its defaults)."""
    from kvexport.convert.config import showcase_mla
    from kvexport.mla.config import MLASettings
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import load_tokenizer

    path = ROOT / model
    tok = load_tokenizer(path)
    if mla and mla_dir:
        from kvexport.mla.io import load_mla

        dec = load_mla(mla_dir, dtype=torch.float32)
        s = dec.mla_settings
        info = {"model": str(mla_dir), "mla": {"kv_rank": s.kv_rank, "rope_dim": s.rope_dim,
                                               "distilled": (Path(mla_dir) / "distill_summary.json").is_file(),
                                               "equalize_latent": s.equalize_latent}}
        return dec.eval(), tok, info
    dec, _ = load_decoder(path, "fp32")
    info = {"model": model, "mla": None}
    if mla:
        from kvexport.mla.rewrite import rewrite_to_mla

        rank, rope = showcase_mla(dec.spec)
        teacher = dec if distill_tokens else None
        dec = rewrite_to_mla(dec, MLASettings(kv_rank=rank, rope_dim=rope, equalize_latent=equalize))
        info["mla"] = {"kv_rank": rank, "rope_dim": rope, "distilled": False, "equalize_latent": equalize}
        if distill_tokens:
            import tempfile

            from kvexport.eval.data import train_tokens
            from kvexport.mla.distill import DistillConfig, distill
            from kvexport.mla.io import load_mla

            cfg = DistillConfig(tokens=int(distill_tokens), lr=1e-3, save_every=10**9)
            with tempfile.TemporaryDirectory() as tmp, torch.enable_grad():  # main() runs under no_grad
                t0 = time.perf_counter()
                summary = distill(dec, teacher.eval(), train_tokens(tok, cfg.tokens), Path(tmp) / "d", cfg, cpu=True,
                                  progress=False, tokenizer_dir=path)
                dec = load_mla(Path(tmp) / "d", dtype=torch.float32)
            info["mla"]["distilled"] = {"tokens": cfg.tokens, "teacher": model, "lr": cfg.lr,
                                        "final_kl": summary["final"]["kl"],
                                        "seconds": round(time.perf_counter() - t0, 1)}
    return dec.eval(), tok, info


def recall(dec, tok, press_factory, window: int, chunk: int, kv_dtypes, n: int, context: int, batch: int) -> dict:
    """Exact-match rate of the studies' recall tasks with each cache format (same examples for all)."""
    from kvexport.eval.tasks import TaskSettings, prediction, recall_examples
    from kvexport.generation import generate

    ts = TaskSettings(context_len=context, n_recall=n, seed=0)
    tasks = recall_examples(tok, ts)
    out: dict = {"context_tokens": context, "examples_per_task": n}
    for name, ex in tasks.items():
        new = max(len(e.answer_ids) if e.answer_ids else len(tok(" " + e.answer)["input_ids"]) + 1 for e in ex)
        row = {}
        for kvd in kv_dtypes:
            hits = 0
            for s in range(0, len(ex), batch):
                part = ex[s : s + batch]
                ids = torch.tensor([e.prompt for e in part], dtype=torch.long)
                res = generate(dec, ids, press=press_factory(), window=window, chunk=chunk, max_new_tokens=new,
                               kv_dtype=kvd)
                hits += sum(prediction(tok, e, r) == e.answer for e, r in zip(part, res.tokens.tolist(), strict=True))
            row[kvd] = hits / len(ex)
        out[name] = row
    for kvd in kv_dtypes:
        out.setdefault("mean", {})[kvd] = sum(out[k][kvd] for k in tasks) / len(tasks)
    return out


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/kvx-student",
                    help="the reference model (a directory under the repository; e.g. models/kvx-teacher-2x, which "
                         "retrieves, for recall under eviction)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--press", default="expected_attention")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--recall", nargs="*", default=["192:32", "192:32:64", "1400:8"],
                    metavar="CONTEXT:EXAMPLES[:BUDGET]",
                    help="recall runs: context length, examples per task and optionally the press budget (default "
                         "--budget; the studies' task set: 192:32, where budget 1024 evicts nothing; 192:32:64 "
                         "evicts two thirds; code_recall's filler fits up to ~1400 tokens); none: skip")
    ap.add_argument("--configs", nargs="+", default=["mla+press", "press", "mla"])
    ap.add_argument("--formats", nargs="+", default=None,
                    help="cache formats of every config (default: int8 and fp8 for mla+press, int8 otherwise; fp16 / "
                         "bf16 show how agreement falls with the rounding error)")
    ap.add_argument("--equalize", choices=("auto", "on", "off"), default="auto",
                    help="MLA latent equalization (MLASettings.equalize_latent): auto = as convert does (int8 only)")
    ap.add_argument("--recall-configs", nargs="+", default=["mla+press", "press"])
    ap.add_argument("--mla-model", help="a saved MLA directory (e.g. `kvexport distill`'s output) for the MLA configs, "
                                        "used as it is (no rewrite, its own latent basis for every format)")
    ap.add_argument("--distill-tokens", type=int, help="MLA configs: distill the rewrite from the original student on "
                                                          "this many train-split tokens first (e.g. 1048576)")
    ap.add_argument("--runtime", choices=("pytorch", "onnxruntime"), default="pytorch",
                    help="onnxruntime: export the model with each format and with fp32 (export_model, as `kvexport "
                         "export --kv-dtype` does), and compare the exports (kvexport.export.twin.twin_compare_exports); "
                         "no recall runs")
    ap.add_argument("--export-dir", help="where --runtime onnxruntime writes its exports (default: a temporary directory)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "quantized_results.json"))
    args = ap.parse_args(argv)
    if [r.lower() for r in args.recall] == ["none"]:
        args.recall = []
    if args.runtime == "onnxruntime":
        return export_twins(args)

    from kvexport.eval.data import heldout_windows
    from kvexport.export.twin import twin_compare_many
    from kvexport.mla.config import equalizes_latent
    from kvexport.presses import make_press

    torch.manual_seed(0)
    results: dict = {"settings": {k.replace("_", "-"): v for k, v in vars(args).items() if k != "out"},
                     "threads": torch.get_num_threads(), "configs": {}}
    t_all = time.perf_counter()
    def equalized(cfg: str, kvd: str) -> bool:
        if args.mla_model:  # the directory's own basis
            return False
        return cfg.startswith("mla") and (args.equalize == "on" or (args.equalize == "auto" and equalizes_latent(kvd)))

    for cfg in args.configs:
        fmts = tuple(args.formats or FORMATS[cfg])

        def press_factory():
            return make_press(args.press, budget=args.budget)

        evicts = cfg != "mla"
        factory = press_factory if evicts else None
        entry: dict = {"press": args.press if evicts else None, "budget": args.budget if evicts else None,
                       "window": args.window if evicts else None, "chunk": args.chunk, "twin": {}}
        t0 = time.perf_counter()
        models = {}
        for eq in sorted({equalized(cfg, k) for k in fmts}):  # one rewrite per latent basis
            dec, tok, info = build(cfg.startswith("mla"), eq, args.mla_model, args.distill_tokens, args.model)
            models[eq] = dec
            wins = heldout_windows(tok, args.windows, args.context + args.steps + 1)
            if wins.shape[0] < args.windows:
                raise SystemExit(f"only {wins.shape[0]} held-out windows of {args.context} tokens")
            entry.update({k: v for k, v in info.items() if k != "mla"})
            entry["mla"] = None if info["mla"] is None else {k: v for k, v in info["mla"].items()
                                                             if k != "equalize_latent"}
            part = twin_compare_many(dec, wins, args.context, args.steps,
                                     tuple(k for k in fmts if equalized(cfg, k) == eq), factory, window=args.window,
                                     chunk=args.chunk, batch=args.windows, progress=print,
                                     capacity=None if evicts else args.context + args.steps)
            for kvd, r in part.items():
                entry["twin"][kvd] = {**r, "equalize_latent": eq if not args.mla_model else
                                      bool(info["mla"] and info["mla"]["equalize_latent"])}
        entry["twin"] = {k: entry["twin"][k] for k in fmts}
        entry["twin_seconds"] = round(time.perf_counter() - t0, 1)
        dec = models[equalized(cfg, "int8")] if equalized(cfg, "int8") in models else next(iter(models.values()))
        models.clear()
        for kvd, r in entry["twin"].items():
            print(f"{cfg} {kvd}: agreement {r['next_token_agreement']:.4f} KL {r['mean_kl']:.2e} "
                  f"max|dlogit| {r['max_abs_logit_diff']:.3f} kept equal {r['kept_agreement']} overlap {r['kept_overlap']} ({entry['twin_seconds']} s)",
                  flush=True)
        if cfg in args.recall_configs:
            entry["recall"] = {}
            for spec in args.recall:
                ctx, n, *rest = (int(x) for x in spec.split(":"))
                bud = rest[0] if rest else args.budget
                t0 = time.perf_counter()
                r = recall(dec, tok, (lambda b=bud: make_press(args.press, budget=b)) if evicts else (lambda: None),
                           args.window, args.chunk, ("fp32", "int8"), n, ctx, batch=16)
                r["seconds"] = round(time.perf_counter() - t0, 1)
                r["budget"] = bud if evicts else None
                entry["recall"][spec] = r
                print(f"{cfg} recall at {ctx}: {r}", flush=True)
        results["configs"][cfg] = entry
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    finish(results, args.out)


def export_twins(args) -> None:
    """--runtime onnxruntime: fp32 and quantized exports of the student, compared on onnxruntime."""
    import tempfile

    from kvexport.convert.config import showcase_mla
    from kvexport.eval.data import heldout_windows
    from kvexport.export import export_model
    from kvexport.export.twin import twin_compare_exports
    from kvexport.mla.config import equalizes_latent
    from kvexport.models.loading import load_tokenizer
    from kvexport.presses import make_press
    from kvexport.profile.run import model_spec

    path = ROOT / args.model
    rank, rope = showcase_mla(model_spec(path))
    wins = heldout_windows(load_tokenizer(path), args.windows, args.context + args.steps + 1)
    results: dict = {"settings": {k.replace("_", "-"): v for k, v in vars(args).items() if k not in ("out", "export_dir")},
                     "runtime": "onnxruntime (CPUExecutionProvider)", "configs": {}}
    t_all = time.perf_counter()
    if args.export_dir:
        Path(args.export_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.export_dir) as tmp:
        for cfg in args.configs:
            if cfg == "mla":
                print("skipping mla (full cache) on onnxruntime: its twin needs a capacity per context")
                continue
            fmts = tuple(args.formats or FORMATS[cfg])
            mla_kw = dict(mla_rank=rank, rope_dim=rope) if cfg.startswith("mla") else {}
            src = path
            if cfg.startswith("mla") and args.mla_model:  # a saved MLA model is exported as it is
                src, mla_kw = Path(args.mla_model), {}
            dirs, secs = {}, {}
            for kvd in ("fp32", *fmts):
                t0 = time.perf_counter()
                dirs[kvd] = export_model(src, Path(tmp) / f"{cfg}-{kvd}", press=make_press(args.press, budget=args.budget),
                                         window=args.window, chunk=args.chunk, batch=args.windows, kv_dtype=kvd,
                                         **mla_kw)
                secs[kvd] = round(time.perf_counter() - t0, 1)
                print(f"exported {cfg} {kvd} in {secs[kvd]} s", flush=True)
            t0 = time.perf_counter()
            twin = twin_compare_exports(dirs["fp32"], {k: dirs[k] for k in fmts}, wins, args.context, args.steps,
                                        threads=torch.get_num_threads(), progress=print)
            entry = {"model": str(src.relative_to(ROOT) if src.is_relative_to(ROOT) else src), "press": args.press, "budget": args.budget, "window": args.window,
                     "chunk": args.chunk,
                     "mla": ({"kv_rank": rank, "rope_dim": rope, "distilled": False} if mla_kw else
                             {"dir": str(src)} if cfg.startswith("mla") else None),
                     "export_seconds": secs, "twin_seconds": round(time.perf_counter() - t0, 1), "twin": twin}
            for kvd in fmts:
                entry["twin"][kvd]["equalize_latent"] = bool(mla_kw) and equalizes_latent(kvd)  # a saved model: its own
                r = twin[kvd]
                print(f"{cfg} {kvd} export: agreement {r['next_token_agreement']:.4f} KL {r['mean_kl']:.2e} "
                      f"overlap {r['kept_overlap']}", flush=True)
            results["configs"][cfg] = entry
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    results["threads"] = torch.get_num_threads()
    finish(results, args.out)


def finish(results: dict, out: str) -> None:
    """The machine's load and cores into ``results``, the table printed, the JSON written to ``out``."""
    from kvexport.atomic import atomic_write_bytes

    try:
        results["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    results["cpus"] = os.cpu_count()
    print_table(results)
    atomic_write_bytes(Path(out), (json.dumps(results, indent=2) + "\n").encode())
    print(f"wrote {out}")


def print_table(results: dict) -> None:
    s = results["settings"]
    print(f"\ncontext {s['context']}, {s['windows']} windows x {s['steps']} teacher-forced steps, "
          f"{s['press']} budget {s['budget']} window {s['window']} chunk {s['chunk']}")
    print(f"{'config':<10} {'cache':<5} {'agreement':>9} {'mean KL':>9} {'max|dl|':>8} {'kept eq':>8} {'overlap':>8} "
          f"{'margin@miss':>11} {'bytes fp32':>11} {'bytes q':>9}")
    for name, e in results["configs"].items():
        for kvd, r in e["twin"].items():
            kept = "-" if r["kept_agreement"] is None else f"{r['kept_agreement']:.3f}"
            ov = "-" if r.get("kept_overlap") is None else f"{r['kept_overlap']:.4f}"
            mm = r["fp32_margin"]["median_disagreeing"]
            print(f"{name:<10} {kvd:<5} {100 * r['next_token_agreement']:8.2f}% {r['mean_kl']:9.2e} "
                  f"{r['max_abs_logit_diff']:8.3f} {kept:>8} {ov:>8} {'-' if mm is None else f'{mm:.3f}':>11} "
                  f"{r['cache_bytes']['fp32']:>11} {r['cache_bytes'][kvd]:>9}")
        for rc in (e.get("recall") or {}).values():
            for task in ("code_recall", "passkey", "span_recall", "mean"):
                print(f"{name:<10} recall {task:<12} fp32 {100 * rc[task]['fp32']:5.1f}  int8 "
                      f"{100 * rc[task]['int8']:5.1f}  (context {rc['context_tokens']}, budget {rc['budget']}, "
                      f"{rc['examples_per_task']} examples)")


if __name__ == "__main__":
    main()
