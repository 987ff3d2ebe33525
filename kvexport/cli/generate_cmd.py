# SPDX-License-Identifier: Apache-2.0
"""``kvexport generate``: greedy generation with an evicting cache (PyTorch reference path)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.cli.app import app
from kvexport.cli.common import (
    LOOKAHEAD_HELP,
    NEIGHBORS_HELP,
    PRESS_HELP,
    cache_summary,
    encode_prompts,
    print_completions,
    read_prompt_file,
)
from kvexport.models.gguf import resolve_model

DEFAULT_BUDGET = 256
#: the options an export fixes (``kvexport generate DIR`` refuses them)
EXPORT_FIXED = ("press", "budget", "ratio", "window", "chunk", "neighbors", "lookahead", "dtype", "kv_dtype")


@app.command("generate")
def generate_cmd(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, help="HF model directory (config.json + safetensors + tokenizer), an "
                                          "MLA directory, an export (`kvexport export`) or a conversion (`kvexport "
                                          "convert`: runs DIR/onnx). Default: the bundled reference student."),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="Prompt text; repeat for a left-padded batch."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read one prompt from a UTF-8 text file."),
    press: str = typer.Option("snapkv", help=PRESS_HELP),
    budget: Optional[int] = typer.Option(None, help=f"Tokens kept per layer and KV head after each compaction "
                                         f"(default {DEFAULT_BUDGET} with a press)."),
    ratio: Optional[float] = typer.Option(None, help="Instead of --budget: fraction of the prompt to evict, in [0, 1)."),
    window: int = typer.Option(DEFAULT_WINDOW, help="Recent-token slots appended while decoding before the next compaction."),
    chunk: Optional[int] = typer.Option(None, help="Prefill in chunks of this many tokens (bounded peak memory)."),
    neighbors: int = typer.Option(0, "--neighbors", help=NEIGHBORS_HELP),
    lookahead: int = typer.Option(0, "--lookahead", help=LOOKAHEAD_HELP),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="Tokens to generate."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="How the cache stores K/V: fp32, fp16, bf16, "
                                           "int8, fp8 (docs/quantized.md). Default: --dtype."),
    backend: str = typer.Option("onnxruntime", help="For an export directory: onnxruntime or tensorrt."),
    engines: Optional[Path] = typer.Option(None, help="TensorRT engine folder (default: DIR-tensorrt, written by "
                                           "`kvexport build-engine DIR`)."),
) -> None:
    """Generate text greedily with a static-capacity KV cache (capacity = budget + window per layer). An export
    runs with the cache it was exported with: the cache options (--press … --kv-dtype) are refused for one."""
    from rich.console import Console

    from kvexport.errors import BadUsage
    from kvexport.generation import generate
    from kvexport.mla.io import is_mla_dir, load_decoder, verify_mla_files
    from kvexport.models.loading import check_model_dir, load_tokenizer
    from kvexport.presses import build_press

    console = Console()
    if press not in (None, "none") and budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    if max_new_tokens < 1:
        raise BadUsage(f"--max-new-tokens {max_new_tokens} must be >= 1")
    prompts = list(prompt)
    if prompt_file is not None:
        prompts.append(read_prompt_file(prompt_file))
    if model is not None and not is_mla_dir(model) and (Path(model) / "manifest.json").is_file():  # an artifact
        from kvexport.cli.export_cmds import generate_from_export, generation_dir

        # an export's cache is fixed when it is exported: a flag that would change it is refused, not ignored
        # (by the source's name: typer carries its own copy of click's ParameterSource)
        fixed = [f"--{n.replace('_', '-')}" for n in EXPORT_FIXED
                 if getattr(ctx.get_parameter_source(n), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")]
        if fixed:
            raise BadUsage(f"{', '.join(fixed)}: {model} is an export, whose press, budget, window, chunk and dtypes "
                           "were fixed when it was exported; drop them, or convert/export again with them")
        return generate_from_export(generation_dir(Path(model)), prompts, max_new_tokens, backend=backend,
                                    engines=engines)
    if backend != "onnxruntime" or engines is not None:
        raise BadUsage(f"--backend {backend}/--engines need an export directory (`kvexport export` output, with "
                       f"manifest.json); {model or 'the bundled model'} is not one")
    model_path = resolve_model(model)
    # config and weights first: the tokenizer would blame itself for a bad config or a damaged directory
    if is_mla_dir(model_path):
        verify_mla_files(model_path)
    else:
        check_model_dir(model_path)
    p = build_press(press, budget, ratio, neighbors)
    if lookahead and chunk is None:
        raise BadUsage("--lookahead observes earlier prefill chunks: give --chunk C too")
    if kv_dtype is not None:
        from kvexport.cache.formats import kv_format

        kv_format(kv_dtype)  # one line for an unknown name, before the model loads
    tok = load_tokenizer(model_path)
    ids, mask = encode_prompts(tok, prompts)
    decoder, _ = load_decoder(model_path, dtype)
    t0 = time.perf_counter()
    res = generate(decoder, ids, mask, press=p, window=window, chunk=chunk, max_new_tokens=max_new_tokens,
                   eos_token_id=tok.eos_token_id, kv_dtype=kv_dtype, lookahead=lookahead)
    dt = time.perf_counter() - t0
    print_completions(console, prompts, [tok.decode(res.tokens[i].tolist()) for i in range(ids.shape[0])])
    console.print(f"[dim]{res.tokens.shape[1]} tokens in {dt:.2f}s; press={press} budget={budget} ratio={ratio} "
                  f"window={window}; {cache_summary(res.resident_bytes)}, fixed; {res.compactions} compactions[/]",
                  soft_wrap=True)
