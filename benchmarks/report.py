# SPDX-License-Identifier: Apache-2.0
"""Results -> markdown tables, the issue's goals checked against them, and plots (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

MIB = 2**20
KV_REF = "optimum"  # row 2: the export users pick today
GOAL_BUDGET_ROWS = ("kvx-snapkv", "kvx-streaming")
FLAT_ROWS = ("kvx-snapkv", "kvx-streaming", "kvx-mla", "kvx-mla-snapkv")
GROWING_ROWS = ("hf", "optimum")


def _ctx(c: int) -> str:
    return f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else str(c)


def _bytes(b) -> str:
    if b is None:
        return "—"
    if b >= MIB:
        return f"{b / MIB:.1f} MiB"
    return f"{b / 1024:.1f} KiB"


def _status(c: dict) -> str:
    s = c.get("status")
    if s == "oom":
        return "OOM"
    if s == "timeout":
        return "timeout"
    if s == "skipped":
        return f"skipped ({c.get('reason')})"
    if s == "build-failed":
        return "build failed"
    if s == "error":
        return "error"
    return s or "?"


def cell_brief(c: dict) -> str:
    if c.get("status") != "ok":
        extra = f": {c['error'][:160]}" if c.get("status") == "error" and c.get("error") else ""
        return _status(c) + extra
    return (f"prefill {c['prefill_s']:.2f} s, decode {c['decode_ms_median']:.2f} ms/tok, "
            f"peak {c['peak_rss'] / MIB:.0f} MiB, KV {_bytes(c['kv_bytes'])}")


def _find(res: dict, shape: str, row: str, ctx: int) -> dict | None:
    for c in res["cells"]:
        if c["shape"] == shape and c["row"] == row and c["context"] == ctx:
            return c
    return None


def _ok(c: dict | None) -> bool:
    return c is not None and c.get("status") == "ok"


def _quality(c: dict) -> str:
    q = c.get("quality")
    if not q:
        return "—"
    return f"agree {q['agreement']:.2f}, ppl {q['ppl']:.1f} (r={q['ratio']:g})"


def markdown(res: dict) -> str:
    m = res["machine"]
    bw = res["bandwidth"]["copy_gbps"]
    lines = [f"Command: `{res['command']}` ({res['mode']}), {res['date_utc']}, wall {res.get('wall_s', 0):.0f} s.",
             "",
             f"Machine: {m['cpu']}, {m['affinity_cores']} cores, {m['memory_gib']} GiB; load average "
             f"{m['loadavg_start'][0]:.1f} at start, {m.get('loadavg_end', [0])[0]:.1f} at end. torch {m['torch']}, "
             f"transformers {m['transformers']}, onnxruntime {m['onnxruntime']}"
             + (f"; Optimum venv (transformers, torch, onnxruntime): {m['optimum_venv']}" if m.get("optimum_venv") else "")
             + ".",
             "",
             f"Memory bandwidth (NumPy copy of 256 MiB, read + write, single thread): {bw:.1f} GB/s at start, "
             + "".join(f"{x:.1f}, " for x in res.get("bandwidth_samples", []))
             + f"{res.get('bandwidth_end', {}).get('copy_gbps', float('nan')):.1f} GB/s at end; the bound column "
             f"uses the best, {res.get('bandwidth_best_gbps', bw):.1f} GB/s.",
             ""]
    for note in res.get("notes", []):
        lines.append(f"- {note}")
    if res.get("notes"):
        lines.append("")
    built = [b for b in res.get("builds", []) if b.get("seconds")]
    if built:
        lines.append("Exports built in this run (not part of any cell's time): " + ", ".join(
            f"{b['row']}/{b['shape']} {b['seconds']:.0f} s" for b in built) + ".")
        lines.append("")
    for b in res.get("builds", []):
        if b.get("error"):
            lines.append(f"- build of {b['row']}/{b['shape']} failed: {b['error']}")
    for shape, sh in res["shapes"].items():
        ctxs = sorted({c["context"] for c in res["cells"] if c["shape"] == shape}) or res["settings"]["contexts"]
        lines += [f"### {shape}", "",
                  f"hidden {sh['hidden']}, {sh['layers']} layers, {sh['heads']} heads / {sh['kv_heads']} KV heads of "
                  f"{sh['head_dim']}, MLP {sh['intermediate']}, vocab {sh['vocab']}; {sh['weight_bytes'] / MIB:.1f} MiB "
                  f"of fp32 weights. Static budget {sh['budget']} + window {sh['window']}, prefill chunk {sh['chunk']}; "
                  f"MLA r_kv {sh['mla_rank']} + d_rope {sh['rope_dim']} ({sh['mla_ratio']:.2f}× smaller per token).", ""]
        for title, key, fmt in (("Decode ms/token (median)", "decode_ms_median", "{:.2f}"),
                                ("Peak process memory (MiB)", "peak_rss", None),
                                ("Prefill seconds", "prefill_s", "{:.2f}")):
            lines += [f"{title}:", "", "| row | " + " | ".join(_ctx(c) for c in ctxs) + " |",
                      "|---|" + "---:|" * len(ctxs)]
            for row in res["rows"]:
                cells = []
                for c in ctxs:
                    x = _find(res, shape, row, c)
                    if x is None:
                        cells.append("")
                    elif not _ok(x):
                        cells.append(_status(x).split(" (")[0] if x.get("status") == "skipped" else _status(x))
                    elif key == "peak_rss":
                        cells.append(f"{x['peak_rss'] / MIB:.0f}")
                    else:
                        cells.append(fmt.format(x[key]))
                if any(cells):
                    lines.append(f"| {row} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += ["All figures:", "",
                  "| row | context | prompt | prefill s | prefill tok/s | decode ms/tok median (min, mean) | peak MiB | "
                  "KV bytes | bytes/step | GB/s (% of bw) | accuracy |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in res["rows"]:
            for c in ctxs:
                x = _find(res, shape, row, c)
                if x is None:
                    continue
                if not _ok(x):
                    lines.append(f"| {row} | {_ctx(c)} | {x['prompt_tokens']} | {_status(x)} | | | | "
                                 f"{_bytes(x['kv_bytes'])} | | | {_quality(x)} |")
                    continue
                b = x.get("bound") or {}
                frac = b.get("fraction_of_bandwidth")
                lines.append(
                    f"| {row} | {_ctx(c)} | {x['prompt_tokens']} | {x['prefill_s']:.2f} | {x['prefill_tok_s']:.0f} | "
                    f"{x['decode_ms_median']:.2f} ({x.get('decode_ms_min') or 0:.2f}, {x['decode_ms_mean']:.2f}) | "
                    f"{x['peak_rss'] / MIB:.0f} | "
                    f"{_bytes(x['kv_bytes'])} | {_bytes(b.get('bytes_per_step'))} | "
                    f"{b.get('achieved_gbps', 0):.1f} ({100 * frac:.0f}%) | {_quality(x)} |")
        lines.append("")
    g = res.get("goals") or []
    if g:
        lines += ["### Goals", "", "| goal | measured | met |", "|---|---|---|"]
        for x in g:
            lines.append(f"| {x['goal']} | {x['measured']} | {x['met']} |")
        lines.append("")
    return "\n".join(lines)


def _ratio(a, b):
    return a / b if a and b else None


def goals(res: dict) -> list[dict]:
    """The issue's goals, each with what was measured and "yes" / "no" / "n/a" (a row or context missing)."""
    out = []
    shapes = list(res["shapes"])
    ctxs = res["settings"]["contexts"]
    ref_ctx = 16384 if 16384 in ctxs else max(ctxs)
    lo = min(ctxs)

    def add(goal, measured, met):
        out.append({"goal": goal, "measured": measured, "met": "n/a" if met is None else ("yes" if met else "no")})

    s = "student" if "student" in shapes else (shapes[0] if shapes else None)
    if s is None:
        return out
    ref = _find(res, s, KV_REF, ref_ctx)
    hf = _find(res, s, "hf", ref_ctx)
    for row in GOAL_BUDGET_ROWS:
        k = _find(res, s, row, ref_ctx)
        if not _ok(k):
            continue
        t = k["decode_ms_median"]
        if _ok(ref):
            r = ref["decode_ms_median"] / t
            add(f"{s} {_ctx(ref_ctx)}: {row} decode ≥5× faster than {KV_REF}", f"{r:.1f}×", r >= 5)
            m = ref["peak_rss"] / k["peak_rss"]
            add(f"{s} {_ctx(ref_ctx)}: {row} peak memory ≤ 1/4 of {KV_REF}", f"1/{m:.1f}", m >= 4)
        elif ref is not None:
            add(f"{s} {_ctx(ref_ctx)}: {row} decode ≥5× faster / memory ≤1/4 of {KV_REF}",
                f"{KV_REF}: {_status(ref)}; {row} {t:.2f} ms/tok, {k['peak_rss'] / MIB:.0f} MiB", None)
            # the same comparison at the largest context row 2 completed
            done = [c for c in ctxs if c < ref_ctx and _ok(_find(res, s, KV_REF, c)) and _ok(_find(res, s, row, c))]
            if done:
                c = max(done)
                r2, k2 = _find(res, s, KV_REF, c), _find(res, s, row, c)
                r = r2["decode_ms_median"] / k2["decode_ms_median"]
                add(f"(largest context {KV_REF} completes, {_ctx(c)}) {row} decode vs {KV_REF}", f"{r:.1f}×", r >= 5)
                m = r2["peak_rss"] / k2["peak_rss"]
                add(f"(largest context {KV_REF} completes, {_ctx(c)}) {row} peak memory vs {KV_REF}", f"1/{m:.1f}",
                    m >= 4)
        if _ok(hf):
            r = hf["decode_ms_median"] / t
            add(f"{s} {_ctx(ref_ctx)}: {row} decode ≥10× faster than hf", f"{r:.1f}×", r >= 10)
    for sh in shapes:
        have = sorted({c["context"] for c in res["cells"] if c["shape"] == sh})
        hi = ref_ctx if ref_ctx in have else (max(have) if have else ref_ctx)
        for row in FLAT_ROWS + GROWING_ROWS:
            a, b = _find(res, sh, row, lo), _find(res, sh, row, hi)
            if not (_ok(a) and _ok(b)) or lo == hi:
                if a is not None and b is not None and lo != hi:
                    add(f"{sh}: {row} decode growth {_ctx(lo)}→{_ctx(hi)}", f"{_status(b)} at {_ctx(hi)}",
                        None if row in FLAT_ROWS else True)
                continue
            g = b["decode_ms_median"] / a["decode_ms_median"] - 1
            if row in FLAT_ROWS:
                add(f"{sh}: {row} decode grows ≤15% {_ctx(lo)}→{_ctx(hi)}", f"{100 * g:+.0f}%", g <= 0.15)
            else:
                add(f"{sh}: {row} decode grows with context {_ctx(lo)}→{_ctx(hi)}", f"{100 * g:+.0f}%", g > 0.15)
    a, b = _find(res, s, "kvx-mla-snapkv", ref_ctx), _find(res, s, KV_REF, ref_ctx)
    if a is not None and b is not None:
        r = b["kv_bytes"] / a["kv_bytes"]
        add(f"{s} {_ctx(ref_ctx)}: MLA+budget KV bytes ≥50× smaller than {KV_REF}",
            f"{r:.0f}× ({_bytes(a['kv_bytes'])} vs {_bytes(b['kv_bytes'])})", r >= 50)
    top = max(ctxs)
    if top >= 32768 and 2048 in ctxs:
        for row in GOAL_BUDGET_ROWS + ("kvx-mla-snapkv",):
            k, k2 = _find(res, s, row, top), _find(res, s, row, 2048)
            if k is None:
                continue
            if not _ok(k):
                add(f"{s} {_ctx(top)} prompt completes with chunked prefill ({row})", _status(k), False)
                continue
            add(f"{s} {_ctx(top)} prompt, {row}: peak memory < 2 GB", f"{k['peak_rss'] / 1e9:.2f} GB",
                k["peak_rss"] < 2e9)
            if _ok(k2):
                r = k["prefill_tok_s"] / k2["prefill_tok_s"]
                add(f"{s}: {row} prefill tok/s at {_ctx(top)} ≥ ½ of 2k", f"{k['prefill_tok_s']:.0f} vs "
                    f"{k2['prefill_tok_s']:.0f} tok/s ({r:.2f})", r >= 0.5)
    return out


def plots(res: dict, out: Path) -> list[Path]:
    """decode_ms.png and peak_memory.png: one panel per shape, one line per row, log-log against context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    shapes = list(res["shapes"])
    for key, fname, ylabel, scale in (("decode_ms_median", "decode_ms.png", "decode ms/token (median)", 1.0),
                                      ("peak_rss", "peak_memory.png", "peak process RSS (MiB)", 1 / MIB)):
        fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
        for ax, sh in zip(axes[0], shapes, strict=False):
            for row in res["rows"]:
                pts = [(c["context"], c[key] * scale) for c in res["cells"]
                       if c["shape"] == sh and c["row"] == row and _ok(c)]
                fails = [c["context"] for c in res["cells"] if c["shape"] == sh and c["row"] == row
                         and c.get("status") in ("oom", "timeout")]
                if not pts and not fails:
                    continue
                line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=row)[0]
                if fails and pts:
                    ax.plot([fails[0]], [pts[-1][1]], marker="x", ms=10, color=line.get_color(), ls="none")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{sh} (× = OOM/timeout at that context)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = Path(out) / fname
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(p)
    return files
