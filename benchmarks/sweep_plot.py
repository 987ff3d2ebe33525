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


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    lines = defaultdict(list)
    for r in summary["rows"]:
        if r["bytes_8k"] is None or r["context"] != 4096:
            continue
        lines[r["variant"]].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(13, 7.5))
    names = sorted(lines)
    # one look per variant, the same on both panels: 20 colours, then the markers tell the rest apart
    looks = {n: (plt.get_cmap("tab20")(i % 20), "osD^v"[(i // 20) % 5]) for i, n in enumerate(names)}
    for ax, key, label in ((axes[0], "agreement", "next-token agreement with the original at 4k"),
                           (axes[1], "passkey", "passkey accuracy (1.5k and 4k)")):
        for name in names:
            rs = sorted(lines[name], key=lambda x: x["bytes_8k"])
            xs = [x["bytes_8k"] / 1e6 for x in rs if x[key] is not None]
            ys = [x[key] for x in rs if x[key] is not None]
            if not xs:
                continue
            color, marker = looks[name]
            ax.plot(xs, ys, "-" if len(xs) > 1 else "", marker=marker, color=color, label=name,
                    lw=2 if ("lookahead" in name) else 1, ms=5)
        if summary["full_cache_bytes_8k"]:
            ax.axvline(summary["full_cache_bytes_8k"] / 1e6, color="k", ls=":", lw=1)
            ax.axvline(summary["full_cache_bytes_8k"] / 4e6, color="r", ls=":", lw=1)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("resident cache per sequence at 8k tokens, MB\n(black dotted: the full cache; red: 4x smaller)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.subplots_adjust(bottom=0.33, top=0.92, wspace=0.2)
    fig.suptitle("SmolLM2-135M-Instruct: what each cache keeps of the original, against the bytes it holds")
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["summarize", "load", "bytes_at"]
