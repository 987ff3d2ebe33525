# SPDX-License-Identifier: Apache-2.0
"""Every example script and every command block of README.md, docs/*.md and examples/**/*.md runs as
written, so a drifted example fails here.

Commands run in a scratch directory that looks like a checkout (``models/``, ``plugins/``... linked in), in
file order, sharing what earlier ones wrote (``exp/snapkv`` is exported once and then generated from and
validated). Sizes are made small without changing what a command does: example scripts get ``KVX_FAST=1``
(their ``examples/fast.sh``), and :data:`FAST` appends a few flags to the kvexport subcommands that take
long (the last value of an option wins). Usage synopses (``kvexport convert [MODEL] --out DIR [...]``) are
checked against ``--help`` instead: every flag they show must exist. What cannot run here is listed in
:data:`SKIP` with the reason; a rule that no longer matches any command fails too, so the list stays true.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvexport.report.sections import SLOWER_WARN

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.md"))]
#: linked into the scratch directory so that relative paths of the docs resolve as in a checkout
LINKED = ("models", "plugins", "scripts", "benchmarks", "constraints.txt", "examples")

#: flags appended to slow kvexport subcommands (same work, smaller sizes)
FAST = {
    "convert": ["--contexts", "256", "--decode-steps", "4", "--validate-steps", "4", "--repeats", "1"],
    "profile": ["--contexts", "256", "--decode-steps", "4", "--repeats", "1"],
    "validate": ["--steps", "4", "--no-fidelity"],  # the quickstart's conversion measures fidelity
    "distill": ["--tokens", "1024", "--seq-len", "64", "--batch-size", "2", "--save-every", "1000", "--no-progress"],
    "generate": ["-n", "8"],
}

#: (pattern matched against a command, why it does not run here)
SKIP = [
    (r"^pip install", "installs packages: the test environment is that installation"),
    (r"^kvexport get smollm2", "downloads the real model: tests/real/conftest.py gets it (CI fetches it first)"),
    (r"^kvexport convert \S+\.gguf", "converts the real model: tests/real/test_smollm2.py converts it from its GGUF"),
    (r"^python -m pytest", "the test suite itself"),
    (r"^(cmake|trtexec|/usr/src/tensorrt)", "builds or runs TensorRT plugins/engines: needs CUDA and TensorRT"),
    (r"--backend tensorrt|build-engine|kvexport\.tensorrt|scripts/gpu_check", "needs TensorRT and an NVIDIA GPU"),
    (r"^rsync|^ssh ", "copies to a Jetson board"),
    (r"--multi_gpu --num_processes 8", "eight GPUs"),
    (r"^accelerate launch --multi_gpu --num_processes 2 .*--cpu", "the two-process CPU run is "
                                                                  "tests/mla/test_distill_ddp.py"),
    (r"distill \.\.\. ", "an outline of the command (written out in docs/mla.md)"),
    (r"^python -m benchmarks( *$| --quick| --rows)", "a full benchmark run (minutes to hours); the --tiny run is "
                                                    "tests/benchmarks/test_bench_smoke.py"),
    (r"^python -m benchmarks --tiny", "tests/benchmarks/test_bench_smoke.py runs it"),
    (r"^python -m benchmarks --render", "needs the results of a full benchmark run"),
    (r"^python -m benchmarks\.bench_realsize", "converts real-size shapes (minutes for the student, an hour for "
                                               "the 385M and 1B shapes); docs/realsize/ holds the measured run"),
    (r"^python scripts/train_reference\.py", "trains the reference models (hours)"),
    (r"lm_eval", "needs the optional lm-eval package (pip install 'kvexport[eval]')"),
]

#: what a command must not print on stderr (library progress bars and warnings kvexport silences)
NOISE = ("Loading weights", "Removed shared tensor", "Writing model shards")

#: placeholders of the docs -> what stands for them here
#: (the Jetson README's ~/DIR is the directory copied to the board's home: here the scratch directory itself)
PLACEHOLDERS = {"MODEL_DIR": "model_dir", "EXPORT_DIR": "exp/snapkv", "~/": ""}

#: python blocks that are fragments of a larger program (names defined elsewhere), with what they lack
FRAGMENTS = {
    "docs/export.md": "uses input_ids / attention_mask / n from the surrounding text",
    "docs/mla.md": "uses hf_model, a loaded transformers model",
    "docs/tensorrt.md": "needs TensorRT engines",
}


@dataclass
class Cmd:
    source: str  # file:line
    text: str
    block: int = 0  # first line of its fenced block
    lang: str = "bash"  # "" for an unlabelled block: only its `kvexport ...` usage synopses are read


def _block_of(c: Cmd) -> int:
    return c.block


def _blocks(rel: str) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of each fenced block of ``rel``."""
    out = []
    lines = (ROOT / rel).read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((m.group(1), i + 2, "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return out


def commands(rel: str) -> list[Cmd]:
    """The shell commands of ``rel``'s bash blocks (and the ``kvexport`` lines of unlabelled blocks, which are
    usage synopses): continuations joined, comments dropped, ``&&`` split."""
    out = []
    for lang, line, body in _blocks(rel):
        if lang not in ("bash", ""):
            continue
        joined, start = "", line
        lines = body.splitlines()
        if lang == "":  # a synopsis wraps onto indented lines without a backslash
            lines = [ln + " \\" if k + 1 < len(lines) and lines[k + 1][:1].isspace() else ln
                     for k, ln in enumerate(lines)]
        for k, raw in enumerate(lines):
            if not joined:
                start = line + k
            joined += raw.rstrip()[:-1] + " " if raw.rstrip().endswith("\\") else raw
            if raw.rstrip().endswith("\\"):
                continue
            text = _strip_comment(joined)
            joined = ""
            for part in (p.strip() for p in re.split(r"\s&&\s", text or "")):
                if part and (lang == "bash" or part.startswith("kvexport ")):
                    out.append(Cmd(f"{rel}:{start}", part, line, lang))
    return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a blank or at the start)."""
    idx = _comment_index(line)
    return (line[:idx] if idx is not None else line).strip()


def _comment_index(line: str) -> int | None:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return None


def is_synopsis(text: str) -> bool:
    return bool(re.search(r"\[--|\[MODEL\]| DIR\b|\.\.\. ", text)) and text.startswith("kvexport")


def skip_reason(text: str) -> str | None:
    for pat, why in SKIP:
        if re.search(pat, text):
            return why
    return None


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "KVX_FAST": "1", "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _run(text: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; {text}"], cwd=cwd, env=_env(cwd), capture_output=True,
                          text=True, timeout=timeout)


def _fast(text: str) -> str:
    words = shlex.split(text)
    if len(words) > 1 and words[0] == "kvexport" and words[1] in FAST:
        return text + " " + " ".join(FAST[words[1]])
    return text


def _substitute(text: str) -> str:
    for k, v in PLACEHOLDERS.items():
        text = text.replace(k, v)
    return text


@pytest.fixture(scope="module")
def scratch_factory(tmp_path_factory):
    """Makes a directory that looks like a checkout, with the inputs the docs name (a tiny model dir whose
    K/V is wide enough for the docs' ranks, training text)."""
    return lambda: make_scratch(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def scratch(scratch_factory) -> Path:
    return scratch_factory()


def make_scratch(d: Path) -> Path:
    from tests.convert.helpers import make_tiny_hf_dir

    for name in LINKED:
        (d / name).symlink_to(ROOT / name)
    (d / "docs").mkdir()
    # MODEL_DIR: a Llama with 4 KV heads of 64 (2*4*64 = 512 elements per token: room for --mla-rank 128 + 32)
    make_tiny_hf_dir(d / "model_dir", hidden_size=256, heads=4, kv_heads=4, head_dim=64, layers=2)
    text = "".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    for name in ("train.txt", "text.txt"):
        (d / name).write_text(text)
    return d


def all_commands() -> list[Cmd]:
    return [c for rel in DOCS for c in commands(rel)]


def test_skip_rules_are_all_used():
    texts = [_substitute(c.text) for c in all_commands() if c.lang == "bash"]
    for pat, why in SKIP:
        assert any(re.search(pat, t) for t in texts), f"SKIP rule {pat!r} ({why}) matches no command any more"
    assert set(FRAGMENTS) <= set(DOCS)


def test_synopses_name_existing_flags():
    """A usage synopsis in the docs shows only flags the command has."""
    from typer.main import get_command

    from kvexport.cli import app

    cli = get_command(app)
    seen = 0
    for c in all_commands():
        if not is_synopsis(c.text):
            continue
        words = c.text.split()
        cmd = cli.commands[words[1]]
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for flag in re.findall(r"(--[a-z][a-z0-9-]*)", c.text):
            assert flag in known, f"{c.source}: `kvexport {words[1]}` has no {flag}"
        seen += 1
    assert seen >= 3


def _checks(text: str, cwd: Path) -> None:
    """What a command promises beyond its exit code."""
    words = shlex.split(text)
    if words[:2] == ["kvexport", "convert"]:
        out = cwd / words[words.index("--out") + 1]
        parity = json.loads((out / "parity.json").read_text())
        assert all(p["passed"] for p in parity["pairs"].values())
        assert (out / "report.html").is_file() and (out / "profile-onnxruntime.json").is_file()
        if "--no-fidelity" not in words:  # what compression cost was measured against the original model
            fid = parity["fidelity"]
            assert "skipped" not in fid and 0 <= fid["next_token_agreement"] <= 1, fid
            assert "## What compression cost" in (out / "report.md").read_text()
    elif words[:2] == ["kvexport", "export"]:
        out = cwd / words[words.index("--out") + 1]
        assert (out / "manifest.json").is_file() and list(out.glob("*.onnx"))


def _out_of(text: str) -> str | None:
    words = shlex.split(text)
    for flag in ("--out", "-o"):
        if flag in words:
            return words[words.index(flag) + 1]
    return None


def _dedupe_key(text: str) -> str:
    """``text`` without its output directory for conversions (the same run under another name), else itself."""
    words = shlex.split(text)
    if words[:2] == ["kvexport", "convert"] and "--out" in words:
        i = words.index("--out")
        return " ".join(words[:i] + words[i + 2:])
    return text


def runnable() -> list[tuple[Cmd, str]]:
    """(command, text with placeholders substituted) of every command that runs here, in file order."""
    out = []
    for c in all_commands():
        text = _substitute(c.text)
        if c.lang != "bash" or skip_reason(text) is not None or is_synopsis(text):  # synopses: checked above
            continue
        out.append((c, text))
    return out


def chains() -> dict[str, list[tuple[Cmd, str]]]:
    """The runnable commands grouped into independent chains: a command joins the chain of every earlier
    command whose output (``--out``, a conversion of the same settings) it names. Chains run as separate
    tests (in parallel under xdist), each in order in its own scratch checkout."""
    cmds = runnable()
    parent = list(range(len(cmds)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    outs: dict[str, int] = {}
    keys: dict[str, int] = {}
    for i, (_, text) in enumerate(cmds):
        for o, j in outs.items():
            if re.search(rf"(^|[\s/=]){re.escape(o)}(/|\s|$)", text):
                parent[find(i)] = find(j)
        k = _dedupe_key(text)
        if k in keys:
            parent[find(i)] = find(keys[k])
        keys.setdefault(k, i)
        for o in _outputs(text):
            outs.setdefault(o, i)
    groups: dict[int, list[int]] = {}
    for i in range(len(cmds)):
        groups.setdefault(find(i), []).append(i)
    named = {}
    for members in groups.values():
        first = cmds[members[0]]
        named[_outputs(first[1])[0] if _outputs(first[1]) else first[0].source] = [cmds[i] for i in members]
    return named


def _outputs(text: str) -> list[str]:
    words = shlex.split(text)
    o = _out_of(text)
    if o is None and words[:2] == ["kvexport", "distill"]:
        o = words[2].rstrip("/") + "-distilled"
    return [o.rstrip("/")] if o else []


CHAINS = chains()
#: the chain that ends with the Jetson flow (deploy.sh on the quickstart's conversion) and the screenshot
QUICKSTART = "out/kvx-student"


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_docs_commands(chain, scratch_factory):
    """The commands of one chain, in file order, in a fresh scratch checkout; each exits 0 and keeps what it
    promises. The quickstart's chain then runs examples/jetson/deploy.sh on CPU (TensorRT steps skipped)."""
    scratch = scratch_factory()
    done, block_outs, times = {}, {}, []
    for c, text in CHAINS[chain]:
        if text.startswith("chromium") and shutil.which("chromium") is None:
            continue  # the screenshot command; the browser tests say chromium is missing
        out = _out_of(text)
        block = f"{c.source.rsplit(':', 1)[0]}:{c.block}"
        if out and out in block_outs.get(block, set()):
            shutil.rmtree(scratch / out)  # alternatives in one block write the same --out: each runs fresh
        block_outs.setdefault(block, set()).add(out or "")
        key = _dedupe_key(text)
        if key in done:  # the same conversion under another name: copy it instead of redoing it
            prev = done[key]
            if prev and out and prev != out:
                shutil.copytree(scratch / prev, scratch / out, symlinks=True, dirs_exist_ok=True)
            continue
        t0 = time.perf_counter()
        r = _run(_fast(text), scratch)
        times.append(f"{time.perf_counter() - t0:6.1f}s  {c.source}  {text[:90]}")
        assert r.returncode == 0, f"{c.source}: `{text}` exited {r.returncode}\n{r.stdout[-3000:]}\n" \
                                  f"{r.stderr[-3000:]}"
        for noise in NOISE:
            assert noise not in r.stderr, f"{c.source}: `{text}` printed {noise!r}"
        _checks(text, scratch)
        done[key] = out
    print("\n".join(times))  # where the time goes (pytest -s)
    if chain != QUICKSTART:
        return
    r = _run("bash examples/jetson/deploy.sh kvx-student-kvx 87", scratch)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "skipping the TensorRT steps" in r.stdout
    from kvexport import layout

    layout.verify_conversion(scratch / "kvx-student-kvx")
    assert (scratch / "kvx-student-kvx" / "report.html").stat().st_mtime >= \
        (scratch / "kvx-student-kvx" / "parity.json").stat().st_mtime
    if shutil.which("chromium"):  # docs/convert.md's screenshot command drew the quickstart's report
        from tests.report.test_report import png_size

        assert png_size((scratch / "docs" / "report_screenshot.png").read_bytes()) == (1280, 1500)


def test_chains_cover_every_runnable_command():
    assert sum(len(v) for v in CHAINS.values()) == len(runnable()) >= 20
    assert QUICKSTART in CHAINS and any("deploy" in t or "kvx-student-kvx" in t for _, t in CHAINS[QUICKSTART])


def test_readme_python_snippets(scratch):
    """README's Python blocks run as written; docs' complete snippets too (fragments are listed)."""
    n = 0
    for rel in DOCS:
        for lang, line, body in _blocks(rel):
            if lang != "python" or rel in FRAGMENTS:
                continue
            r = subprocess.run([sys.executable, "-c", body], cwd=scratch, env=_env(scratch), capture_output=True,
                               text=True, timeout=600)
            assert r.returncode == 0, f"{rel}:{line}\n{body}\n{r.stderr[-3000:]}"
            n += 1
    assert n >= 2


EXAMPLES = {
    "eviction_only.sh": ([], ["parity: {'pytorch~onnxruntime': True}", "context    256: KV"]),
    "mla_only.sh": ([], []),  # its slower-than-baseline warning depends on the timings: checked against them below
    "mla_and_eviction.sh": ([], ["distill          done"]),
    "local_checkpoint.sh": (["models/kvx-teacher-2x"], ["redo with: kvexport convert --config"]),
}


def test_every_example_script_is_tested():
    scripts = {p.name for p in (ROOT / "examples").glob("*.sh")} - {"fast.sh"}
    assert scripts == set(EXAMPLES), scripts
    assert (ROOT / "examples" / "jetson" / "deploy.sh").is_file()  # run by test_docs_commands


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_script(script, tmp_path):
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    args, expect = EXAMPLES[script]
    out = tmp_path / "out"
    r = _run(" ".join(["bash", f"examples/{script}", *args, str(out)]), tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    for e in expect:
        assert e in text, (e, text[-4000:])
    parity = json.loads((out / "parity.json").read_text())
    assert all(p["passed"] for p in parity["pairs"].values())
    if script == "mla_only.sh":  # the warning appears exactly when the measured numbers say the model is slower
        prof = json.loads((out / "profile-onnxruntime.json").read_text())
        conv, base = (prof["variants"][v]["contexts"] for v in ("converted", "baseline"))
        slower = any(c[k] > SLOWER_WARN * b[k] for c, b in zip(conv, base, strict=True) for k in ("decode_ms_p50", "ttft_s"))
        said = "The converted model is slower than the uncompressed baseline here" in text
        assert said == slower, (slower, text[-4000:])
        assert not said or "attends over its whole bucket" in text
    from kvexport import layout

    layout.verify_conversion(out)
