# SPDX-License-Identifier: Apache-2.0
"""The report's sections (:mod:`kvexport.report.sections`) as HTML (one self-contained file, figures as
base64 PNG) and Markdown (figures as PNG files beside it)."""

from __future__ import annotations

import base64
import html
import re
from typing import Any

from kvexport.report.blocks import Code, Section, Table, Warn, fmt, fmt_bytes, fmt_ratio, verdict_text
from kvexport.report.sections import build_sections, fidelity_summary, profile_warnings

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
.degraded{background:#fff4d6;color:#7a5200;border:1px solid #f0c36d}
table.kv th{background:#f7f9fb;font-weight:600;width:1%;white-space:nowrap}
.figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:12px}
figure.wide{grid-column:1/-1}
figure.wide img{width:auto;max-width:100%}
figure{margin:0}
figure img{width:100%;border:1px solid #dde2e8}
figcaption{font-size:12px;color:#555}
.warn{background:#fff4d6;border:1px solid #e8c66a;border-left:5px solid #d49b00;padding:8px 12px;margin:8px 0;
font-size:14px}
pre{background:#f0f3f6;border:1px solid #dde2e8;padding:8px 12px;font-size:12.5px;overflow-x:auto}
"""

# the page notes, in attributes nobody sees, whether each figure decoded (naturalWidth > 0); a browser test
# reads them back from the rendered DOM
IMG_CHECK_JS = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.querySelectorAll('img.plot'));
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  imgs.forEach(function (i) { i.setAttribute('data-natural-width', String(i.naturalWidth)); });
  document.body.setAttribute('data-images-decoded', ok.length + '/' + imgs.length);
});
"""


#: a number with at most a short unit and a bracketed remark: right-aligned in tables
_NUMERIC = re.compile(r"[-+]?[\d.,]+(e[-+]?\d+)?(\s?\S{1,12})?( \([^)]*\))?")


def _cell(v: Any) -> str:
    s = html.escape(str(v))
    num = isinstance(v, (int, float)) or (isinstance(v, str) and bool(_NUMERIC.fullmatch(v)))
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
                    cells = [f"<th>{html.escape(str(r[0]))}</th>"] + [f"<td>{html.escape(str(c))}</td>" for c in r[1:]] \
                        if kv else [_cell(c) for c in r]
                    out.append("<tr>" + "".join(cells) + "</tr>")
                out.append("</tbody></table>")
            elif isinstance(b, Warn):
                out.append(f'<div class="warn">{html.escape(b.text)}</div>')
            elif isinstance(b, Code):
                out.append(f"<pre><code>{html.escape(b.text)}</code></pre>")
            elif b[0] == "verdict":
                cls = b[2] if isinstance(b[2], str) else "none" if b[2] is None else ("pass" if b[2] else "fail")
                vid = b[3] if len(b) > 3 else "parity-verdict"
                ida = f' id="{vid}"' if vid else ""
                out.append(f'<div{ida} class="verdict {cls}">{html.escape(b[1])}</div>')
            elif b[0] == "img":
                data = base64.b64encode(plots[b[1]][1]).decode("ascii")
                cap = html.escape(b[2])
                wide = ' class="wide"' if b[1] == "memory" else ""
                out.append(f'<figure{wide}><img class="plot" id="plot-{b[1]}" alt="{cap}" '
                           f'src="data:image/png;base64,{data}"><figcaption>{cap}</figcaption></figure>')
        out.append("</section>")
        if s.anchor == "plots":
            out[-1] = "</div></section>"
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
            elif isinstance(b, Warn):
                out += [f"> **Warning:** {b.text}", ""]
            elif isinstance(b, Code):
                out += ["```bash", b.text, "```", ""]
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


__all__ = ["render_html", "render_md", "build_sections", "verdict_text", "fmt", "fmt_bytes", "fmt_ratio",
           "fidelity_summary", "profile_warnings", "Section", "Table"]
