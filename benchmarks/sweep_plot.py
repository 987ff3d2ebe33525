# SPDX-License-Identifier: Apache-2.0
"""Summarize the sweep's JSON-lines files (benchmarks/sweep_real.py) into ``summary.json``, ``sweep.md`` and
``fidelity_vs_bytes.png``: fidelity against the bytes a sequence's cache holds at 8k tokens, one line per press.

Resident bytes at 8k: a static cache (a press) holds the same bytes whatever the length (measured); a full cache
holds its bytes per slot (measured at the longest probe) times 8192 slots.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

AT = 8192


def load(out: Path) -> list[dict]:
    rows = {}
    for f in sorted(out.glob("sweep_*.jsonl")):
        tier = f.name.split(".")[0].removeprefix("sweep_")
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                r["tier"] = tier
                rows[(tier, r["setting"])] = r
    return list(rows.values())


def bytes_at(r: dict, n: int = AT) -> int | None:
    probes = list(r["probes"].values())
    if not probes:
        return None
    p = max(probes, key=lambda v: v.get("slots") or 0)
    total = int(p["resident_bytes"]["total"])
    if r["press"] is not None:
        return total
    slots = p.get("slots")
    if not slots:
        return None
    return int(total / slots * n)


def full_bytes_at(rows: list[dict], n: int = AT) -> int | None:
    for r in rows:
        for p in r["probes"].values():
            if p.get("full_slots"):
                return int(p["full_bytes"]["total"] / p["full_slots"] * n)
    return None


def variant(r: dict) -> str:
    kw = dict(map(tuple, r.get("press_kw") or [])) | dict(map(tuple, r.get("generate_kw") or []))
    name = r["press"] or "full"
    if kw.get("lookahead"):
        name += "+lookahead"
    if kw.get("neighbors"):
        name += "+neighbors"
    if r.get("mla"):
        name += f" MLA {r['mla']:g}x"
    if r.get("kv_dtype"):
        name += f" {r['kv_dtype']}"
    if r.get("chunk") is None:
        name += " (single-shot)"
    return name


def recall(r: dict, kind: str) -> tuple[float, float] | None:
    got = [(v["accuracy"], v["original"]) for k, v in r["probes"].items() if k.startswith(kind + "@")]
    if not got:
        return None
    return sum(a for a, _ in got) / len(got), sum(o for _, o in got) / len(got)


def summarize(out: Path) -> dict:
    rows = load(out)
    full = full_bytes_at(rows)
    table = []
    for r in rows:
        b = bytes_at(r)
        pk, sp = recall(r, "passkey"), recall(r, "span_recall")
        t = r["text"]
        table.append({"tier": r["tier"], "setting": r["setting"], "variant": variant(r), "budget": r["budget"],
                      "bytes_8k": b, "ratio_8k": (full / b) if (full and b) else None,
                      "context": t["context"], "agreement": t["agreement"], "kl": t["kl"],
                      "ppl_increase": t["ppl_increase"],
                      "passkey": pk[0] if pk else None, "passkey_original": pk[1] if pk else None,
                      "span": sp[0] if sp else None, "span_original": sp[1] if sp else None,
                      "probes": {k: v["accuracy"] for k, v in r["probes"].items()},
                      "probes_original": {k: v["original"] for k, v in r["probes"].items()},
                      "seconds": r["seconds"]})
    table.sort(key=lambda x: (x["tier"], x["variant"], x["budget"] or 0))
    summary = {"full_cache_bytes_8k": full, "rows": table}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "sweep.md").write_text(markdown(summary))
    plot(summary, out / "fidelity_vs_bytes.png")
    return summary


def _pct(x):
    return "" if x is None else f"{100 * x:.1f}"


def markdown(summary: dict) -> str:
    lines = ["| tier | setting | MB at 8k | × smaller | context | agreement % | KL | ppl Δ % | passkey | span |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        mb = "" if r["bytes_8k"] is None else f"{r['bytes_8k'] / 1e6:.1f}"
        ratio = "" if r["ratio_8k"] is None else f"{r['ratio_8k']:.1f}"
        pk = "" if r["passkey"] is None else f"{r['passkey']:.2f} / {r['passkey_original']:.2f}"
        sp = "" if r["span"] is None else f"{r['span']:.2f} / {r['span_original']:.2f}"
        lines.append(f"| {r['tier']} | {r['setting']} | {mb} | {ratio} | {r['context']} | {_pct(r['agreement'])} | "
                     f"{r['kl']:.3f} | {_pct(r['ppl_increase'])} | {pk} | {sp} |")
    return "\n".join(lines) + "\n"


#: the variants the main figure draws: each press as kvpress scores it (chunk 512, as convert exports it), the default's
#: press and the default itself (bold), and the full caches (int8, MLA); the refinements and the one-piece prefills
#: are in the tables and in the second figure
DEFAULT_VARIANTS = ("snapkv+lookahead+neighbors", "snapkv+lookahead+neighbors int8")


def _main_variant(name: str) -> bool:
    if "(single-shot)" in name:
        return False
    return "+" not in name or name in DEFAULT_VARIANTS


def _panels(plt, rows: dict, full: int | None, title: str, path: Path, style) -> None:
    """Agreement and passkey against resident bytes, one line per variant; ``style(name)`` -> plot kwargs."""
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(13, 7))
    for ax, key, label in ((axes[0], "agreement", "next-token agreement with the original at 4k"),
                           (axes[1], "passkey", "passkey accuracy (1.5k and 4k)")):
        for name in sorted(rows):
            rs = sorted(rows[name], key=lambda x: x["bytes_8k"])
            xs = [x["bytes_8k"] / 1e6 for x in rs if x[key] is not None]
            ys = [x[key] for x in rs if x[key] is not None]
            if xs:
                kw = style(name)
                ls = kw.pop("ls")
                ax.plot(xs, ys, ls if len(xs) > 1 else "", label=name, **kw)
        if full:
            ax.axvline(full / 1e6, color="k", ls=":", lw=1)
            ax.axvline(full / 4e6, color="r", ls=":", lw=1)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("resident cache per sequence at 8k tokens, MB\n(black dotted: the full cache; red: 4x smaller)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.subplots_adjust(bottom=0.27, top=0.92, wspace=0.2)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(summary: dict, path: Path) -> None:
    """``path``: each press (chunk 512), the default and the full caches; beside it ``one_piece_vs_chunked.png``: each
    press chunked (solid) and in one piece (dashed), in one colour per press."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = defaultdict(list)
    for r in summary["rows"]:
        if r["bytes_8k"] is None or r["context"] != 4096:
            continue
        lines[r["variant"]].append(r)
    full = summary["full_cache_bytes_8k"]
    main = {n: v for n, v in lines.items() if _main_variant(n)}
    names = sorted(main)
    looks = {n: (plt.get_cmap("tab20")(i % 20), "osD^v"[(i // 20) % 5]) for i, n in enumerate(names)}

    def main_style(name):
        color, marker = looks[name]
        bold = name in DEFAULT_VARIANTS
        return {"ls": "-", "color": "black" if name == DEFAULT_VARIANTS[1] else color, "marker": marker,
                "lw": 3 if bold else 1.2, "ms": 6 if bold else 4}

    _panels(plt, main, full, "SmolLM2-135M-Instruct: what each press keeps of the original, against the bytes it "
            "holds (chunk 512; bold: the default's press, black: the default)", path, main_style)
    presses = sorted({n.removesuffix(" (single-shot)") for n in lines if n.endswith("(single-shot)") and "+" not in n})
    pair = {n: v for n, v in lines.items() if n.removesuffix(" (single-shot)") in presses}
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(presses)}

    def pair_style(name):
        single = name.endswith("(single-shot)")
        return {"ls": "--" if single else "-", "color": colors[name.removesuffix(" (single-shot)")],
                "marker": "o" if single else "s", "lw": 1.5, "ms": 4}

    _panels(plt, pair, full, "SmolLM2-135M-Instruct: each press chunked (solid, chunk 512) and with the prompt in one "
            "piece (dashed)", path.with_name("one_piece_vs_chunked.png"), pair_style)


__all__ = ["summarize", "load", "bytes_at"]
