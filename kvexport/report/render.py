# SPDX-License-Identifier: Apache-2.0
"""Turn the report dictionary into sections of tables, then into HTML (one self-contained file,
figures as base64 PNG) and Markdown (figures as PNG files beside it)."""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    title: str
    anchor: str
    blocks: list[Any] = field(default_factory=list)  # str paragraphs, Table, ("img", stem, caption)


# ----------------------------------------------------------------------------- formatting
def fmt_bytes(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) < 1e-3 or abs(v) >= 1e5:
            return f"{v:.2e}"
        return f"{v:.{digits}g}" if abs(v) < 1 else f"{v:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v) if len(v) <= 8 else f"{len(v)} values"
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)[:120]
    return str(v)


def verdict_text(parity: dict[str, Any] | None) -> str:
    if parity is None:
        return "Parity: NOT RUN"
    return "Parity: PASSED" if parity["passed"] else "Parity: FAILED"


# ----------------------------------------------------------------------------- sections
def build_sections(rep: dict[str, Any], plot_stems: dict[str, str]) -> list[Section]:
    conv = rep.get("convert") or {}
    prof = rep.get("profile") or {}
    parity = rep.get("parity")
    secs = []

    s = Section("Summary", "summary")
    settings = conv.get("settings") or {}
    model = conv.get("model") or {}
    cache = prof.get("cache") or conv.get("cache") or {}
    summary_rows = [["model", model.get("name") or settings.get("model") or "-"],
                    ["family", model.get("family", "-")],
                    ["parity", verdict_text(parity).split(": ", 1)[1]]]
    if cache:
        summary_rows.append(["KV bytes per token (converted / baseline)",
                             f"{fmt_bytes(cache.get('bytes_per_token'))} / {fmt_bytes(cache.get('baseline_bytes_per_token'))}"
                             f" ({fmt(cache.get('per_token_ratio'))}x smaller per token)"])
        rows = cache.get("contexts") or []
        if rows:
            last = rows[-1]
            summary_rows.append([f"KV cache at {last['context']} tokens (converted / baseline)",
                                 f"{fmt_bytes(last['kv_bytes'])} / {fmt_bytes(last['baseline_kv_bytes'])} "
                                 f"({fmt(last['ratio'])}x)"])
    vs = prof.get("variants") or {}
    conv_rows = (vs.get("converted") or {}).get("contexts") or []
    base_rows = (vs.get("baseline") or {}).get("contexts") or []
    if conv_rows:
        c = conv_rows[-1]
        b = next((r for r in base_rows if r["context"] == c["context"]), None)
        txt = f"{fmt(c['decode_ms_p50'])} ms converted"
        if b:
            txt += f" vs {fmt(b['decode_ms_p50'])} ms baseline"
        summary_rows.append([f"decode p50 at {c['context']} tokens ({prof.get('backend', '?')})", txt])
    s.blocks.append(Table(["", ""], summary_rows))
    secs.append(s)

    s = Section("Model and rewrite settings", "settings")
    if model:
        s.blocks.append(Table(["model field", "value"], [[k, fmt(v)] for k, v in model.items()]))
    if settings:
        s.blocks.append(Table(["setting", "value"], [[k, fmt(v)] for k, v in settings.items()]))
    if not model and not settings:
        s.blocks.append("No convert.json in this directory (profiled export only).")
    secs.append(s)

    s = Section("Cache compression", "cache")
    if cache:
        sh = cache.get("shape") or {}
        s.blocks.append(
            f"Per token and sequence: {fmt_bytes(cache.get('bytes_per_token'))} cached, against "
            f"{fmt_bytes(cache.get('baseline_bytes_per_token'))} for the original model's full cache "
            f"({fmt(cache.get('per_token_ratio'))}x). "
            + (f"Static budget {sh.get('budget')} + window {sh.get('window')} slots per layer: the cache size "
               "does not grow with the context." if sh.get("budget") else
               f"Full cache allocated once at {sh.get('capacity')} slots (the export's capacity)."
               if sh.get("capacity") else "Full cache: grows with the context."))
        s.blocks.append(Table(["context", "KV cache (converted)", "KV cache (baseline)", "ratio", "position indices"],
                              [[r["context"], fmt_bytes(r["kv_bytes"]), fmt_bytes(r["baseline_kv_bytes"]),
                                f"{fmt(r['ratio'])}x", fmt_bytes(r.get("index_bytes"))]
                               for r in cache.get("contexts") or []]))
    else:
        s.blocks.append("No cache accounting (profile not run).")
    secs.append(s)

    s = Section("Parity", "parity")
    s.blocks.append(("verdict", verdict_text(parity), None if parity is None else parity["passed"]))
    if parity is not None:
        hdr = ["backend pair", "max abs logit error", "max rel logit error", "token agreement", "index agreement",
               "steps", "verdict"]
        s.blocks.append(Table(hdr, [[p["pair"], fmt(p.get("max_abs_logit_error")), fmt(p.get("max_rel_logit_error")),
                                     fmt(p.get("token_agreement")), fmt(p.get("index_agreement")),
                                     fmt(p.get("steps")),
                                     "PASSED" if p.get("passed") else ("FAILED" if p.get("passed") is False else "-")]
                                    for p in parity["pairs"]]))
        if parity.get("tolerances"):
            s.blocks.append("Tolerances: " + ", ".join(f"{k} = {fmt(v)}" for k, v in parity["tolerances"].items()))
    else:
        s.blocks.append("Validation was not run (--no-validate).")
    secs.append(s)

    if rep.get("studies"):
        s = Section("Accuracy studies", "accuracy")
        for name, data in rep["studies"].items():
            s.blocks.append(f"{name}:")
            if isinstance(data, dict):
                scal = [[k, fmt(v)] for k, v in data.items() if not isinstance(v, (dict, list))]
                if scal:
                    s.blocks.append(Table(["field", "value"], scal))
                for k, v in data.items():
                    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                        keys = list(dict.fromkeys(kk for x in v for kk in x))[:8]
                        s.blocks.append(f"{k}:")
                        s.blocks.append(Table(keys, [[fmt(x.get(kk)) for kk in keys] for x in v[:50]]))
        secs.append(s)

    s = Section("Latency", "latency")
    if vs:
        s.blocks.append(f"Backend {prof.get('backend', '?')}; {prof.get('decode_steps', '?')} decode steps per context; "
                        "prompts of random token ids; one warm-up run not counted.")
        for name, v in vs.items():
            rows = v.get("contexts") or []
            s.blocks.append(f"{name}:")
            s.blocks.append(Table(["context", "time to first token (s)", "prefill tokens/s", "decode p50 (ms)",
                                   "decode p90 (ms)", "tokens/s"],
                                  [[r["context"], fmt(r["ttft_s"]), fmt(r.get("prefill_tokens_per_s")),
                                    fmt(r["decode_ms_p50"]), fmt(r["decode_ms_p90"]), fmt(r["tokens_per_s"])]
                                   for r in rows]))
        skipped = prof.get("skipped_contexts")
        if skipped:
            s.blocks.append("Skipped contexts: " + "; ".join(f"{k['context']} ({k['reason']})" for k in skipped))
    else:
        s.blocks.append("Profile not run (--no-profile).")
    secs.append(s)

    s = Section("Memory", "memory")
    if vs:
        for name, v in vs.items():
            rows = v.get("contexts") or []
            hdr = ["context", "KV cache (analytic)", "process peak RSS", "RSS growth during run"]
            extra = [k for k in ("gpu_memory_used_bytes", "torch_cuda_peak_bytes", "engine_device_memory_bytes")
                     if any(k in r for r in rows)]
            s.blocks.append(f"{name}:")
            s.blocks.append(Table(hdr + [k.replace("_bytes", "").replace("_", " ") for k in extra],
                                  [[r["context"], fmt_bytes(r.get("kv_bytes")), fmt_bytes(r.get("peak_rss_bytes")),
                                    fmt_bytes(r.get("rss_delta_bytes"))] + [fmt_bytes(r.get(k)) for k in extra]
                                   for r in rows]))
            teg = [r for r in rows if r.get("tegrastats")]
            if teg:
                s.blocks.append(Table(["context", "RAM peak (MB)", "GPU load mean (%)", "GPU freq max (MHz)",
                                       "power mean (mW)"],
                                      [[r["context"], fmt(r["tegrastats"].get("ram_used_mb_peak")),
                                        fmt(r["tegrastats"].get("gpu_load_pct_mean")),
                                        fmt(r["tegrastats"].get("gpu_freq_mhz_max")),
                                        ", ".join(f"{k} {v['mean']:.0f}" for k, v in
                                                  (r["tegrastats"].get("power_mw") or {}).items())]
                                       for r in teg]))
        files = []
        for name, v in vs.items():
            files.append([name, fmt_bytes(v.get("files_bytes")), str(len(v.get("files") or {}))])
        s.blocks.append("Model and engine files:")
        s.blocks.append(Table(["variant", "bytes on disk", "files"], files))
    else:
        s.blocks.append("Profile not run (--no-profile).")
    secs.append(s)

    if plot_stems:
        s = Section("Plots", "plots")
        for stem, caption in plot_stems.items():
            s.blocks.append(("img", stem, caption))
        secs.append(s)

    stages = [r for r in conv.get("stages") or [] if r.get("status") != "pending"]
    if stages:
        s = Section("Stages", "stages")
        s.blocks.append(Table(["stage", "status", "wall time (s)", "note"],
                              [[r["name"], r["status"], fmt(r.get("seconds")), r.get("note", "")] for r in stages]))
        secs.append(s)

    env = prof.get("environment") or conv.get("environment")
    if env:
        s = Section("Environment", "environment")
        s.blocks.append(Table(["", ""], [[k, fmt(v)] for k, v in env.items()]))
        secs.append(s)
    order = ["summary", "parity", "plots", "cache", "latency", "memory", "accuracy", "settings", "stages",
             "environment"]
    return sorted(secs, key=lambda x: order.index(x.anchor) if x.anchor in order else len(order))


# ----------------------------------------------------------------------------- HTML
CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1b1f24}
header{background:#1b2a41;color:#fff;padding:18px 32px}
header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c9d3e0;font-size:13px}
nav{padding:8px 32px;background:#e9edf2;font-size:13px}
nav a{margin-right:14px;color:#1b2a41}
main{padding:8px 32px 40px;max-width:1100px}
section{background:#fff;border:1px solid #dde2e8;border-radius:6px;padding:12px 20px;margin:16px 0}
h2{font-size:17px;margin:4px 0 10px}
table{border-collapse:collapse;margin:8px 0 12px;font-size:13px}
th,td{border:1px solid #dde2e8;padding:4px 10px;text-align:left}
th{background:#f0f3f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.verdict{display:inline-block;font-size:18px;font-weight:700;padding:6px 14px;border-radius:4px;margin:4px 0 8px}
.pass{background:#dff5e1;color:#17692a;border:1px solid #8fd19e}
.fail{background:#fde2e1;color:#9b1c1c;border:1px solid #f1a5a3}
.none{background:#eef0f3;color:#555;border:1px solid #ccd}
table.kv th{background:#f7f9fb;font-weight:600;width:1%;white-space:nowrap}
.figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:12px}
figure.wide{grid-column:1/-1}
figure.wide img{width:auto;max-width:100%}
figure{margin:0}
figure img{width:100%;border:1px solid #dde2e8}
figcaption{font-size:12px;color:#555}
"""

# the page records whether each figure decoded (naturalWidth > 0): the browser test reads it back
IMG_CHECK_JS = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.querySelectorAll('img.plot'));
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  imgs.forEach(function (i) { i.setAttribute('data-natural-width', String(i.naturalWidth)); });
  var el = document.getElementById('img-check');
  el.textContent = 'images loaded: ' + ok.length + '/' + imgs.length;
  el.setAttribute('data-loaded', String(ok.length));
  el.setAttribute('data-total', String(imgs.length));
});
"""


def _cell(v: Any) -> str:
    s = html.escape(str(v))
    num = isinstance(v, (int, float)) or (isinstance(v, str) and v[:1].isdigit())
    return f'<td class="num">{s}</td>' if num else f"<td>{s}</td>"


def render_html(rep: dict[str, Any], plots: dict[str, tuple[str, bytes]]) -> str:
    """One self-contained HTML page: inline CSS, figures as ``data:image/png;base64`` URIs."""
    secs = build_sections(rep, {k: v[0] for k, v in plots.items()})
    title = html.escape(rep.get("title", "kvexport report"))
    conv = rep.get("convert") or {}
    sub = html.escape(f"{conv.get('created', '')}  {conv.get('kvexport_version', '') and 'kvexport ' + conv['kvexport_version']}")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{title}</title><style>{CSS}</style></head><body>",
           f'<header><h1 id="title">{title}</h1><p>{sub}</p></header>',
           "<nav>" + "".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in secs) + "</nav><main>"]
    for s in secs:
        out.append(f'<section id="{s.anchor}"><h2>{html.escape(s.title)}</h2>')
        if s.anchor == "plots":
            out.append('<div class="figs">')
        for b in s.blocks:
            if isinstance(b, str):
                out.append(f"<p>{html.escape(b)}</p>")
            elif isinstance(b, Table):
                kv = not any(str(h) for h in b.headers)  # key/value table: keys as row headers, no header row
                out.append('<table class="kv">' if kv else "<table>")
                if not kv:
                    out.append("<thead><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in b.headers)
                               + "</tr></thead>")
                out.append("<tbody>")
                for r in b.rows:
                    cells = [f"<th>{html.escape(str(r[0]))}</th>"] + [_cell(c) for c in r[1:]] if kv else \
                        [_cell(c) for c in r]
                    out.append("<tr>" + "".join(cells) + "</tr>")
                out.append("</tbody></table>")
            elif b[0] == "verdict":
                cls = "none" if b[2] is None else ("pass" if b[2] else "fail")
                out.append(f'<div id="parity-verdict" class="verdict {cls}">{html.escape(b[1])}</div>')
            elif b[0] == "img":
                data = base64.b64encode(plots[b[1]][1]).decode("ascii")
                cap = html.escape(b[2])
                wide = ' class="wide"' if b[1] == "memory" else ""
                out.append(f'<figure{wide}><img class="plot" id="plot-{b[1]}" alt="{cap}" '
                           f'src="data:image/png;base64,{data}"><figcaption>{cap}</figcaption></figure>')
        out.append("</section>")
        if s.anchor == "plots":
            out[-1] = "</div></section>"
    out.append('<p id="img-check" data-loaded="" data-total="">images not checked (scripts off)</p>')
    out.append(f"</main><script>{IMG_CHECK_JS}</script></body></html>")
    return "\n".join(out)


# ----------------------------------------------------------------------------- Markdown
def render_md(rep: dict[str, Any], plot_files: dict[str, tuple[str, str]]) -> str:
    """Markdown; ``plot_files`` = {stem: (caption, relative png path)}."""
    secs = build_sections(rep, {k: v[0] for k, v in plot_files.items()})
    out = [f"# {rep.get('title', 'kvexport report')}", ""]
    for s in secs:
        out += [f"## {s.title}", ""]
        for b in s.blocks:
            if isinstance(b, str):
                out += [b, ""]
            elif isinstance(b, Table):
                hdr = [str(h) if str(h) else " " for h in b.headers]
                out.append("| " + " | ".join(hdr) + " |")
                out.append("|" + "---|" * len(hdr))
                for r in b.rows:
                    out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
                out.append("")
            elif b[0] == "verdict":
                out += [f"**{b[1]}**", ""]
            elif b[0] == "img":
                out += [f"![{b[2]}]({plot_files[b[1]][1]})", ""]
    return "\n".join(out)


__all__ = ["render_html", "render_md", "build_sections", "verdict_text", "fmt", "fmt_bytes"]
