# SPDX-License-Identifier: Apache-2.0
"""Where does an MLA student lose in-context copying? Scores the study task set (kvexport/eval/tasks.py,
full settings) on a model rewritten to MLA *without* distillation, at the maximal latent rank for each
d_rope and RoPE-pair choice, next to the original model. The MLA study (docs/studies.md) finds every
distilled MLA student at zero span recall; this separates what the rewrite itself costs from what
distillation fails to restore.

    python scripts/mla_copy_probe.py [MODEL] [--rope-dims 32,16,8,4] [--threads 1]

Prints one JSON line per configuration (a few seconds each on a CPU for the bundled student).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvexport.eval.tasks import TaskSet, TaskSettings, evaluate_tasks
from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.mla.config import ROPE_INITS, max_kv_rank
from kvexport.models.loading import load_decoder, load_tokenizer
from kvexport.paths import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("--rope-dims", default="32,16,8,4", help="d_rope values (even, <= head_dim)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    tasks = TaskSet(tok, TaskSettings())
    dec, _ = load_decoder(a.model)
    spec = dec.spec

    def show(label: dict, model) -> None:
        scores = {k: round(v, 3) for k, v in evaluate_tasks(model, tasks).items()}
        print(json.dumps({**label, **scores}), flush=True)

    show({"model": "original"}, dec)
    for d in (int(x) for x in a.rope_dims.split(",")):
        for init in ROPE_INITS:
            if d == spec.head_dim and init != ROPE_INITS[0]:
                continue  # every pair keeps RoPE: the choice of pairs does not matter
            r = max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, d)
            show({"model": "mla", "rope_dim": d, "rope_init": init, "kv_rank": r},
                 rewrite_to_mla(dec, MLASettings(kv_rank=r, rope_dim=d, rope_init=init)))


if __name__ == "__main__":
    main()
