# SPDX-License-Identifier: Apache-2.0
"""MLA recovery per CPU-minute on a real model: the layer-wise refit (:mod:`kvexport.mla.refit`) against the
undistilled rewrite, at X-EcoMLA's compression points, on SmolLM2-135M-Instruct (or ``--model``).

    python -m benchmarks.refit_real --out docs/studies/smollm2/refit.json

Per point (r_kv + d_rope 32 for 1.9x / 3.6x / 6.4x): the rewrite (library defaults, calibrated on 16 x 256 tokens of
the standard library's train split, as ``kvexport eval mla`` does) and each refit setting (steps per layer, sequences
x length of calibration text from the train split, lr), each scored on the same things as the MLA study: KL(original
|| rewrite) per token and top-1 agreement on 4 held-out code windows of 256 tokens, and the quick task set (next
tokens, code recall, passkey, span recall; :mod:`kvexport.eval.tasks`). Wall seconds of the refit, the threads, the
load average are recorded. Compare with self-distillation of the same rewrites in docs/studies.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct, kvexport get smollm2)")
    ap.add_argument("--ratios", default="1.9,3.6,6.4")
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--configs", default="50:256:8,100:256:8,100:512:8",
                    help="refit settings steps:seq_len:sequences, comma separated (the first ratio runs all of them, "
                         "the others the --others)")
    ap.add_argument("--others", default="100:256:8", help="refit settings for the ratios after the first")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write (rewritten after every result)")
    a = ap.parse_args(argv)

    import torch

    from kvexport.eval.data import heldout_windows, train_tokens
    from kvexport.eval.mla_study import DistillSettings, ranks_for_ratios, rewrite_settings, study_data
    from kvexport.eval.tasks import TaskSet, TaskSettings, evaluate_tasks
    from kvexport.mla import rewrite_to_mla
    from kvexport.mla.distill import forward_kl
    from kvexport.mla.io import load_decoder
    from kvexport.mla.refit import RefitSettings, refit
    from kvexport.models.loading import load_tokenizer

    torch.set_num_threads(a.threads)
    if a.model is None:
        from kvexport.models import fetch

        fetch.get("smollm2", quiet=True)
        a.model = str(fetch.hf_dir("smollm2"))
    tok = load_tokenizer(a.model)
    dec, _ = load_decoder(a.model)
    dec.eval()
    T = 256
    ids = heldout_windows(tok, 4, T)
    pos = torch.arange(T).expand(ids.shape[0], T)
    tasks = TaskSet(tok, TaskSettings(context_len=160, future_len=16, n_next=8, n_recall=16))  # eval's --quick
    data = study_data(tok, DistillSettings(budgets=(4096,), batch_size=4, lr=1e-4))
    with torch.no_grad():
        teacher = dec(ids, pos)

    def score(m) -> dict:
        with torch.no_grad():
            s = m(ids, pos)
        r = {"kl": forward_kl(teacher, s).item(), "top1": (s.argmax(-1) == teacher.argmax(-1)).float().mean().item()}
        r.update({k: v for k, v in evaluate_tasks(m, tasks).items() if isinstance(v, float)})
        return r

    def parse(cs: str) -> list[tuple[int, int, int]]:
        return [tuple(int(x) for x in c.split(":")) for c in cs.split(",") if c]  # type: ignore[misc]

    out = {"model": Path(a.model).name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": a.threads, "lr": a.lr,
           "held_out": "4 x 256 tokens of held-out stdlib code (KL, top1); the quick task set (accuracy)",
           "calibration": "rewrite: 16 x 256 train-split tokens; refit: train_tokens(seed 7), steps:seq_len:sequences",
           "original": score(dec), "points": {}}
    ratios = [float(x) for x in a.ratios.split(",")]
    plan = {p["target"]: p for p in ranks_for_ratios(dec.spec, tuple(ratios), a.rope_dim)}
    print(f"original: {out['original']}", flush=True)
    for n, target in enumerate(ratios):
        p = plan[target]
        m0 = rewrite_to_mla(dec, rewrite_settings(p["kv_rank"], p["rope_dim"], T), data["calib"]).eval()
        row = {"kv_rank": p["kv_rank"], "rope_dim": p["rope_dim"], "ratio": p["ratio"], "undistilled": score(m0),
               "refit": []}
        out["points"][f"{target}x"] = row
        print(f"{target}x undistilled: {row['undistilled']}", flush=True)
        for steps, seq_len, seqs in parse(a.configs if n == 0 else a.others):
            m = copy.deepcopy(m0)
            cal = train_tokens(tok, seqs * seq_len, seed=7)[: seqs * seq_len].view(seqs, seq_len)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            rep = refit(dec, m, cal, RefitSettings(steps=steps, lr=a.lr, seq_len=seq_len, sequences=seqs))
            sec = time.perf_counter() - t0
            r = {"steps": steps, "seq_len": seq_len, "sequences": seqs, "tokens": seqs * seq_len,
                 "seconds": round(sec, 1), "load_before": load0, "load_after": os.getloadavg()[0],
                 "loss_before": rep["loss_before"], "loss_after": rep["loss_after"], **score(m.eval())}
            row["refit"].append(r)
            print(f"{target}x refit {steps} steps on {seqs} x {seq_len}: {r}", flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(out, indent=1) + "\n")
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'point':>6} {'setting':>22} {'seconds':>8} {'KL':>7} {'top1':>6} {'accuracy':>8} {'passkey':>7}")
    for k, row in out["points"].items():
        u = row["undistilled"]
        print(f"{k:>6} {'undistilled':>22} {'':>8} {u['kl']:7.3f} {u['top1']:6.3f} {u['accuracy']:8.3f} "
              f"{u['passkey']:7.3f}")
        for r in row["refit"]:
            name = f"refit {r['steps']} x {r['sequences']}x{r['seq_len']}"
            print(f"{k:>6} {name:>22} {r['seconds']:8.0f} {r['kl']:7.3f} {r['top1']:6.3f} {r['accuracy']:8.3f} "
                  f"{r['passkey']:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
