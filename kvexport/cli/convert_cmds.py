# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert``, ``kvexport profile``, ``kvexport report``: the one-command conversion and its proof."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvexport.cli.app import app


@app.command("convert")
def convert_cmd(
    model: Optional[str] = typer.Argument(None, help="HF model directory (Llama, Qwen2, Qwen3, Mistral). "
                                          "Default: the bundled reference student."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (written atomically)."),
    mla_rank: Optional[int] = typer.Option(None, "--mla-rank", help="MLA latent rank r_kv (X-EcoMLA rewrite)."),
    mla_energy: Optional[float] = typer.Option(None, "--mla-energy",
                                               help="Instead of --mla-rank: per-layer rank by SVD energy δ in (0, 1]."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help="MLA decoupled RoPE key width d_rope (even)."),
    press: Optional[str] = typer.Option(None, "--press", help="Eviction press (snapkv, knorm, tova, ...; 'none' "
                                        "keeps every token)."),
    budget: Optional[int] = typer.Option(None, "--budget", help="Tokens kept per layer after each compaction "
                                         "(without --press: the default press at this budget)."),
    window: Optional[int] = typer.Option(None, "--window", help="Decode slots between compactions."),
    neighbors: Optional[int] = typer.Option(None, "--neighbors", help="A kept token keeps this many neighbours on "
                                            "each side (0: the press's own ranking; default 3 with no compression "
                                            "flags)."),
    lookahead: Optional[int] = typer.Option(None, "--lookahead", help="The prompt's last L tokens observe every "
                                            "earlier prefill chunk (0: each chunk observes itself; default 64 with "
                                            "no compression flags)."),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="Prefill chunk length of the exported graph."),
    decode_batch: Optional[int] = typer.Option(None, "--decode-batch", help="Rows of the export's batched decode "
                                               "graph, what `kvexport serve` decodes its slots with (default 16; "
                                               "0: none)."),
    max_positions: Optional[int] = typer.Option(None, "--max-positions", help="Without a press: the static "
                                                "cache's capacity, the longest context (default: the model's)."),
    distill_teacher: Optional[str] = typer.Option(None, "--distill-teacher", help="Teacher model for distillation."),
    distill_data: Optional[Path] = typer.Option(None, "--distill-data", help="UTF-8 text to distill on."),
    distill_tokens: Optional[int] = typer.Option(None, "--distill-tokens", help="Tokens to distill on."),
    refit_steps: Optional[int] = typer.Option(None, "--refit-steps", help="Repair the MLA rewrite layer by layer: "
                                              "this many Adam steps per layer fit its new projections to the "
                                              "original attention's outputs on 2048 tokens of bundled text (100 is "
                                              "the measured choice; cost: about 14 s per layer on 2 CPU cores for "
                                              "SmolLM2-135M, 7 min; docs/mla.md). Default 0: none."),
    target: Optional[str] = typer.Option(None, "--target", help="onnx (default) or tensorrt (adds engines)."),
    fp16: Optional[bool] = typer.Option(None, "--fp16/--fp32", help="Export in fp16 (default fp32)."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="How the exported cache stores K/V (or the MLA "
                                           "latent): fp32, fp16, bf16, int8, fp8 (docs/quantized.md). Default: the "
                                           "export's dtype. A lossy format is also validated against its fp32 twin."),
    weights: Optional[str] = typer.Option(None, "--weights", help="How DIR/onnx stores the model's MatMul weights: "
                                          "fp32 (default), fp16, int4 (onnxruntime MatMulNBits; a GGUF model keeps "
                                          "its own Q4_1 / Q8_0 blocks), int4-a8 (the same "
                                          "with int8 activations: faster on a CPU, not bit-faithful) or int4-qdq "
                                          "(INT4 DequantizeLinear for TensorRT); validated against PyTorch on the "
                                          "same weights, fidelity against the original (docs/quantized.md)."),
    validate: Optional[bool] = typer.Option(None, "--validate/--no-validate", help="Check parity (default on)."),
    profile: Optional[bool] = typer.Option(None, "--profile/--no-profile", help="Profile latency/memory (default on)."),
    baseline: Optional[bool] = typer.Option(None, "--baseline/--no-baseline",
                                            help="Also export the uncompressed baseline to compare with (default on)."),
    contexts: Optional[str] = typer.Option(None, "--contexts", help="Profile context lengths, e.g. 512,2048,8192."),
    decode_steps: Optional[int] = typer.Option(None, "--decode-steps", help="Timed decode steps per context."),
    validate_steps: Optional[int] = typer.Option(None, "--validate-steps",
                                                 help="Decode steps per prompt in the parity check (default 64)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Timed profile runs per context (default 3; "
                                          "the report shows their spread)."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Held-out text for the fidelity check "
                                            "(converted vs original model): a UTF-8 file or bundled:NAME."),
    min_agreement: Optional[float] = typer.Option(None, "--min-agreement", help="Fail the validate stage when "
                                                  "next-token agreement with the original model is below this."),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help="Fail the validate stage "
                                                     "when perplexity rises by more than this (0.05 = +5 %)."),
    choose: bool = typer.Option(False, "--choose", help="Choose the press, budget, cache format and MLA rank by measured "
                                "fidelity: the smallest cache meeting --min-agreement (default 0.9), "
                                "--max-ppl-increase (0.1) and --min-recall (0.9) on calibration text "
                                "(DIR/choice.json; minutes to an hour on a CPU)."),
    min_recall: Optional[float] = typer.Option(None, "--min-recall", help="With --choose: passkey recall to keep, "
                                               "as a fraction of the original model's (default 0.9)."),
    choose_context: Optional[int] = typer.Option(None, "--choose-context", help="With --choose: the context "
                                                 "(tokens) candidates are measured at (default 4096)."),
    fidelity: Optional[bool] = typer.Option(None, "--fidelity/--no-fidelity", help="Measure what compression "
                                            "costs against the original model while validating (default on)."),
    allow_partial: bool = typer.Option(False, "--allow-partial",
                                                 help="--target tensorrt without TensorRT: keep the ONNX result."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML/JSON file of settings (e.g. a saved "
                                          "DIR/convert.json); flags given here override it."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
) -> None:
    """Convert a model in one go: load -> rewrite -> (distill) -> export -> (engine) -> validate -> profile -> report.

    With no compression flags it applies the defaults chosen on a real model (SmolLM2-135M-Instruct,
    docs/sweep.md): SnapKV with a lookahead of 64 and 3 neighbours, budget 2048, window 32, chunk 512, an int8
    cache, no MLA. Any compression flag selects exactly what is given. DIR/convert.json reproduces the run with
    --config.
    """
    from rich.console import Console

    from kvexport.convert.config import ConvertConfig
    from kvexport.convert.stages import run_convert
    from kvexport.errors import BadUsage

    if out is None:
        raise BadUsage("--out DIR is required (where the conversion is written)")
    base = ConvertConfig.from_file(config) if config is not None else ConvertConfig()
    flags = dict(model=model, mla_rank=mla_rank, mla_energy=mla_energy, rope_dim=rope_dim, press=press,
                 budget=budget, window=window, neighbors=neighbors, lookahead=lookahead, chunk=chunk,
                 decode_batch=decode_batch, max_positions=max_positions,
                 distill_teacher=distill_teacher,
                 distill_data=str(distill_data) if distill_data is not None else None,
                 distill_tokens=distill_tokens, refit_steps=refit_steps, target=target, fp16=fp16, kv_dtype=kv_dtype, weights=weights, validate=validate, profile=profile,
                 baseline=baseline, contexts=contexts, decode_steps=decode_steps, validate_steps=validate_steps,
                 repeats=repeats, eval_data=eval_data, min_agreement=min_agreement,
                 max_ppl_increase=max_ppl_increase, fidelity=fidelity, choose=True if choose else None,
                 min_recall=min_recall, choose_context=choose_context, allow_partial=True if allow_partial else None)
    cfg = base.merged(flags)
    console = Console(stderr=True)
    cj = run_convert(cfg, out, force=force, console=console)
    console.print(convert_summary(out, cj), highlight=False, soft_wrap=True)


def convert_summary(out: Path, cj: dict) -> str:
    """The last line of ``kvexport convert``: where, how long, what was written, what compression cost."""
    import json

    from kvexport import layout
    from kvexport.report.sections import fidelity_summary, profile_warnings

    total = sum(s["seconds"] for s in cj["stages"])
    files = ["convert.json"] + [n for n in (layout.PARITY_JSON,) if (out / n).exists()]
    files += [p.name for p in layout.profile_files(out).values()] + ["report.html"]
    line = f"[bold]wrote {out}[/] in {total:.1f}s: {', '.join(files)}"
    parity = out / layout.PARITY_JSON
    fid = json.loads(parity.read_text()).get("fidelity") if parity.is_file() else None
    if isinstance(fid, dict):
        from kvexport.export.quality import quality_markup

        line += f"\nwhat compression cost: {fidelity_summary(fid)}\n{quality_markup(fid)}"
    twin = json.loads(parity.read_text()).get("twin") if parity.is_file() else None
    if isinstance(twin, dict):
        from kvexport.report.sections import twin_label, twin_summary

        line += f"\n{twin_label(twin)}: {twin_summary(twin)}"
    for p in layout.profile_files(out).values():
        for w in profile_warnings(json.loads(p.read_text())):
            line += f"\n[yellow]note:[/] {w}"
    return line


@app.command("profile")
def profile_cmd(
    directory: Path = typer.Argument(..., help="A directory made by kvexport convert (or kvexport export)."),
    backend: str = typer.Option("onnxruntime", "--backend", help="onnxruntime, tensorrt or pytorch."),
    contexts: Optional[str] = typer.Option(None, "--contexts", help="Context lengths, e.g. 512,2048,8192 "
                                           "(default: the conversion's)."),
    decode_steps: int = typer.Option(32, "--decode-steps", help="Timed decode steps per context."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per context (the report shows their spread)."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Profile the full-cache baseline too."),
    report: bool = typer.Option(True, "--report/--no-report", help="Regenerate the report afterwards "
                                "(convert directories)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the JSON here instead of "
                                       "DIR/profile-BACKEND.json (a bare export: EXPORT.profile-BACKEND.json "
                                       "beside it)."),
) -> None:
    """Prefill/decode latency, tokens/s, KV bytes and memory per context length -> DIR/profile-BACKEND.json
    (one file per backend; the report shows each)."""
    from rich.console import Console
    from rich.table import Table

    from kvexport.convert.config import parse_contexts
    from kvexport.convert.progress import StepProgress, stdout_console
    from kvexport.layout import read_convert_json
    from kvexport.profile.run import profile_dir, profile_target

    console = Console(stderr=True)
    ctx = parse_contexts(contexts, "--contexts") if contexts else None
    target = out or profile_target(directory, backend)
    with StepProgress(console, f"profiling {directory} on {backend}") as p:
        prof = profile_dir(directory, backend=backend, contexts=ctx, decode_steps=decode_steps, baseline=baseline,
                           write=target, repeats=repeats, progress=p.callback)
    t = Table(title=f"{directory} ({backend}, {repeats} run{'s' if repeats != 1 else ''} per context)")
    t.add_column("variant", no_wrap=True)
    for h in ("context", "TTFT s", "decode p50 ms", "p10-p90 over runs", "tok/s", "KV KiB", "peak RSS MiB"):
        t.add_column(h, justify="right", no_wrap=True)
    for name, v in prof["variants"].items():
        for r in v["contexts"]:
            sp = r["spread"]["decode_ms_p50"]
            t.add_row(name, str(r["context"]), f"{r['ttft_s']:.3f}", f"{r['decode_ms_p50']:.2f}",
                      f"{sp['p10']:.2f}-{sp['p90']:.2f}", f"{r['tokens_per_s']:.1f}",
                      f"{r.get('kv_bytes', 0) / 2**10:.1f}", f"{r['peak_rss_bytes'] / 2**20:.0f}")
    stdout_console().print(t)
    for s in prof.get("skipped_contexts") or []:
        console.print(f"[yellow]skipped context {s['context']}: {s['reason']}[/]", highlight=False)
    from kvexport.report.render import profile_warnings

    for w in profile_warnings(prof):
        console.print(f"[yellow]note: {w}[/]", highlight=False, soft_wrap=True)
    report = report and out is None and read_convert_json(directory) is not None
    if report:
        from kvexport.report import write_report

        write_report(directory)
    console.print(f"wrote {target}" + (" and the report" if report else "") + f" in {p.elapsed:.0f}s",
                  highlight=False)


@app.command("report")
def report_cmd(
    directory: Path = typer.Argument(..., help="A directory made by kvexport convert."),
) -> None:
    """Regenerate DIR/report.html (self-contained), report.md, report.json and plots/ from DIR's JSON files."""
    from rich.console import Console

    from kvexport.report import write_report

    rep = write_report(directory)
    Console(stderr=True).print(f"wrote {directory}/report.html ({rep['verdict']}; {len(rep.get('plots') or {})} plots)",
                               highlight=False)
