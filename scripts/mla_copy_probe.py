# SPDX-License-Identifier: Apache-2.0
"""How much of the model does each GQA -> MLA rewrite keep, before any distillation? For per-token budgets
from the GQA cache size down to 12.8x, each RoPE init (rorope, perhead, xeco) and latent fit (wpca, svd) at a
given split, the undistilled MLA student is scored against the original on held-out text (forward KL,
top-1 agreement, top-1 accuracy on copied spans: the induction head) and on the study task set
(kvexport/eval/tasks.py). The rewrite is calibrated on train-split text; held-out text is only scored.

    python scripts/mla_copy_probe.py [MODEL] [--budgets 128:64,68:32,36:12,20:4,10:2] [--inits rorope,perhead,xeco]
                                     [--fits wpca,svd] [--horizon 256] [--threads 1]

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
from kvexport.mla.recall_data import copy_augment
from kvexport.mla.split import kl_to
from kvexport.models.loading import load_decoder, load_tokenizer
from kvexport.paths import DEFAULT_MODEL


@torch.no_grad()
def fidelity(model, ref, held: torch.Tensor, copied: torch.Tensor, mask: torch.Tensor) -> dict:
    """KL(ref || model) and top-1 agreement on ``held`` (B, T); top-1 accuracy on the copied positions of ``copied``."""
    pos = torch.arange(held.shape[1]).expand(held.shape[0], -1)
    a, b = ref(held, pos), model(held, pos)
    hit = model(copied[:, :-1], pos[:, :-1]).argmax(-1) == copied[:, 1:]
    return {"kl": kl_to(a, b), "agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "copy_acc": hit[mask].float().mean().item()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("--budgets", default="128:64,68:32,36:12,20:4,10:2", help="elements:d_rope pairs")
    ap.add_argument("--inits", default="rorope,perhead,xeco")
    ap.add_argument("--fits", default="wpca,svd")
    ap.add_argument("--horizon", type=int, default=256, help="RoPE horizon (the model's training window)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    tasks = TaskSet(tok, TaskSettings())
    dec, _ = load_decoder(a.model)
    s = dec.spec
    calib = train_tokens(tok, 16 * 256, seed=7)[: 16 * 256].view(16, 256)
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
                r = min(total - d, max_kv_rank(s.hidden_size, s.num_kv_heads, s.head_dim, d, s.qk_norm))
                settings = MLASettings(kv_rank=r, rope_dim=d, rope_init=init, kv_fit=fit, rope_horizon=a.horizon)
                show({"elements": r + d, "ratio": round(2 * s.num_kv_heads * s.head_dim / (r + d), 2), "init": init,
                      "fit": fit, "kv_rank": r, "rope_dim": d}, rewrite_to_mla(dec, settings, calib))


if __name__ == "__main__":
    main()
