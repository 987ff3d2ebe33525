# SPDX-License-Identifier: Apache-2.0
"""``kvexport eval presses``: layer-output discrepancy, perplexity and agreement vs compression ratio."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from kvexport.cli import app
from kvexport.eval.press_study import STUDY_PRESSES

eval_app = typer.Typer(help="Quality studies on a trained model (held-out Python stdlib text).", no_args_is_help=True)
app.add_typer(eval_app, name="eval")

QUICK = {"ratios": "0.25,0.5,0.75", "windows": 4, "prompt_len": 128, "future_len": 16}


def _floats(text: str, what: str) -> tuple[float, ...]:
    from kvexport.errors import BadUsage

    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BadUsage(f"{what} {text!r} is not a comma-separated list of numbers, e.g. 0.1,0.5,0.9") from None
    if not vals:
        raise BadUsage(f"{what} is empty; give e.g. 0.1,0.5,0.9")
    return vals


@eval_app.command("presses")
def presses_cmd(
    model: Optional[str] = typer.Argument(None, help="HF model directory. Default: the bundled reference student."),
    ratios: str = typer.Option("0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", help="Compression ratios in [0, 1)."),
    presses: str = typer.Option(
        ",".join(STUDY_PRESSES), help="Comma-separated press names (optimal = oracle with the true future queries)."
    ),
    windows: int = typer.Option(16, help="Held-out windows (prompts) to average over."),
    prompt_len: int = typer.Option(192, help="Prompt tokens P, compressed once after prefill."),
    future_len: int = typer.Option(32, help="Future tokens F, teacher-forced with the compressed cache and scored."),
    batch: int = typer.Option(8, help="Windows per forward pass."),
    quick: bool = typer.Option(False, "--quick", help="3 ratios, 4 windows, P=128, F=16 (a few minutes on a CPU)."),
    out: Path = typer.Option(Path("press_study"), help="Output prefix: writes OUT.json and OUT.png."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
) -> None:
    """The Expected-Attention study: for each press and ratio, ‖h − h_compr‖ of every layer's output over the
    next F tokens, held-out perplexity and next-token agreement with the full cache. Metric definitions are
    in the JSON ("metrics") and docs/eval.md."""
    import torch
    from rich.console import Console

    from kvexport.cli.common import resolve_model
    from kvexport.errors import BadUsage
    from kvexport.eval.data import heldout_windows
    from kvexport.eval.press_study import PressStudy, plot_press_study, press_study
    from kvexport.models.loading import load_decoder, load_tokenizer

    console = Console(stderr=True)
    if threads:
        torch.set_num_threads(threads)
    if quick:
        ratios, windows = QUICK["ratios"], QUICK["windows"]
        prompt_len, future_len = QUICK["prompt_len"], QUICK["future_len"]
    study = PressStudy(
        ratios=_floats(ratios, "--ratios"),
        presses=tuple(p.strip() for p in presses.split(",") if p),
        prompt_len=prompt_len,
        future_len=future_len,
        batch=batch,
    )
    if windows < 1:
        raise BadUsage(f"--windows {windows} must be >= 1")
    model_path = resolve_model(model)
    tok = load_tokenizer(model_path)
    if tok is None:
        raise BadUsage(f"{model_path} has no tokenizer; the study tokenizes held-out text with the model's own")
    decoder, _ = load_decoder(model_path)
    wins = heldout_windows(tok, windows, prompt_len + future_len + 1)
    t0 = time.perf_counter()
    total = len(study.presses) * len(study.ratios) * -(-wins.shape[0] // batch)
    done = [0]

    def progress(p, r, s):
        done[0] += 1
        console.print(f"[dim]{done[0]}/{total} {p} ratio={r:g}[/]", highlight=False)

    result = press_study(decoder, wins, study, progress=progress)
    result["model"] = Path(model_path).name
    result["command"] = "kvexport eval presses " + " ".join(
        [
            str(model_path),
            f"--ratios {ratios}",
            f"--windows {windows}",
            f"--prompt-len {prompt_len}",
            f"--future-len {future_len}",
        ]
        + (["--quick"] if quick else [])
    )
    result["wall_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out.with_suffix(".json"), out.with_suffix(".png")
    json_path.write_text(json.dumps(result, indent=1))
    plot_press_study(result, png_path)
    Console().print(
        f"full-cache ppl {result['full_cache']['ppl']:.2f}; wrote {json_path} and {png_path} "
        f"in {result['wall_s']:.0f}s",
        highlight=False,
    )
