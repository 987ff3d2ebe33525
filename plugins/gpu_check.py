# SPDX-License-Identifier: Apache-2.0
"""LatentAttention decode benchmark for scripts/gpu_check.sh: achieved bandwidth vs the card's copy bandwidth.

LatentAttention is memory-bound at decode: per step it must read the latent cache (B, S, R + Dr) and its positions
once, plus the (small) queries, and write the output and the per-slot attention mass. This script times the kernel
(libkvexport_kernels.so through ctypes, CUDA events, L2 flushed before every call) at contexts 1k-32k, divides
those minimal bytes by the time, and compares with the device-to-device copy bandwidth measured here with torch.
It also reports the bytes the kernel really moves (its float32 logits workspace is written and read once more) and
the time of the pure-PyTorch reference for scale. Writes <out>/latent_attention_bench.{json,md}.

    python plugins/gpu_check.py --lib build/kernels/libkvexport_kernels.so --out plugins/results/<gpu>_<date>
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.plugins.kernels_lib import KernelsLib, latent_attention_reference  # noqa: E402

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
# (label, batch, query heads, rank R, rope dims Dr, dtype)
SHAPES = (
    ("X-EcoMLA Llama-3.2-1B r128", 1, 32, 128, 32, torch.float16),
    ("X-EcoMLA r512", 1, 32, 512, 64, torch.float16),
    ("batch 8, r128", 8, 32, 128, 32, torch.float16),
    ("fp32, r128", 1, 32, 128, 32, torch.float32),
)


def copy_bandwidth_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy: (read + write) bytes / time, GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1e3 / iters
    del a, b
    return 2 * nbytes / sec / 1e9


def timed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median seconds of fn() over iters calls, each after an L2 flush, CUDA events around the call only."""
    times = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return times[len(times) // 2]


def bench_one(lib: KernelsLib, label, B, H, R, Dr, dtype, S, flush, iters, with_reference) -> dict:
    D = R + Dr
    es = torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, H, 1, D, device="cuda", generator=g).to(dtype)
    latent = torch.randn(B, S, D, device="cuda", generator=g).to(dtype)
    lpos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    qpos = torch.full((B, 1), S - 1, device="cuda")
    scale = 1 / math.sqrt(D)
    ws = torch.empty(lib.workspace_size(B, H, 1, S, R), dtype=torch.uint8, device="cuda")
    out, mass = lib.latent_attention(q, latent, qpos, lpos, R, scale, workspace=ws)
    ref_out, ref_mass = latent_attention_reference(q, latent, qpos, lpos, R, scale)
    sec = timed(lambda: lib.latent_attention(q, latent, qpos, lpos, R, scale, workspace=ws), flush, iters)
    must = B * S * D * es + B * S * 8 + B * H * D * es + B * 8 + B * H * R * es + B * S * 4
    extra = 2 * B * H * S * 4  # float32 logits written by the split kernel, read by the mass kernel
    row = dict(
        shape=label,
        batch=B,
        heads=H,
        rank=R,
        rope=Dr,
        dtype=str(dtype).replace("torch.", ""),
        context=S,
        kernel_us=sec * 1e6,
        must_bytes=must,
        achieved_gbs=must / sec / 1e9,
        moved_bytes=must + extra,
        moved_gbs=(must + extra) / sec / 1e9,
        max_abs_err_out=(out.float() - ref_out.float()).abs().max().item(),
        max_abs_err_mass=(mass - ref_mass).abs().max().item(),
    )
    if with_reference:
        ref_iters = max(3, iters // 5)
        row["torch_ref_us"] = 1e6 * timed(
            lambda: latent_attention_reference(q, latent, qpos, lpos, R, scale), flush, ref_iters
        )
    return row


def bench(lib: KernelsLib, iters: int, with_reference: bool) -> list[dict]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size or (64 << 20)
    flush = torch.empty(4 * l2, dtype=torch.uint8, device="cuda")
    rows = []
    for label, B, H, R, Dr, dtype in SHAPES:
        for S in CONTEXTS:
            rows.append(bench_one(lib, label, B, H, R, Dr, dtype, S, flush, iters, with_reference))
            print(f"{label} S={S}: {rows[-1]['kernel_us']:.1f} us, {rows[-1]['achieved_gbs']:.0f} GB/s", flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# LatentAttention decode bandwidth: {meta['gpu']} ({meta['date']})",
        "",
        f"Device-to-device copy bandwidth (torch, read + write): **{meta['copy_gbs']:.0f} GB/s**. "
        "`achieved` = bytes the op must move (latent + positions + q in, out + attn_mass out) / kernel time; "
        "`moved` adds the float32 logits workspace the kernel writes and reads again. L2 flushed before each call; "
        f"median of {meta['iters']} calls. CUDA {meta['cuda']}, torch {meta['torch']}.",
        "",
        "| shape | dtype | B | context | kernel µs | must MB | achieved GB/s | % of copy | moved GB/s | torch ref µs | "
        "max err out | max err mass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = f"{r['torch_ref_us']:.1f}" if "torch_ref_us" in r else "-"
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['context']} | {r['kernel_us']:.1f} | "
            f"{r['must_bytes'] / 1e6:.2f} | {r['achieved_gbs']:.0f} | {100 * r['achieved_gbs'] / meta['copy_gbs']:.0f}% | "
            f"{r['moved_gbs']:.0f} | {ref} | {r['max_abs_err_out']:.2e} | {r['max_abs_err_mass']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, type=Path, help="libkvexport_kernels.so")
    ap.add_argument("--out", required=True, type=Path, help="folder for latent_attention_bench.{json,md}")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-reference", action="store_true", help="skip timing the PyTorch reference")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible to torch", file=sys.stderr)
        return 5
    lib = KernelsLib(args.lib)
    props = torch.cuda.get_device_properties(0)
    meta = dict(
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        sms=props.multi_processor_count,
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cuda=torch.version.cuda,
        torch=torch.__version__,
        iters=args.iters,
        library=str(args.lib),
    )
    meta["copy_gbs"] = copy_bandwidth_gbs()
    rows = bench(lib, args.iters, not args.no_reference)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latent_attention_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    md = markdown(meta, rows)
    (args.out / "latent_attention_bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
