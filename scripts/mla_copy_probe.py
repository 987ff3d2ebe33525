# SPDX-License-Identifier: Apache-2.0
"""How much of the model does each GQA -> MLA rewrite keep, before any distillation? For per-token budgets
from the GQA cache size down to 12.8x, each RoPE init (rorope, perhead, xeco) and latent fit (wpca, svd) at a
given split, the undistilled MLA student is scored against the original on held-out text (forward KL,
top-1 agreement, top-1 accuracy on copied spans: the induction head) and on the study task set
(kvexport/eval/tasks.py). The rewrite is calibrated on train-split text; held-out text is only scored.

    python scripts/mla_copy_probe.py [MODEL] [--budgets 128:64,68:32,36:12,20:4,10:2] [--inits rorope,perhead,xeco]
                                     [--fits wpca,svd] [--dropped mean] [--horizon 256] [--calib text|random]
                                     [--threads 1]

``--exact-tiny`` instead prints, for tiny random Llama, Qwen2, Qwen3 and Mistral models at 1, 2, 4 and 8 query
heads per KV head, the largest logit difference of the exact rewrite (r_kv = d_rope = n_kv · head_dim) from
the HF model's, for both attention paths (the numbers of docs/mla.md; tests/mla/test_rewrite.py asserts < 1e-4).

``--budgets`` lists ``elements:d_rope`` pairs (r_kv = elements - d_rope, clamped to the latent's rank; xeco's
d_rope is capped at head_dim). Prints one JSON line per configuration (a few seconds each on a CPU).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvexport.eval.data import heldout_windows, train_tokens
from kvexport.eval.tasks import TaskSet, TaskSettings, evaluate_tasks
from kvexport.mla import MLASettings, max_kv_rank, rewrite_to_mla
from kvexport.mla.io import load_decoder
from kvexport.mla.recall_data import copy_augment
from kvexport.mla.split import kl_to
from kvexport.models.loading import load_tokenizer
from kvexport.paths import DEFAULT_MODEL


@torch.no_grad()
def fidelity(model, ref, held: torch.Tensor, copied: torch.Tensor, mask: torch.Tensor) -> dict:
    """KL(ref || model) and top-1 agreement on ``held`` (B, T); top-1 accuracy on the copied positions of ``copied``."""
    pos = torch.arange(held.shape[1]).expand(held.shape[0], -1)
    a, b = ref(held, pos), model(held, pos)
    hit = model(copied[:, :-1], pos).argmax(-1) == copied[:, 1:]
    return {"kl": kl_to(a, b), "agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "copy_acc": hit[mask].float().mean().item()}


@torch.no_grad()
def exact_tiny() -> None:
    from kvexport.mla import set_absorb
    from kvexport.models.decoder import Decoder
    from kvexport.models.tiny import tiny_model

    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(48).expand(2, 48)
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        for heads, kv in ((4, 4), (4, 2), (8, 2), (8, 1)):
            hf = tiny_model(family, heads=heads, kv_heads=kv, seed=heads + kv)
            dec = Decoder.from_hf(hf)
            s = dec.spec
            full = s.num_kv_heads * s.head_dim
            r = max_kv_rank(s.hidden_size, s.num_kv_heads, s.head_dim, full, s.qk_norm)
            mla = rewrite_to_mla(dec, MLASettings(kv_rank=r, rope_dim=full))
            want = hf(ids).logits
            errs = {}
            for absorb in (True, False):
                set_absorb(mla, absorb)
                errs["absorbed" if absorb else "naive"] = (mla(ids, pos) - want).abs().max().item()
            print(json.dumps({"family": family, "q_per_kv": heads // kv, "cache": r + full,
                              "gqa_cache": 2 * full, **{k: float(f"{v:.2e}") for k, v in errs.items()}}), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("--budgets", default="128:64,68:32,36:12,20:4,10:2", help="elements:d_rope pairs")
    ap.add_argument("--inits", default="rorope,perhead,xeco")
    ap.add_argument("--fits", default="wpca,svd")
    ap.add_argument("--dropped", default="mean", help="dropped-RoPE rules to try (mean, none, zero)")
    ap.add_argument("--horizon", type=int, default=256, help="RoPE horizon (the model's training window)")
    ap.add_argument("--calib", choices=("text", "random"), default="text",
                    help="calibration: train-split text, or the library default (seeded random token ids)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exact-tiny", action="store_true", help="only the exactness table on tiny random models")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.exact_tiny:
        exact_tiny()
        return
    tok = load_tokenizer(a.model)
    tasks = TaskSet(tok, TaskSettings())
    dec, _ = load_decoder(a.model)
    s = dec.spec
    calib = train_tokens(tok, 16 * 256, seed=7)[: 16 * 256].view(16, 256) if a.calib == "text" else None
    held = heldout_windows(tok, 16, 257, offset=3)
    copied = copy_augment(held, 1.0, seed=0)
    changed = (copied != held)[:, 1:]
    mask = changed & torch.cat([torch.zeros(len(held), 1, dtype=torch.bool), changed[:, :-1]], 1)

    def show(label: dict, model) -> None:
        scores = {**fidelity(model, dec, held[:, :-1], copied, mask), **evaluate_tasks(model, tasks)}
        print(json.dumps({**label, **{k: round(v, 4) for k, v in scores.items()}}), flush=True)

    show({"model": "original"}, dec)
    for item in a.budgets.split(","):
        total, dr = (int(v) for v in item.split(":"))
        for init in a.inits.split(","):
            d = min(dr, s.head_dim) if init == "xeco" else dr
            for fit in a.fits.split(","):
                for rule in a.dropped.split(","):
                    r = min(total - d, max_kv_rank(s.hidden_size, s.num_kv_heads, s.head_dim, d, s.qk_norm))
                    settings = MLASettings(kv_rank=r, rope_dim=d, rope_init=init, kv_fit=fit, dropped_rope=rule,
                                           rope_horizon=a.horizon)
                    show({"elements": r + d, "ratio": round(2 * s.num_kv_heads * s.head_dim / (r + d), 2),
                          "init": init, "fit": fit, "dropped": rule, "kv_rank": r, "rope_dim": d,
                          "horizon": a.horizon, "calib": a.calib}, rewrite_to_mla(dec, settings, calib))


if __name__ == "__main__":
    main()
