# SPDX-License-Identifier: Apache-2.0
"""docs/architecture.md's layers against the code: every import between kvexport's modules (and the benchmarks'),
at module level or inside a function, goes to a lower layer or stays in its own part, and no modules import each
other in a circle. Imports are read from the source (ast), so nothing is run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layers() -> list[list[str]]:
    """The ```layers block of docs/architecture.md, top layer first, each a list of parts (a folder ending in /
    or a file)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    return [line.split() for line in block.group(1).splitlines() if line.strip()]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted([*ROOT.glob("kvexport/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) module pairs, wherever the import statement stands."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    pairs = set()
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            found = {resolve(n) for n in names if n.split(".")[0] in ("kvexport", "benchmarks")} - {None, mod}
            pairs |= {(mod, t) for t in found if not any(o != t and o.startswith(t + ".") for o in found)}
    return pairs


def part_of(mod: str, path: Path, parts: dict[str, int]) -> str:
    rel = path.relative_to(ROOT).as_posix()
    best = max((p for p in parts if rel == p or (p.endswith("/") and rel.startswith(p))), key=len, default=None)
    assert best is not None, f"{rel} is on no layer of docs/architecture.md"
    return best


def test_every_module_is_on_a_layer_and_imports_only_below():
    lay = layers()
    parts = {p: i for i, line in enumerate(lay) for p in line}  # 0 = the top
    mods = modules()
    where = {m: part_of(m, p, parts) for m, p in mods.items()}
    wrong = sorted(f"{a} -> {b} ({where[a]} imports {where[b]})" for a, b in imports(mods)
                   if where[a] != where[b] and parts[where[b]] <= parts[where[a]])
    assert not wrong, "imports that do not go down a layer:\n" + "\n".join(wrong)


def test_no_circles():
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for a, b in imports(mods):
        graph[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = visit(m)
            assert circle is None, "modules that import each other: " + " -> ".join(circle)
