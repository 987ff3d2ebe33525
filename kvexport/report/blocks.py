# SPDX-License-Identifier: Apache-2.0
"""What a report is made of (sections of paragraphs, tables, warnings, code, figures) and how numbers are
written in it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class Warn:
    """A plain warning shown in a box: what to distrust and why."""

    text: str


@dataclass
class Code:
    """Commands to copy (a shell block)."""

    text: str


@dataclass
class Section:
    title: str
    anchor: str
    #: str paragraphs, Table, Warn, Code, ("verdict", text, passed [True/False/None or a css class], html id [default parity-verdict]), ("img", stem, caption)
    blocks: list[Any] = field(default_factory=list)


def fmt_bytes(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_ratio(v: Any) -> str:
    """A ratio as ``151.7×`` (one decimal)."""
    if v is None:
        return "-"
    return f"{float(v):.1f}×"


def fmt_pct(v: Any, signed: bool = False) -> str:
    """A fraction as a percentage: 0.973 -> ``97.3 %``; signed: 0.05 -> ``+5.0 %``."""
    if v is None:
        return "-"
    return f"{100 * float(v):+.1f} %" if signed else f"{100 * float(v):.1f} %"


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


def fmt_sig(v: Any) -> str:
    """A measurement to three significant digits (``2.05``, ``0.0605``, ``794``), never in exponent form."""
    if v is None:
        return "-"
    v = float(v)
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    text = f"{v:.3g}"
    if "e" in text:  # below 1e-4: as many decimals as three significant digits need
        text = f"{v:.{2 - int(f'{v:e}'.split('e')[1])}f}"
    return text


def fmt_spread(value: Any, spread: dict[str, Any] | None) -> str:
    """``1.2 (1.14–1.26)``: a measurement and its p10–p90 over repeated runs (the value alone without them)."""
    if spread is None or value is None:
        return fmt_sig(value)
    return f"{fmt_sig(value)} ({fmt_sig(spread.get('p10'))}–{fmt_sig(spread.get('p90'))})"


def verdict_text(parity: dict[str, Any] | None) -> str:
    if parity is None:
        return "Parity: NOT RUN"
    return "Parity: PASSED" if parity["passed"] else "Parity: FAILED"


__all__ = ["Table", "Warn", "Code", "Section", "fmt", "fmt_bytes", "fmt_ratio", "fmt_pct", "fmt_spread",
           "fmt_sig", "verdict_text"]
