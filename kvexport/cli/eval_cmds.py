# SPDX-License-Identifier: Apache-2.0
"""``kvexport eval presses|mla|combo``: the quality studies (definitions in docs/studies.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from kvexport.cli.app import app

eval_app = typer.Typer(help="Quality studies on a trained model (held-out Python stdlib text).", no_args_is_help=True,
                       rich_markup_mode=None)
app.add_typer(eval_app, name="eval")

#: --quick settings of each study (sized for < 15 min on 2 shared CPU cores with the bundled student)
QUICK_PRESSES = {"windows": 8, "prompt_len": 128, "future_len": 16}
QUICK_TASKS = {"context_len": 160, "future_len": 16, "n_next": 8, "n_recall": 16}
QUICK_DISTILL = {"budgets": "4096,16384", "batch_size": 4}
FULL_DISTILL = {"budgets": "65536,262144", "batch_size": 8}
OUT_HELP = "Output directory: writes <study>_<model>[_quick].json and .png (combo: .md) there."


def _floats(text: str, what: str) -> tuple[float, ...]:
    from kvexport.errors import BadUsage

    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BadUsage(f"{what} {text!r} is not a comma-separated list of numbers, e.g. 0.1,0.5,0.9") from None
    if not vals:
        raise BadUsage(f"{what} is empty; give e.g. 0.1,0.5,0.9")
    return vals


def _ints(text: str, what: str) -> tuple[int, ...]:
    from kvexport.errors import BadUsage

    vals = _floats(text, what)
    if any(v != int(v) or v < 1 for v in vals):
        raise BadUsage(f"{what} {text!r} must be positive whole numbers, e.g. 65536,262144")
    return tuple(int(v) for v in vals)


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _setup(threads: Optional[int]) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)


def _paths(out: Path, study: str, model_path: str, quick: bool) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{study}_{Path(model_path).name}{'_quick' if quick else ''}"
    return out / f"{stem}.json", out / f"{stem}.png"


def _taskset(model_path: str, quick: bool, context_len: Optional[int], n_recall: Optional[int]):
    from kvexport.errors import BadUsage
    from kvexport.eval.tasks import TaskSet, TaskSettings
    from kvexport.models.loading import load_tokenizer

    tok = load_tokenizer(model_path)
    if tok is None:
        raise BadUsage(f"{model_path} has no tokenizer; the tasks are built from text with the model's own")
    kw = dict(QUICK_TASKS) if quick else {}
    if context_len is not None:
        kw["context_len"] = context_len
    if n_recall is not None:
        kw["n_recall"] = n_recall
    return TaskSet(tok, TaskSettings(**kw))


def _press_kwargs(text: str) -> dict:
    """--press-kwargs JSON -> {press name: {setting: value}}, every setting checked by building the press."""
    import dataclasses

    from kvexport.errors import BadUsage
    from kvexport.presses import PRESSES

    if not text.strip():
        return {}
    try:
        kw = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadUsage(f"--press-kwargs is not valid JSON ({e.msg}); accepted: an object of press name -> "
                       '{setting: value}, e.g. {"expected_attention": {"n_future_positions": 32}}') from None
    if not isinstance(kw, dict) or not all(isinstance(v, dict) for v in kw.values()):
        raise BadUsage("--press-kwargs must map press names to objects of settings, "
                       'e.g. {"expected_attention": {"n_future_positions": 32}}')
    for name, settings in kw.items():
        cls = PRESSES.get(name)
        if cls is None:
            raise BadUsage(f"--press-kwargs: unknown press {name!r}; accepted: {', '.join(PRESSES)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"compression_ratio", "budget", "future"}
        bad = sorted(set(settings) - known)
        if bad:
            raise BadUsage(f"--press-kwargs: {name} has no setting {bad[0]!r}; accepted: {', '.join(sorted(known))}")
        if not settings:
            continue
        try:
            cls(compression_ratio=0.5, **settings)  # the press's own checks on the values
        except (TypeError, ValueError) as e:
            raise BadUsage(f"--press-kwargs: bad value for {name} ({e})") from None
    return kw


@eval_app.command("presses")
def presses_cmd(
    model: Optional[str] = typer.Argument(None, help="HF model directory. Default: the bundled reference student."),
    ratios: str = typer.Option("0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", help="Compression ratios in [0, 1)."),
    presses: Optional[str] = typer.Option(
        None, help="Comma-separated press names (optimal = oracle with the true future queries). Default: the study's "
        "set: expected_attention, knorm, tova, keydiff, snapkv, pyramidkv, streaming_llm, random, optimal."
    ),
    windows: int = typer.Option(64, help="Held-out windows (prompts) to average over."),
    prompt_len: int = typer.Option(192, help="Prompt tokens P, compressed once after prefill."),
    future_len: int = typer.Option(32, help="Future tokens F, teacher-forced with the compressed cache and scored."),
    batch: int = typer.Option(8, help="Windows per forward pass."),
    press_kwargs: str = typer.Option(
        "", help='Press settings as JSON, per press name, e.g. \'{"expected_attention": {"n_future_positions": 32}}\'.'
    ),
    quick: bool = typer.Option(False, "--quick", help="8 windows, P=128, F=16 (minutes on a CPU)."),
    text: str = typer.Option("code", help="Held-out text: code (the Python standard library's held-out split, "
                             "what the bundled models were trained on) or prose (the Python documentation's "
                             "held-out English pages: for a pretrained model)."),
    out: Path = typer.Option(Path("."), help=OUT_HELP),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
) -> None:
    """The Expected-Attention study: for each press and ratio, ‖h − h_compr‖ of every layer's output over the
    next F tokens, held-out perplexity and next-token agreement with the full cache. Metric definitions are
    in the JSON ("metrics") and docs/studies.md."""
    from rich.console import Console

    from kvexport.errors import BadUsage
    from kvexport.eval.data import heldout_windows, prose_windows
    from kvexport.eval.plots import plot_press_study
    from kvexport.eval.press_study import STUDY_PRESSES, PressStudy, press_study
    from kvexport.mla.io import load_decoder
    from kvexport.models.gguf import resolve_model
    from kvexport.models.loading import load_tokenizer

    presses = presses or ",".join(STUDY_PRESSES)
    console = _console()
    _setup(threads)
    if quick:
        windows, prompt_len, future_len = (QUICK_PRESSES[k] for k in ("windows", "prompt_len", "future_len"))
    study = PressStudy(
        ratios=_floats(ratios, "--ratios"),
        presses=tuple(p.strip() for p in presses.split(",") if p.strip()),
        prompt_len=prompt_len,
        future_len=future_len,
        batch=batch,
        press_kwargs=_press_kwargs(press_kwargs),
    )
    if windows < 1:
        raise BadUsage(f"--windows {windows} must be >= 1")
    unused = [n for n in study.press_kwargs if n not in study.presses]
    if unused:
        raise BadUsage(f"--press-kwargs sets {unused[0]!r}, which is not in --presses ({', '.join(study.presses)})")
    model_path = resolve_model(model)
    tok = load_tokenizer(model_path)
    if tok is None:
        raise BadUsage(f"{model_path} has no tokenizer; the study tokenizes held-out text with the model's own")
    decoder, _ = load_decoder(model_path)
    if text not in ("code", "prose"):
        raise BadUsage(f"--text {text!r} is not one of: code, prose")
    wins = (heldout_windows if text == "code" else prose_windows)(tok, windows, prompt_len + future_len + 1)
    t0 = time.perf_counter()
    total = len(study.presses) * len(study.ratios) * -(-wins.shape[0] // batch)
    done = [0]

    def progress(p, r, s):
        done[0] += 1
        console.print(f"[dim]{done[0]}/{total} {p} ratio={r:g}[/]", highlight=False)

    result = press_study(decoder, wins, study, progress=progress)
    result["model"] = Path(model_path).name
    result["command"] = f"kvexport eval presses {model_path} --ratios {ratios} --presses {','.join(study.presses)} " + (
        "--quick" if quick else f"--windows {windows} --prompt-len {prompt_len} --future-len {future_len}") + (
        f" --press-kwargs '{press_kwargs}'" if press_kwargs else "") + (f" --text {text}" if text != "code" else "")
    result["text"] = text
    result["quick"] = quick
    result["wall_s"] = time.perf_counter() - t0
    json_path, png_path = _paths(out, "presses", model_path, quick)
    json_path.write_text(json.dumps(result, indent=1))
    plot_press_study(result, png_path)
    Console().print(
        f"full-cache ppl {result['full_cache']['ppl']:.2f}; wrote {json_path} and {png_path} "
        f"in {result['wall_s']:.0f}s",
        highlight=False,
    )


@eval_app.command("mla")
def mla_cmd(
    student: Optional[str] = typer.Argument(None, help="HF model directory. Default: the bundled reference student."),
    teachers: str = typer.Option(
        "", help="Comma-separated teacher model directories (same tokenizer). The student itself is always the first "
        "teacher. Default: the bundled kvx-teacher-2x and kvx-teacher-4x."
    ),
    ratios: str = typer.Option("1.882,3.556,6.4,10.667,12.8", help="Target per-token KV-cache compression ratios (> 1); "
                               "the paper's 1.9x, 3.6x, 6.4x, 10.6x, 12.8x."),
    rope_dim: Optional[int] = typer.Option(None, help="d_rope of the shared RoPE key. Default: original cache / 32."),
    budgets: Optional[str] = typer.Option(None, help="Two (or more) distillation token budgets, comma-separated. "
                                          f"Default {FULL_DISTILL['budgets']} (--quick: {QUICK_DISTILL['budgets']})."),
    seq_len: int = typer.Option(256, help="Distillation sequence length."),
    batch_size: Optional[int] = typer.Option(None, help="Distillation batch (sequences). Default 8 (--quick: 4)."),
    lr: float = typer.Option(1e-3, help="Distillation learning rate (constant)."),
    context_len: Optional[int] = typer.Option(None, help="Task context length. Default 192 (--quick: 160)."),
    n_recall: Optional[int] = typer.Option(None, help="Examples per recall task. Default 32 (--quick: 16)."),
    quick: bool = typer.Option(False, "--quick", help="Small budgets and task set (< 15 min on a CPU)."),
    out: Path = typer.Option(Path("."), help=OUT_HELP),
    cache_dir: Optional[Path] = typer.Option(None, help="Where distilled students are cached (default: a temp dir)."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
) -> None:
    """The X-EcoMLA study: the student rewritten to MLA at each compression ratio, distilled from each teacher
    at two token budgets, scored on the task set (held-out next-token accuracy, code recall, passkey, span recall);
    the original student is the dashed baseline."""
    from rich.console import Console

    from kvexport.eval.mla_study import DEFAULT_CACHE, DistillSettings, MLAStudy, mla_study
    from kvexport.eval.plots import plot_mla_study
    from kvexport.models.gguf import resolve_model
    from kvexport.paths import MODELS_DIR

    console = _console()
    _setup(threads)
    student_path = resolve_model(student)
    given = [resolve_model(t.strip()) for t in teachers.split(",") if t.strip()]
    if not given:
        given = [str(MODELS_DIR / n) for n in ("kvx-teacher-2x", "kvx-teacher-4x")]
    teacher_paths = [student_path] + [t for t in given if Path(t).resolve() != Path(student_path).resolve()]
    from kvexport.models.loading import check_model_dir

    for t in teacher_paths:  # fail before any distillation, not halfway through
        check_model_dir(t)
    preset = QUICK_DISTILL if quick else FULL_DISTILL
    ds = DistillSettings(budgets=_ints(budgets or preset["budgets"], "--budgets"), seq_len=seq_len,
                         batch_size=batch_size or preset["batch_size"], lr=lr)
    study = MLAStudy(ratios=_floats(ratios, "--ratios"), rope_dim=rope_dim, distill=ds)
    taskset = _taskset(student_path, quick, context_len, n_recall)
    t0 = time.perf_counter()
    result = mla_study(student_path, teacher_paths, study, taskset, cache_dir or DEFAULT_CACHE,
                       log=lambda m: console.print(f"[dim]{m}[/]", highlight=False))
    given_opts = {"--rope-dim": rope_dim, "--budgets": budgets, "--seq-len": seq_len, "--batch-size": batch_size,
                  "--lr": lr, "--context-len": context_len, "--n-recall": n_recall}  # all that changes the result
    result["command"] = (f"kvexport eval mla {student_path} --teachers {','.join(given)} --ratios {ratios}"
                         + (" --quick" if quick else "")
                         + "".join(f" {k} {v}" for k, v in given_opts.items() if v is not None))
    result["quick"] = quick
    result["wall_s"] = time.perf_counter() - t0
    json_path, png_path = _paths(out, "mla", student_path, quick)
    json_path.write_text(json.dumps(result, indent=1))
    plot_mla_study(result, png_path)
    Console().print(f"baseline accuracy {result['baseline']['accuracy']:.3f}; wrote {json_path} and {png_path} in "
                    f"{result['wall_s']:.0f}s", highlight=False)


@eval_app.command("combo")
def combo_cmd(
    model: Optional[str] = typer.Argument(None, help="HF model directory. Default: the bundled reference student."),
    press: str = typer.Option("expected_attention", help="Eviction press used alone and on top of MLA."),
    targets: str = typer.Option("3.556,6.4,12.8", help="Memory targets: full context cache / compressed (> 1)."),
    rope_dim: Optional[int] = typer.Option(None, help="d_rope of the MLA students. Default: original cache / 32."),
    tokens: Optional[int] = typer.Option(None, help="Self-distillation tokens per MLA student. Default 262144 "
                                         "(--quick: 32768)."),
    seq_len: int = typer.Option(256, help="Distillation sequence length."),
    batch_size: Optional[int] = typer.Option(None, help="Distillation batch (sequences). Default 8 (--quick: 4)."),
    lr: float = typer.Option(1e-3, help="Distillation learning rate (constant)."),
    context_len: Optional[int] = typer.Option(None, help="Task context length. Default 192 (--quick: 160)."),
    n_recall: Optional[int] = typer.Option(None, help="Examples per recall task. Default 32 (--quick: 16)."),
    quick: bool = typer.Option(False, "--quick", help="Small distillation and task set."),
    out: Path = typer.Option(Path("."), help=OUT_HELP),
    cache_dir: Optional[Path] = typer.Option(None, help="Where distilled students are cached (shared with `eval mla`)."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
) -> None:
    """Eviction alone, MLA alone and MLA + eviction at equal KV-cache memory per sequence: a markdown table
    (and JSON) of task accuracy. MLA students are distilled from the model itself (cached, shared with
    `kvexport eval mla`)."""
    from rich.console import Console

    from kvexport.eval.combo import combo_study
    from kvexport.eval.mla_study import DEFAULT_CACHE, DistillSettings
    from kvexport.models.gguf import resolve_model
    from kvexport.presses import PRESSES

    if press not in PRESSES or press == "optimal":
        from kvexport.errors import BadUsage

        raise BadUsage(f"unknown press {press!r}; accepted: {', '.join(p for p in PRESSES if p != 'optimal')}")
    console = _console()
    _setup(threads)
    model_path = resolve_model(model)
    preset = QUICK_DISTILL if quick else FULL_DISTILL
    # by default the same budgets as `eval mla` (its self-distilled students are reused from the cache)
    ds = DistillSettings(budgets=(tokens,) if tokens else _ints(preset["budgets"], "budgets"), seq_len=seq_len,
                         batch_size=batch_size or preset["batch_size"], lr=lr)
    taskset = _taskset(model_path, quick, context_len, n_recall)
    t0 = time.perf_counter()
    result = combo_study(model_path, taskset, press=press, targets=_floats(targets, "--targets"), rope_dim=rope_dim,
                         distill_settings=ds, cache_dir=cache_dir or DEFAULT_CACHE,
                         log=lambda m: console.print(f"[dim]{m}[/]", highlight=False))
    result["command"] = f"kvexport eval combo {model_path} --press {press} --targets {targets}" + (
        " --quick" if quick else "")
    result["quick"] = quick
    result["wall_s"] = time.perf_counter() - t0
    json_path, _ = _paths(out, "combo", model_path, quick)
    json_path.write_text(json.dumps(result, indent=1))
    md = json_path.with_suffix(".md")
    md.write_text(f"`{result['command']}`\n\n{result['table']}")
    Console().print(result["table"], highlight=False)
    Console().print(f"wrote {json_path} and {md} in {result['wall_s']:.0f}s", highlight=False)
