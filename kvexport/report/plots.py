# SPDX-License-Identifier: Apache-2.0
"""The report's figures (matplotlib, Agg): decode latency, memory and prefill time against context,
the converted model beside the uncompressed baseline. Each function returns PNG bytes or None when the
profile lacks the data."""

from __future__ import annotations

import io
from typing import Any

COLORS = {"converted": "#1f77b4", "baseline": "#7f7f7f"}
LABELS = {"converted": "converted (kvexport)", "baseline": "baseline (full cache)"}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    _plt().close(fig)
    return buf.getvalue()


def _variants(profile: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, v in (profile.get("variants") or {}).items():
        rows = [r for r in (v or {}).get("contexts", []) if isinstance(r, dict)]
        if rows:
            out[name] = sorted(rows, key=lambda r: r["context"])
    return out


def _axes(title: str, ylabel: str, logy: bool = False):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_fmt_int())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_fmt_num())
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def decode_latency_plot(profile: dict[str, Any]) -> bytes | None:
    """Per-token decode latency: p50 (solid; shaded: p10-p90 of the p50 over repeated runs) and p90 (dotted),
    per variant."""
    vs = _variants(profile)
    if not vs:
        return None
    fig, ax = _axes("Decode latency per token", "ms / token (p50 solid, p90 dotted)")
    for name, rows in vs.items():
        x = [r["context"] for r in rows]
        c = COLORS.get(name)
        sp = [(r.get("spread") or {}).get("decode_ms_p50") for r in rows]
        if all(sp):
            ax.fill_between(x, [v["p10"] for v in sp], [v["p90"] for v in sp], color=c, alpha=0.18, linewidth=0)
        ax.plot(x, [r["decode_ms_p50"] for r in rows], "o-", color=c, label=f"{LABELS.get(name, name)}, p50")
        ax.plot(x, [r["decode_ms_p90"] for r in rows], ":", color=c, alpha=0.6, linewidth=1, label=f"{name}, p90")
    ax.set_ylim(bottom=0)
    ax.legend()
    return _png(fig)


def memory_plot(profile: dict[str, Any]) -> bytes | None:
    """Two panels: KV-cache bytes per sequence (analytic) and the process's measured peak RSS, per variant."""
    vs = _variants(profile)
    rows = (profile.get("cache") or {}).get("contexts") or []
    if not vs and not rows:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    mib = 1024.0 * 1024.0
    for ax, title, ylabel in ((a1, "KV cache per sequence (analytic)", "MiB (log)"),
                              (a2, "Process peak RSS (measured)", "MiB")):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_fmt_int())
        ax.grid(True, which="both", alpha=0.3)
    if rows:
        x = [r["context"] for r in rows]
        a1.plot(x, [r["kv_bytes"] / mib for r in rows], "o-", color=COLORS["converted"], label=LABELS["converted"])
        a1.plot(x, [r["baseline_kv_bytes"] / mib for r in rows], "o-", color=COLORS["baseline"],
                label=LABELS["baseline"])
        a1.set_yscale("log")
        a1.yaxis.set_major_formatter(_fmt_num())
        a1.legend(fontsize=8)
    for name, vrows in vs.items():
        if all("peak_rss_bytes" in r for r in vrows):
            a2.plot([r["context"] for r in vrows], [r["peak_rss_bytes"] / mib for r in vrows], "s-",
                    color=COLORS.get(name), label=LABELS.get(name, name))
    if vs:
        a2.set_ylim(bottom=0)
        a2.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _fmt_int():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}")


def _fmt_num():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def prefill_plot(profile: dict[str, Any]) -> bytes | None:
    """Time to first token (= prefill of the whole prompt) per variant."""
    vs = _variants(profile)
    if not vs:
        return None
    fig, ax = _axes("Time to first token (prefill)", "seconds (log)", logy=True)
    for name, rows in vs.items():
        ax.plot([r["context"] for r in rows], [max(r["ttft_s"], 1e-6) for r in rows], "o-",
                color=COLORS.get(name), label=LABELS.get(name, name))
    ax.legend()
    return _png(fig)


def throughput_plot(profile: dict[str, Any]) -> bytes | None:
    """Decode tokens/s per variant."""
    vs = _variants(profile)
    if not vs:
        return None
    fig, ax = _axes("Decode throughput", "tokens / s (1 / median step)")
    for name, rows in vs.items():
        ax.plot([r["context"] for r in rows], [r["tokens_per_s"] or 0 for r in rows], "o-",
                color=COLORS.get(name), label=LABELS.get(name, name))
    ax.set_ylim(bottom=0)
    ax.legend()
    return _png(fig)


#: file stem -> (caption, function)
PLOTS = {
    "decode_latency": ("Decode latency per token against context length, converted vs baseline (shaded: p10–p90 "
                       "over repeated runs)", decode_latency_plot),
    "throughput": ("Decode tokens per second against context length", throughput_plot),
    "memory": ("KV-cache bytes per sequence (analytic) and measured process peak memory against context length",
               memory_plot),
    "prefill": ("Time to first token against prompt length", prefill_plot),
}


def make_plots(profile: dict[str, Any] | None) -> dict[str, tuple[str, bytes]]:
    """-> {stem: (caption, png bytes)} for every plot the profile has data for."""
    if not profile:
        return {}
    out = {}
    for stem, (caption, fn) in PLOTS.items():
        png = fn(profile)
        if png:
            out[stem] = (caption, png)
    return out


__all__ = ["make_plots", "PLOTS", "decode_latency_plot", "memory_plot", "prefill_plot", "throughput_plot"]
