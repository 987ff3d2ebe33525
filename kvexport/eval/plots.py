# SPDX-License-Identifier: Apache-2.0
"""PNG figures of the studies (matplotlib, Agg backend)."""

from __future__ import annotations

PRESS_COLORS = {
    "expected_attention": "C3",
    "knorm": "C0",
    "tova": "C1",
    "keydiff": "C2",
    "snapkv": "C4",
    "pyramidkv": "C5",
    "streaming_llm": "C6",
    "observed_attention": "C8",
    "random": "grey",
    "optimal": "black",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_press_study(result: dict, path) -> None:
    """Three panels vs compression ratio: layer-output discrepancy, held-out perplexity, next-token agreement;
    one line per press, Optimal dashed black, Random dotted grey."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    keys = [
        ("discrepancy", "layer-output discrepancy ‖h − h_compr‖₂ (lower is better)"),
        ("ppl", "held-out perplexity of the future tokens"),
        ("agreement", "next-token agreement with the full cache"),
    ]
    for ax, (k, title) in zip(axes, keys, strict=True):
        for i, (press, by_ratio) in enumerate(result["results"].items()):
            rs = sorted(by_ratio, key=float)
            style = {"color": PRESS_COLORS.get(press, f"C{i}"), "marker": "o", "ms": 3, "lw": 1.5}
            if press == "optimal":
                style = {"ls": "--", "color": "black", "lw": 2.2}
            elif press == "random":
                style = {"ls": ":", "color": "grey", "lw": 1.5}
            ax.plot([float(r) for r in rs], [by_ratio[r][k] for r in rs], label=press, **style)
        if k == "ppl":
            ax.axhline(result["full_cache"]["ppl"], color="grey", lw=0.8, ls="-.", label="full cache")
        ax.set_xlabel("compression ratio (fraction of prompt tokens evicted)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    s = result["settings"]
    fig.suptitle(
        f"{result.get('model', '')}: {s['windows']} held-out windows, prompt P={s['prompt_len']} compressed once, "
        f"F={s['future_len']} future tokens teacher-forced{' (quick run)' if result.get('quick') else ''}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_mla_study(result: dict, path) -> None:
    """One panel per distillation token budget: accuracy vs KV-cache compression ratio, one line per teacher,
    the undistilled rewrite dotted (when the result has it), the original model dashed (X-EcoMLA's layout)."""
    plt = _plt()
    budgets = list(next(iter(result["results"].values())).keys())
    fig, axes = plt.subplots(1, len(budgets), figsize=(6.2 * len(budgets), 4.4), sharey=True, squeeze=False)
    base = result["baseline"]["accuracy"]
    for ax, b in zip(axes[0], budgets, strict=True):
        for i, (teacher, by_budget) in enumerate(result["results"].items()):
            pts = sorted(by_budget[b].values(), key=lambda r: r["ratio"])
            ax.plot([p["ratio"] for p in pts], [p["accuracy"] for p in pts], marker="o", ms=4, color=f"C{i}",
                    label=f"teacher {teacher}")
        if result.get("undistilled"):
            pts = sorted(result["undistilled"].values(), key=lambda r: r["ratio"])
            ax.plot([p["ratio"] for p in pts], [p["accuracy"] for p in pts], marker="x", ms=4, color="gray", ls=":",
                    label="undistilled rewrite")
        ax.axhline(base, color="black", ls="--", lw=1.5, label=f"{result['student']} (original, full cache)")
        ax.set_xscale("log")
        ticks = [p["ratio"] for p in result["ranks"]]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:.1f}×\nr={p['kv_rank']}+{p['rope_dim']}" for t, p in
                            zip(ticks, result["ranks"], strict=True)], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("KV-cache compression (per token), latent r_kv + RoPE d_rope")
        ax.set_title(f"distilled on {int(b):,} tokens", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (mean of next-token, code, passkey, span recall)")
    lo, hi = axes[0][0].get_ylim()
    axes[0][0].set_ylim(min(lo, 0.0), hi + 0.35 * (hi - lo))  # headroom for the legend above the baseline
    labels = axes[0][0].get_legend_handles_labels()[1]
    # two columns fit the panel only with short labels; a real model's directory name is long
    axes[0][0].legend(fontsize=8, loc="upper right", ncol=2 if max(map(len, labels)) <= 28 else 1)
    fig.suptitle(f"MLA upcycling of {result['student']}{' (quick run)' if result.get('quick') else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
