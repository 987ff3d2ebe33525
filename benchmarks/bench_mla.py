# SPDX-License-Identifier: Apache-2.0
"""MLA cache size and absorbed-decode step time against the original GQA attention.

One attention layer of a given shape (default: Llama-3.2-1B's, 32 heads, 8 KV heads, head_dim 64, hidden 2048)
with random weights, rewritten to MLA at a few ranks (d_rope 32). For each context N a decode step is one
token attending over N cached tokens: GQA reads K and V (B, 8, N, 64) each; absorbed MLA reads one latent
(B, 1, N, r_kv + 32) and applies W_UK / W_UV on the query side. Reported: cache bytes per token and layer
(fp16 and the run dtype), the median step time over ``--reps`` runs, and the ratio to GQA.

    python benchmarks/bench_mla.py [--ranks 64 128 256 512] [--contexts 512 2048 8192] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvexport.mla.attention import MLAAttention
from kvexport.mla.config import MLASettings
from kvexport.mla.rewrite import plan_layer
from kvexport.models.attention import GQAAttention
from kvexport.models.rope import Rotary
from kvexport.models.spec import ModelSpec


def make_layer(hidden: int, heads: int, kv_heads: int, head_dim: int) -> tuple[ModelSpec, GQAAttention]:
    spec = ModelSpec(model_type="llama", vocab_size=32, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=1,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                     max_position_embeddings=131072, rope={"rope_type": "default", "rope_theta": 500000.0})
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    torch.manual_seed(0)
    return spec, GQAAttention(spec, Rotary(inv)).eval()


def step_time(fn, reps: int, device: str) -> float:
    """Fastest of ``reps`` runs of ``fn()`` after 3 warm-ups, in seconds (the minimum is the least disturbed
    by other work on a shared machine)."""
    times = []
    for i in range(reps + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--shape", type=int, nargs=4, default=[2048, 32, 8, 64], metavar=("HIDDEN", "HEADS", "KV", "HEAD_DIM"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    H, Hq, Hkv, D = args.shape
    spec, gqa = make_layer(H, Hq, Hkv, D)
    layers = {"gqa": gqa.to(args.device, dt)}
    for r in args.ranks:
        plan, w = plan_layer(gqa.float().cpu(), MLASettings(kv_rank=r, rope_dim=args.rope_dim), None)
        m = MLAAttention(spec, plan, gqa.rotary, absorb=True)
        state = {k: v.float() for k, v in w.items()}
        state.update({k: v for k, v in m.state_dict().items() if k.endswith("inv_freq")})
        m.load_state_dict(state)
        layers[f"mla r{r}"] = m.eval().to(args.device, dt)
        gqa.to(args.device, dt)
    B = args.batch
    print(f"# one attention layer, hidden {H}, {Hq} heads, {Hkv} KV heads, head_dim {D}, d_rope {args.rope_dim}, "
          f"batch {B}, {args.device} {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| attention | cache elems/token/layer | bytes/token/layer (fp16) | "
          + " | ".join(f"decode step @ {n} (ms)" for n in args.contexts) + " |")
    print("|---|---|---|" + "---|" * len(args.contexts))
    base: dict[int, float] = {}
    for name, layer in layers.items():
        per_tok = 2 * Hkv * D if name == "gqa" else layer.key_dim
        cells = []
        for n in args.contexts:
            h = torch.randn(B, 1, H, device=args.device, dtype=dt)
            pos = torch.full((B, 1), n, device=args.device)
            Hc, Dk, Dv = layer.cache_heads, layer.key_dim, layer.value_dim
            pk = torch.randn(B, Hc, n, Dk, device=args.device, dtype=dt)
            pv = torch.randn(B, Hc, n, Dv, device=args.device, dtype=dt)
            pp = torch.arange(n, device=args.device).expand(B, Hc, n)
            t = step_time(lambda layer=layer, h=h, pos=pos, pk=pk, pv=pv, pp=pp: layer(h, pos, pk, pv, pp),
                          args.reps, args.device)
            if name == "gqa":
                base[n] = t
                cells.append(f"{t * 1e3:.3f}")
            else:
                cells.append(f"{t * 1e3:.3f} ({t / base[n]:.2f}x)")
        ratio = "" if name == "gqa" else f" ({2 * Hkv * D / per_tok:.2f}x smaller)"
        print(f"| {name} | {per_tok}{ratio} | {per_tok * 2} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
