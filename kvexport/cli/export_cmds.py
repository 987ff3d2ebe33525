# SPDX-License-Identifier: Apache-2.0
"""``kvexport export`` (ONNX graphs with static caches) and ``kvexport validate`` (parity vs PyTorch)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.cli.app import app
from kvexport.cli.common import LOOKAHEAD_HELP, NEIGHBORS_HELP, PRESS_HELP
from kvexport.models.gguf import resolve_model


@app.command("export")
def export_cmd(
    model: Optional[str] = typer.Argument(None, help="HF model directory or an MLA directory written by `kvexport "
                                          "rewrite`. Default: the bundled reference student."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (written atomically)."),
    press: str = typer.Option("none", help=PRESS_HELP + " Not exportable: random, optimal."),
    budget: Optional[int] = typer.Option(None, help="Tokens kept per layer and cache head after each compaction."),
    window: int = typer.Option(DEFAULT_WINDOW, help="Decode slots appended before the next compaction (capacity = budget + window)."),
    neighbors: int = typer.Option(0, "--neighbors", help=NEIGHBORS_HELP),
    lookahead: int = typer.Option(0, "--lookahead", help=LOOKAHEAD_HELP),
    mla_rank: Optional[int] = typer.Option(None, "--mla-rank", help="Rewrite to MLA with this latent rank r_kv first."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help="MLA decoupled RoPE width d_rope (default 32)."),
    batch: int = typer.Option(1, help="Static batch size of the graphs."),
    decode_batch: Optional[int] = typer.Option(None, "--decode-batch", help="Also a decode_batch.onnx decoding N "
                                               "sequences at once, each at its own position (the slots of "
                                               "`kvexport serve`; use with --batch 1)."),
    chunk: int = typer.Option(128, help="Prefill chunk length C (the prompt is fed C tokens at a time)."),
    dtype: str = typer.Option("fp32", help="fp32 or fp16."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="How the cache stores K/V (or the MLA latent): "
                                           "fp32, fp16, bf16, int8, fp8 (one byte per number plus a float16 scale "
                                           "per token and head; docs/quantized.md). Default: --dtype."),
    weights: Optional[str] = typer.Option(None, "--weights", help="How the graphs store the model's MatMul weights: "
                                          "fp32 (as traced, the default), fp16, int4 (onnxruntime MatMulNBits, "
                                          "blocks of 32, float32 activations; a GGUF model keeps its own Q4_1 / "
                                          "Q8_0 blocks), int4-a8 (the same with int8 activations, accuracy level 4: "
                                          "faster on a CPU) or int4-qdq (INT4 DequantizeLinear for "
                                          "TensorRT); validate compares it with PyTorch on the same weights "
                                          "(docs/quantized.md)."),
    ops: str = typer.Option("custom", help="custom: kvexport::TopKGather / LatentAttention nodes (backed by ONNX "
                            "functions); standard: plain ONNX ops only."),
    dynamic_cache: bool = typer.Option(False, "--dynamic-cache", help="Full cache with a growing past (baseline; "
                                       "needs --press none)."),
    max_positions: Optional[int] = typer.Option(None, "--max-positions", help="Longest context (press none: the "
                                                "full cache's capacity, held in power-of-two buckets up to it). "
                                                "Default: the model's max_position_embeddings."),
    inplace_decode: bool = typer.Option(False, "--inplace-decode", help="Also decode_inplace.ort.onnx: the decode "
                                        "step through onnxruntime's GroupQueryAttention, writing the token's slot "
                                        "of the cache in place (onnxruntime on the CPU runs it; TensorRT runs "
                                        "decode.onnx). GQA models, --kv-dtype = --dtype."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
) -> None:
    """Export to ONNX: prefill-chunk, decode and compaction graphs with fixed-shape caches."""
    from kvexport.convert.progress import StepProgress, stdout_console
    from kvexport.export import export_model
    from kvexport.manifest import read_manifest

    console = _stderr()
    with StepProgress(console, f"exporting {out}") as p:
        kw = {"progress": p.callback} if p.callback else {}
        from kvexport.presses import build_press

        p_obj = build_press(press, budget, None, neighbors) if neighbors else press
        path = export_model(resolve_model(model), out, press=p_obj, budget=budget, window=window, mla_rank=mla_rank,
                            rope_dim=rope_dim, batch=batch, chunk=chunk, dtype=dtype, ops=ops,
                            dynamic_cache=dynamic_cache, force=force, max_positions=max_positions,
                            decode_batch=decode_batch, kv_dtype=kv_dtype, inplace_decode=inplace_decode,
                            lookahead=lookahead, weights=weights, **kw)
    files = ", ".join(sorted(read_manifest(path)["files"]))
    stdout_console().print(f"exported to {path} in {p.elapsed:.1f}s: {files}", highlight=False)


@app.command("validate")
def validate_cmd(
    directory: Path = typer.Argument(..., help="An export directory (`kvexport export`) or a conversion "
                                     "(`kvexport convert`: validates DIR/onnx and updates DIR/parity.json and the "
                                     "report)."),
    model: Optional[str] = typer.Option(None, help="The PyTorch model (default: the source recorded in the manifest)."),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="Prompt text (repeatable). Default: random token "
                                     "ids with lengths below, at and above the budget and over several chunks."),
    steps: int = typer.Option(64, help="Decode steps per prompt."),
    atol: Optional[float] = typer.Option(None, help="Absolute logit tolerance (default fp32 1e-4; fp16 5e-2; a lossy cache, int8 / fp8 or fp16 of fp32, 0.25)."),
    rtol: Optional[float] = typer.Option(None, help="Relative logit tolerance (default fp32 1e-3; fp16 or a lossy cache 5e-2)."),
    backend: str = typer.Option("onnxruntime", help="onnxruntime (pytorch~onnxruntime) or tensorrt (adds "
                                "onnxruntime~tensorrt and pytorch~tensorrt; needs engines from `kvexport build-engine`)."),
    engines: Optional[Path] = typer.Option(None, help="TensorRT engine folder (default: DIR-tensorrt, or DIR/engine "
                                           "for a conversion)."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Held-out text for the fidelity check "
                                            "(original model vs the export): a UTF-8 file or bundled:NAME."),
    min_agreement: Optional[float] = typer.Option(None, "--min-agreement", help="Fail (exit 6) when next-token "
                                                  "agreement with the original model is below this (0..1)."),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help="Fail (exit 6) when perplexity "
                                                     "rises by more than this fraction (0.05 = +5 %)."),
    fidelity: bool = typer.Option(True, "--fidelity/--no-fidelity", help="Also measure what compression costs "
                                  "against the original model (agreement, KL, perplexity, recall)."),
    original: Optional[Path] = typer.Option(None, "--original", help="The original (uncompressed) HF model for "
                                            "the fidelity check (default: the one the export's manifest names)."),
) -> None:
    """Compare the ONNX graphs (onnxruntime, optionally TensorRT) with the PyTorch model; writes parity.json,
    exit 6 on failure."""
    from kvexport import layout
    from kvexport.convert.config import fidelity_kwargs
    from kvexport.convert.progress import StepProgress, stdout_console
    from kvexport.errors import ParityFailure
    from kvexport.export.fidelity import gate_failure
    from kvexport.export.validation import validate

    conversion = layout.is_conversion(directory)
    export = directory / layout.ONNX_DIR if conversion else directory
    if conversion:
        layout.verify_conversion(directory, (layout.PARITY_JSON, *layout.REPORT_OUTPUTS))
        if backend == "tensorrt" and engines is None and (directory / layout.ENGINE_DIR).is_dir():
            engines = directory / layout.ENGINE_DIR
    kw = fidelity_kwargs(eval_data, min_agreement, max_ppl_increase, fidelity)
    if original is not None and fidelity:
        kw["original"] = original
    with StepProgress(_stderr(), f"validating {export}") as p:
        if p.callback:
            kw["progress"] = p.callback
        rep = validate(export, prompts=list(prompt) or None, steps=steps, atol=atol, rtol=rtol, model=model,
                       backend=backend, engines=engines, write=not conversion, **kw)
    target = directory / layout.PARITY_JSON
    if conversion:
        layout.write_parity(directory, rep)
    console = stdout_console()
    t = pairs_table(rep, f"parity: {export} ({p.elapsed:.0f}s)")
    console.print(t)
    for line in fidelity_lines(rep.get("fidelity")):
        console.print(line, highlight=False)
    if conversion and (directory / "report.html").is_file():
        from kvexport.report import write_report

        write_report(directory)
        console.print(f"updated {target} and {directory / 'report.html'}", highlight=False)
    failed = [n for n, p in rep["pairs"].items() if not p["passed"]]
    if failed:
        raise ParityFailure(f"{', '.join(failed)} outside tolerance; details in {target}")
    gate = gate_failure(rep.get("fidelity"))
    if gate:
        raise ParityFailure(f"{gate}; details in {target}")


def fidelity_lines(fid: dict | None) -> list[str]:
    """parity.json's ``fidelity`` object in plain words (nothing for an old parity.json)."""
    from kvexport.export.quality import quality_markup
    from kvexport.report.sections import fidelity_summary

    if not isinstance(fid, dict):
        return []
    return [f"what compression cost ({fid.get('eval_data', '?')}, {fid.get('scored_tokens', '?')} tokens): "
            + fidelity_summary(fid), quality_markup(fid)]


def pairs_table(rep: dict, title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("pair", "max abs", "max rel", "tokens", "kept idx", "steps", "atol", "rtol", "passed"):
        t.add_column(col, no_wrap=True)
    for name, p in rep["pairs"].items():
        t.add_row(name, f"{p['max_abs_logit_error']:.2e}", f"{p['max_rel_logit_error']:.2e}",
                  f"{p['token_agreement']:.3f}", f"{p['index_agreement']:.3f}", str(p["steps"]),
                  f"{p['tolerances']['atol']:g}", f"{p['tolerances']['rtol']:g}", "yes" if p["passed"] else "NO")
    return t


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


def generation_dir(d: Path) -> Path:
    """The export to generate from: ``d`` itself, ``d/onnx`` for a conversion; a folder of engines or an MLA
    model is refused with the command that takes it."""
    from kvexport import layout
    from kvexport.errors import BadUsage

    if layout.is_conversion(d):
        return d / layout.ONNX_DIR
    kind = (layout.read_manifest(d) or {}).get("kind")
    if kind == "tensorrt-engines":
        raise BadUsage(f"{d} holds TensorRT engines; give the export they were built from: `kvexport generate "
                       f"EXPORT_DIR --backend tensorrt --engines {d}`")
    return d


def open_generator(directory: Path, backend: str = "onnxruntime", engines: Path | None = None):
    """The step runner of an export directory on ``backend`` (onnxruntime | tensorrt)."""
    from kvexport.errors import BadUsage

    if backend == "onnxruntime":
        if engines is not None:
            raise BadUsage("--engines is for --backend tensorrt")
        from kvexport.runtime.onnxruntime import open_onnxruntime

        return open_onnxruntime(directory)
    if backend == "tensorrt":
        from kvexport.tensorrt.generator import TrtGenerator

        return TrtGenerator(directory, engines=engines)
    raise BadUsage(f"--backend {backend!r} is not one of: onnxruntime, tensorrt")


def generate_from_export(directory: Path, prompts: list[str], max_new_tokens: int, backend: str = "onnxruntime",
                         engines: Path | None = None) -> None:
    """``kvexport generate DIR``: greedy generation from an export directory (onnxruntime or TensorRT engines)."""
    import time

    from rich.console import Console

    from kvexport.cli.common import cache_summary, encode_prompts, print_completions
    from kvexport.errors import BadUsage
    from kvexport.models.loading import load_tokenizer

    gen = open_generator(directory, backend, engines)
    s = gen.settings
    tok = load_tokenizer(directory / s["tokenizer"]) if s.get("tokenizer") else None
    if tok is None:
        raise BadUsage(f"{directory} has no tokenizer/; export from a model directory that has tokenizer.json")
    ids, mask = encode_prompts(tok, prompts)
    if ids.shape[0] != gen.batch:
        raise BadUsage(f"{directory} was exported with --batch {gen.batch}; give {gen.batch} prompt(s), "
                       f"got {ids.shape[0]}")
    t0 = time.perf_counter()
    res = gen.generate(ids.numpy(), mask.numpy(), max_new_tokens, eos_token_id=tok.eos_token_id, track_kept=False)
    dt = time.perf_counter() - t0
    console = Console()
    print_completions(console, prompts, [tok.decode(res.tokens[i].tolist()) for i in range(ids.shape[0])])
    console.print(f"[dim]{res.tokens.shape[1]} tokens in {dt:.2f}s with {backend} ({gen.providers[0]}); "
                  f"{s['mode']} {cache_summary(res.resident_bytes)}; {res.compactions} compactions[/]", soft_wrap=True)
