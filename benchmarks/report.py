# SPDX-License-Identifier: Apache-2.0
"""Results -> markdown tables, the issue's goals checked against them, and plots (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

MIB = 2**20
KV_REF = "optimum"  # the export users pick today
STRONG_REF = "ortgenai"  # the strongest full-cache CPU runtime
GOAL_BUDGET_ROWS = ("kvx-snapkv", "kvx-streaming")
FLAT_ROWS = ("kvx-snapkv", "kvx-streaming", "kvx-mla-snapkv")
FULL_ROWS = ("kvx-full", "kvx-mla-full")  # kvexport's own full caches, written in place
GROWING_ROWS = ("hf", "optimum", "ortgenai")


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
    pre = f"prefill {c['prefill_s']:.2f} s" if c.get("prefill_s") is not None else "cache synthesised"
    res = f", resident {_bytes(c['resident_bytes']['total'])}" if c.get("resident_bytes") else ""
    return (f"{pre}, decode {c['decode_ms_median']:.2f} ms/tok, peak {c['peak_rss'] / MIB:.0f} MiB, "
            f"KV {_bytes(c['kv_bytes'])}{res}")


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
             + "".join(f"; {k[:-5]} venv: {m[k]}" for k in ("ortgenai_venv", "llamacpp_venv") if m.get(k))
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
                  f"of fp32 weights. The static-budget rows other than kvx-default* (which take `kvexport convert`'s "
                  f"defaults, named in the rows' descriptions): budget {sh['budget']} + window {sh['window']}, prefill "
                  f"chunk {sh['chunk']}; the MLA rows: r_kv {sh['mla_rank']} + d_rope {sh['rope_dim']} "
                  f"({sh['mla_ratio']:.2f}× smaller per token).", ""]
        for title, key, fmt in (("Decode ms/token (median)", "decode_ms_median", "{:.2f}"),
                                ("Peak process memory (MiB)", "peak_rss", None),
                                ("Resident cache bytes (every buffer a sequence keeps: K/V, positions, the "
                                 "press's queries, step rows, logits; kvexport rows, measured)", "resident", None),
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
                    elif key == "resident":
                        cells.append(_bytes(x["resident_bytes"]["total"]) if x.get("resident_bytes") else "")
                    elif x.get(key) is None:
                        cells.append("—")
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
                pre = (f"{x['prefill_s']:.2f} | {x['prefill_tok_s']:.0f}" if x.get("prefill_s") is not None
                       else "synthesised | —")
                lines.append(
                    f"| {row} | {_ctx(c)} | {x['prompt_tokens']} | {pre} | "
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
    """Issue 15's targets, each with what was measured and "yes" / "no" / "n/a" (a row or context missing)."""
    out = []
    shapes = list(res["shapes"])
    ctxs = res["settings"]["contexts"]
    hi = 16384 if 16384 in ctxs else max(ctxs)
    lo = 512 if 512 in ctxs else min(ctxs)

    def add(goal, measured, met):
        out.append({"goal": goal, "measured": measured, "met": "n/a" if met is None else ("yes" if met else "no")})

    def t(c):
        return c["decode_ms_median"]

    s = "student" if "student" in shapes else (shapes[0] if shapes else None)
    if s is None:
        return out
    for row in GOAL_BUDGET_ROWS:
        k_lo, k_hi = _find(res, s, row, lo), _find(res, s, row, hi)
        g_lo, g_hi, h_hi = _find(res, s, STRONG_REF, lo), _find(res, s, STRONG_REF, hi), _find(res, s, "hf", hi)
        if _ok(k_lo) and _ok(g_lo):
            r = t(k_lo) / t(g_lo)
            add(f"{s} {_ctx(lo)}: {row} no slower per token than {STRONG_REF}",
                f"{t(k_lo):.3f} vs {t(g_lo):.3f} ms ({r:.2f}×)", r <= 1.0)
        if _ok(k_hi) and _ok(g_hi):
            r = t(g_hi) / t(k_hi)
            add(f"{s} {_ctx(hi)}: {row} ≥10× faster than {STRONG_REF}", f"{r:.1f}×", r >= 10)
        if _ok(k_hi) and _ok(h_hi):
            r = t(h_hi) / t(k_hi)
            add(f"{s} {_ctx(hi)}: {row} ≥20× faster than hf generate", f"{r:.1f}×", r >= 20)
    for sh in shapes:
        for row in FLAT_ROWS:
            a, b = _find(res, sh, row, lo), _find(res, sh, row, hi)
            if _ok(a) and _ok(b) and lo != hi:
                g = t(b) / t(a) - 1
                add(f"{sh}: {row} decode grows ≤10% {_ctx(lo)}→{_ctx(hi)}", f"{100 * g:+.0f}%", g <= 0.10)
        for row in FULL_ROWS:
            a, b = _find(res, sh, row, lo), _find(res, sh, row, hi)
            if not (_ok(a) and _ok(b)) or lo == hi or not (a.get("bound") and b.get("bound")):
                continue
            g = t(b) / t(a) - 1
            gb = b["bound"]["bytes_per_step"] / a["bound"]["bytes_per_step"] - 1
            add(f"{sh}: {row} decode growth {_ctx(lo)}→{_ctx(hi)} ≤ bytes-read growth + 20 %",
                f"{100 * g:+.0f}% vs bytes {100 * gb:+.0f}%", g <= gb + 0.20)
    for sh in shapes:
        if not sh.startswith("llama1b-16"):
            continue
        for row in GOAL_BUDGET_ROWS + ("kvx-mla-snapkv",):
            for c in ctxs:
                k = _find(res, sh, row, c)
                if _ok(k) and k.get("bound") and k["bound"].get("fraction_of_bandwidth"):
                    f = k["bound"]["fraction_of_bandwidth"]
                    add(f"{sh} {_ctx(c)}: {row} decode ≥50 % of the memory-bandwidth bound",
                        f"{100 * f:.0f}% ({t(k):.1f} ms vs floor {k['bound']['floor_ms']:.1f} ms)", f >= 0.5)
    for sh in shapes:
        seen = set()
        for c in res["cells"]:
            if c["shape"] != sh or not c.get("export_bytes") or c["row"] in seen:
                continue
            seen.add(c["row"])
            w = res["shapes"][sh]["weight_bytes"]
            r = c["export_bytes"] / w
            add(f"{sh}: {c['row']} export size ≤1.1× its weights", f"{r:.2f}× ({_bytes(c['export_bytes'])})", r <= 1.1)
    for sh in shapes:
        _real_model_goals(res, sh, ctxs, add)
    a, b = _find(res, s, "kvx-mla-snapkv", hi), _find(res, s, KV_REF, hi)
    if a is not None and b is not None:
        r = b["kv_bytes"] / a["kv_bytes"]
        add(f"{s} {_ctx(hi)}: MLA+budget KV bytes ≥50× smaller than {KV_REF}",
            f"{r:.0f}× ({_bytes(a['kv_bytes'])} vs {_bytes(b['kv_bytes'])})", r >= 50)
    return out


#: issue 33's targets on a real model: (kvexport row, peer row, context, decode speed-up the kvexport row must reach)
REAL_DECODE_TARGETS = (
    [("kvx-default", "ortgenai", c, x) for c, x in ((512, 1.0), (2048, 1.3), (8192, 1.5))]
    + [(row, peer, c, x) for row in ("kvx-default-int4", "kvx-default-int4-a8") for peer in ("ortgenai-int4", "llamacpp")
       for c, x in ((512, 1.0), (8192, 1.5))])
#: (kvexport row, peer row) whose time to first token the kvexport row must not exceed, at every context
REAL_TTFT_TARGETS = (("kvx-default", "ortgenai"), ("kvx-default-int4", "ortgenai-int4"),
                     ("kvx-default-int4-a8", "ortgenai-int4"))
#: rows whose decode step must reach this share of the memory-bandwidth bound, at every context
REAL_BOUND_ROWS, REAL_BOUND_SHARE = ("kvx-default", "kvx-default-fp16", "kvx-default-int4", "kvx-default-int4-a8"), 0.6


def _real_model_goals(res: dict, sh: str, ctxs: list[int], add) -> None:
    """Issue 33's targets on a real model's shape (one that ships a GGUF): decode speed-ups over onnxruntime-genai
    and llama.cpp at equal weight precision, time to first token, and the share of the bandwidth bound."""
    if not (res["shapes"][sh].get("source") or "").startswith("registry:"):
        return
    for row, peer, c, x in REAL_DECODE_TARGETS:
        k, g = _find(res, sh, row, c), _find(res, sh, peer, c)
        if _ok(k) and _ok(g):
            r = g["decode_ms_median"] / k["decode_ms_median"]
            add(f"{sh} {_ctx(c)}: {row} decode ≥ {x:g}× {peer}",
                f"{r:.2f}× ({k['decode_ms_median']:.1f} vs {g['decode_ms_median']:.1f} ms)", r >= x)
    for row, peer in REAL_TTFT_TARGETS:
        for c in ctxs:
            k, g = _find(res, sh, row, c), _find(res, sh, peer, c)
            if _ok(k) and _ok(g) and k.get("prefill_s") and g.get("prefill_s"):
                r = k["prefill_s"] / g["prefill_s"]
                add(f"{sh} {_ctx(c)}: {row} time to first token ≤ 1.0× {peer}",
                    f"{r:.2f}× ({k['prefill_s']:.2f} vs {g['prefill_s']:.2f} s)", r <= 1.0)
    for row in REAL_BOUND_ROWS:
        for c in ctxs:
            k = _find(res, sh, row, c)
            if _ok(k) and k.get("bound") and k["bound"].get("fraction_of_bandwidth"):
                f = k["bound"]["fraction_of_bandwidth"]
                add(f"{sh} {_ctx(c)}: {row} decode ≥ {REAL_BOUND_SHARE:.0%} of the memory-bandwidth bound",
                    f"{f:.0%} ({k['decode_ms_median']:.1f} ms vs floor {k['bound']['floor_ms']:.1f} ms)",
                    f >= REAL_BOUND_SHARE)


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
