# SPDX-License-Identifier: Apache-2.0
"""``kvexport rewrite`` (GQA -> MLA), ``kvexport inspect`` (cache accounting), ``kvexport distill`` (KL recovery)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.cli.app import app
from kvexport.models.gguf import resolve_model

RANK_HELP = "MLA latent rank r_kv (every layer)."
ENERGY_HELP = "Instead of --mla-rank: per-layer rank = smallest with cumulative σ² >= δ (0 < δ <= 1), rounded up to 8."
ROPE_HELP = "Decoupled RoPE key width d_rope (even, <= head_dim)."


ROPE_INIT_HELP = ("How the RoPE part is made: rorope (TransMLA's rotation across KV heads, default), perhead "
                  "(MHA2MLA's per-head partial RoPE), xeco (X-EcoMLA: head-averaged key, evenly spaced pairs), norm "
                  "(head-averaged key, 2-norm pairs).")
FIT_HELP = "Latent fit: wpca (query/output-weighted PCA on --calib, default), pca, or svd (weights only, X-EcoMLA)."
HORIZON_HELP = "Relative distances (tokens) the RoPE components are scored and the dropped ones averaged over."


def _settings(mla_rank, mla_energy, rope_dim, rope_init=None, q_rank=None, naive=False, kv_fit=None, horizon=None,
              equalize=False):
    from kvexport.mla.config import MLASettings

    kw = {k: v for k, v in (("rope_init", rope_init), ("kv_fit", kv_fit), ("rope_horizon", horizon)) if v is not None}
    return MLASettings(kv_rank=mla_rank, energy=mla_energy, rope_dim=rope_dim, q_rank=q_rank, absorb=not naive,
                       equalize_latent=equalize, **kw)


def _calibration(path: Optional[Path], tokenizer, vocab: int):
    if path is None:
        return None
    from kvexport.mla.distill import read_tokens

    ids = read_tokens(path, tokenizer, vocab)[:2048]
    n = max(1, ids.numel() // 256)
    return ids[: n * 256].view(n, -1) if ids.numel() >= 256 else ids[None]


def _spec_of(model: str):
    """(ModelSpec, MLA config dict or None, dtype name) from a directory, without loading weights."""
    from kvexport.errors import BadModel
    from kvexport.mla.io import is_mla_dir, read_mla_config
    from kvexport.models.spec import ModelSpec

    p = Path(model)
    if is_mla_dir(p):
        cfg = read_mla_config(p)
        return ModelSpec(**cfg["spec"]), cfg, cfg.get("dtype", "float32")
    if not p.is_dir():
        raise BadModel(f"model directory {model!r} does not exist")
    if not (p / "config.json").is_file():
        raise BadModel(f"{model!r} has no config.json (nor {'kvexport_mla.json'})")
    try:
        hf_cfg = json.loads((p / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadModel(f"{p / 'config.json'} is not valid JSON ({e.__class__.__name__})") from None
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**hf_cfg) if "model_type" in hf_cfg else None
    except Exception as e:  # noqa: BLE001
        raise BadModel(f"transformers cannot read {p / 'config.json'}: {str(e).splitlines()[0][:200]}") from None
    if config is None:
        raise BadModel(f"{p / 'config.json'} has no model_type")
    dtype = str(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32")
    return ModelSpec.from_hf_config(config), None, dtype


@app.command("rewrite")
def rewrite_cmd(
    model: str = typer.Argument(..., help="HF model directory or .gguf file (Llama, Qwen2, Qwen3, Mistral)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write the MLA model to (must not exist or be empty)."),
    mla_rank: Optional[int] = typer.Option(None, "--mla-rank", help=RANK_HELP),
    mla_energy: Optional[float] = typer.Option(None, "--mla-energy", help=ENERGY_HELP),
    rope_dim: int = typer.Option(32, "--rope-dim", help=ROPE_HELP),
    rope_init: Optional[str] = typer.Option(None, "--rope-init", help=ROPE_INIT_HELP),
    kv_fit: Optional[str] = typer.Option(None, "--kv-fit", help=FIT_HELP),
    rope_horizon: Optional[int] = typer.Option(None, "--rope-horizon", help=HORIZON_HELP + " Default 2048."),
    q_rank: Optional[int] = typer.Option(None, "--q-rank", help="Low-rank query r_q (default: full W_Q)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text (default: seeded random token ids)."),
    naive: bool = typer.Option(False, "--naive", help="Use the decompressed attention path (default: absorbed)."),
    equalize_latent: bool = typer.Option(
        False, "--equalize-latent",
        help="Rescale each latent channel and RoPE pair to the same calibration maximum (exact; for an int8 cache, "
             "which convert/export --kv-dtype int8 do themselves)."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16."),
    refit_steps: int = typer.Option(0, "--refit-steps", help="Repair each layer after the rewrite: this many Adam "
                                    "steps fit its new projections to the original attention's outputs on the "
                                    "calibration text (--calib, else 2048 tokens of bundled text; 100 is the "
                                    "measured choice, about 14 s per layer of SmolLM2-135M on 2 CPU cores; "
                                    "docs/mla.md). Default 0: none."),
) -> None:
    """Rewrite a GQA/MHA model into MLA (X-EcoMLA SVD init) and save it as a kvexport MLA directory."""
    from rich.console import Console

    from kvexport.errors import BadUsage
    from kvexport.mla.accounting import cache_report
    from kvexport.mla.io import load_decoder, save_mla
    from kvexport.mla.rewrite import rewrite_to_mla
    from kvexport.models.loading import load_tokenizer

    settings = _settings(mla_rank, mla_energy, rope_dim, rope_init, q_rank, naive, kv_fit, rope_horizon,
                         equalize_latent)
    model = resolve_model(model)
    spec, mla_cfg, _ = _spec_of(model)
    if mla_cfg is not None:
        raise BadUsage(f"{model} is already an MLA model")
    settings.check_model(spec.head_dim, spec.hidden_size, spec.num_kv_heads, spec.qk_norm)
    if out.exists() and not out.is_dir():
        raise BadUsage(f"--out {out} is a file; give a directory path")
    if out.exists() and any(out.iterdir()):
        raise BadUsage(f"output directory {out} exists and is not empty; choose another --out")
    if refit_steps < 0:
        raise BadUsage(f"--refit-steps {refit_steps} must be >= 0 (0: no refit)")
    tok = load_tokenizer(model)
    calib_ids = _calibration(calib, tok, spec.vocab_size)
    refit = None
    if refit_steps:
        from kvexport.eval.data import calibration_windows
        from kvexport.mla.refit import RefitSettings

        refit = RefitSettings(steps=refit_steps)
        if calib_ids is None:
            calib_ids = calibration_windows(tok, refit.sequences, refit.seq_len, spec.vocab_size)
    dec, hf = load_decoder(model, dtype)
    mla = rewrite_to_mla(dec, settings, calib_ids, refit=refit)
    save_mla(mla, out, tokenizer_dir=model, hf_config=json.loads(hf.config.to_json_string()))
    if refit is not None:
        fit = mla.refit_summary
        Console().print(f"refit {fit['steps']} steps x {len(fit['layers'])} layers on {fit['tokens']} tokens in "
                        f"{fit['seconds']:.0f} s: attention error {fit['loss_before']:.3f} -> {fit['loss_after']:.3f}")
    rep = cache_report(spec, mla_ranks=[p.kv_rank for p in mla.mla_plans], rope_dim=rope_dim, context=1)
    Console().print(f"wrote {out}: r_kv per layer {[p.kv_rank for p in mla.mla_plans]}, d_rope {rope_dim}; "
                    f"cache {rep.to_dict()['per_token_ratio']:.2f}x smaller per token")


def _export_settings(model: str):
    """The manifest settings of an export or a conversion's export (``DIR/onnx``), else None."""
    from kvexport.layout import export_dir_of, read_manifest
    from kvexport.manifest import ONNX_EXPORT

    p = Path(model)
    if not p.is_dir():
        return None
    m = read_manifest(export_dir_of(p))
    if m is None or m.get("kind") != ONNX_EXPORT or not isinstance(m.get("settings"), dict):
        return None
    return m["settings"]


def _inspect_export(model: str, settings: dict, context: int, as_json: bool) -> None:
    """An export's cache at ``context`` tokens, from its manifest, by the accounting the runtimes are held to
    (:meth:`kvexport.cache.memory.CacheShape.from_export`), against the same model's full cache in the same
    element type."""
    from kvexport.cache.memory import CacheShape, full_cache_of
    from kvexport.errors import BadUsage

    if context < 1:
        raise BadUsage(f"--context {context} must be >= 1 token")
    shape = CacheShape.from_export(settings)
    base = full_cache_of(shape)
    in_place = bool(settings.get("inplace_decode"))
    this = shape.resident_bytes_at(context, in_place=in_place)
    orig = base.resident_bytes_at(context)
    mla = settings.get("mla")
    press = settings.get("press")
    from kvexport.models.spec import SUPPORTED_FAMILIES

    model_type = settings["spec"].get("model_type")
    d = {"export": str(model), "family": SUPPORTED_FAMILIES.get(model_type, model_type), "num_layers": shape.num_layers,
         "press": press.get("name") if isinstance(press, dict) else press, "budgets": settings.get("budgets"),
         "window": settings.get("window"),
         "kv_dtype": shape.kv_format.name, "mla_ranks": list(mla["kv_ranks"]) if mla else None,
         "rope_dim": int(mla["rope_dim"]) if mla else 0, "context": int(context),
         "bytes_per_token": shape.bytes_per_token(), "original_bytes_per_token": base.bytes_per_token(),
         "tokens_held": shape.slots(context), "bytes_per_sequence": this["kv"] + this["scales"],
         "original_bytes_per_sequence": orig["kv"], "resident_bytes": this,
         "original_resident_bytes": orig["total"]}
    d["ratio"] = d["original_bytes_per_sequence"] / d["bytes_per_sequence"]
    d["resident_ratio"] = orig["total"] / this["total"]
    if as_json:
        typer.echo(json.dumps(d, indent=2))
        return
    what = f"{d['press'] or 'full cache'}" + (f", budget {max(d['budgets'])} + window {d['window']}"
                                             if d["budgets"] else "") + f", {d['kv_dtype']}"
    if mla:
        lo, hi = min(d["mla_ranks"]), max(d["mla_ranks"])
        what += f", MLA r_kv {lo if lo == hi else f'{lo}-{hi}'} + d_rope {d['rope_dim']}"
    _print_cache_table(f"KV cache of the export {model} ({what})", ("original (full cache)", "this export"), [
        ("bytes / token (all layers)", f"{d['original_bytes_per_token']:,}", f"{d['bytes_per_token']:,}"),
        (f"tokens held at context {context}", f"{context:,}", f"{d['tokens_held']:,}"),
        ("cache bytes / sequence", f"{d['original_bytes_per_sequence']:,}", f"{d['bytes_per_sequence']:,}"),
        ("resident bytes / sequence", f"{d['original_resident_bytes']:,}", f"{this['total']:,}"),
        ("ratio", "1.00x", f"{d['ratio']:.2f}x (resident {d['resident_ratio']:.2f}x)")])


def _print_cache_table(title: str, columns: tuple[str, str], rows: list[tuple[str, str, str]]) -> None:
    """inspect's table: a label, the original's value and this cache's, per row."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("")
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)


@app.command("inspect")
def inspect_cmd(
    model: str = typer.Argument(..., help="HF model directory, .gguf file, kvexport MLA directory, or an export / "
                                          "conversion (its cache as exported, from its manifest)."),
    mla_rank: Optional[int] = typer.Option(None, "--mla-rank", help=RANK_HELP + " Accounting from the config alone."),
    mla_energy: Optional[float] = typer.Option(None, "--mla-energy", help=ENERGY_HELP + " Loads the weights."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help=ROPE_HELP + " Default 32 with an MLA rank."),
    budget: Optional[int] = typer.Option(None, "--budget", help="Static eviction budget (tokens kept per layer)."),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help="Decode window slots on top of --budget."),
    context: int = typer.Option(4096, "--context", help="Sequence length for the per-sequence numbers."),
    cache_dtype: Optional[str] = typer.Option(None, "--dtype", help="Cache element type (default: the model's)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Cache size per token, layer and sequence, resident bytes (every buffer a static runtime holds: cache,
    positions, the press's query ring, logits), and the ratio against the original (uncompressed) cache."""
    from kvexport.errors import BadUsage
    from kvexport.mla.accounting import cache_report

    export = _export_settings(model)
    if export is not None:
        given = [f for f, v in (("--mla-rank", mla_rank), ("--mla-energy", mla_energy), ("--rope-dim", rope_dim),
                                ("--budget", budget), ("--dtype", cache_dtype)) if v is not None]
        if window != DEFAULT_WINDOW:
            given.append("--window")
        if given:
            raise BadUsage(f"{model} is an export: its cache is fixed by its graphs; drop {', '.join(given)} "
                           "(they size the cache of an HF or MLA model)")
        _inspect_export(model, export, context, as_json)
        return
    model = resolve_model(model)
    spec, mla_cfg, dtype = _spec_of(model)
    mla_info = None
    ranks = None
    if mla_cfg is not None:
        if mla_rank is not None or mla_energy is not None:
            raise BadUsage(f"{model} is already an MLA model; --mla-rank/--mla-energy apply to HF models")
        ranks = [lp["kv_rank"] for lp in mla_cfg["layers"]]
        rope_dim = int(mla_cfg["settings"]["rope_dim"])
        mla_info = mla_cfg["settings"]
    elif mla_rank is not None or mla_energy is not None:
        rope_dim = 32 if rope_dim is None else rope_dim
        settings = _settings(mla_rank, mla_energy, rope_dim)
        settings.check_model(spec.head_dim, spec.hidden_size, spec.num_kv_heads, spec.qk_norm)
        if mla_energy is not None:
            from kvexport.mla.io import load_decoder
            from kvexport.mla.rewrite import rewrite_to_mla

            dec, _ = load_decoder(model)
            ranks = [p.kv_rank for p in rewrite_to_mla(dec, settings).mla_plans]
        else:
            ranks = [int(mla_rank)]
        mla_info = settings.to_dict()
    elif rope_dim is not None:
        raise BadUsage("--rope-dim needs --mla-rank or --mla-energy")
    norm = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
    rep = cache_report(spec, model=model, mla_ranks=ranks, rope_dim=rope_dim, context=context, budget=budget,
                       window=window if budget is not None else None,
                       dtype=cache_dtype or norm.get(dtype, "float16"), mla=mla_info)
    d = rep.to_dict()
    if as_json:
        typer.echo(json.dumps(d, indent=2))
        return
    per_layer = d["elements_per_token_layer"]
    _print_cache_table(f"KV cache of {model} ({spec.family}, {spec.num_layers} layers, {d['dtype']})",
                       ("original", "this"), [
        ("elements / token / layer", str(d["original_elements_per_token_layer"]),
         str(per_layer[0]) if len(set(per_layer)) == 1 else f"{min(per_layer)}-{max(per_layer)}"),
        ("bytes / token (all layers)", f"{d['original_bytes_per_token']:,}", f"{d['bytes_per_token']:,}"),
        (f"tokens held at context {context}", f"{context:,}", f"{d['tokens_held']:,}"),
        ("bytes / sequence", f"{d['original_bytes_per_sequence']:,}", f"{d['bytes_per_sequence']:,}"),
        ("resident bytes / sequence", f"{d['original_resident_bytes']:,}", f"{d['resident_bytes']:,}"),
        ("ratio", "1.00x", f"{d['ratio']:.2f}x (per token {d['per_token_ratio']:.2f}x)")])


@app.command("distill")
def distill_cmd(
    student: str = typer.Argument(..., help="MLA model directory, or an HF directory with --mla-rank/--rope-dim."),
    teacher: str = typer.Option(..., "--teacher", help="Teacher model directory or .gguf file (same tokenizer; may be larger)."),
    data: Path = typer.Option(..., "--data", help="Training data: UTF-8 text, .jsonl (text or input_ids) or .npy ids."),
    tokens: int = typer.Option(..., "--tokens", help="Training tokens to consume (steps = tokens / (batch x seq-len))."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default: <student>-distilled)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training sequence."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per global batch (split over processes)."),
    lr: float = typer.Option(1e-4, "--lr", help="AdamW learning rate."),
    ce_weight: float = typer.Option(0.0, "--ce-weight", help="Weight of next-token cross-entropy added to the KL."),
    warmup: float = typer.Option(0.05, "--warmup", help="Linear warm-up, as a fraction of the steps."),
    min_lr: float = typer.Option(0.1, "--min-lr", help="Cosine decay ends at this fraction of --lr (1 = constant)."),
    copy_fraction: float = typer.Option(0.5, "--copy-fraction",
                                        help="Fraction of each batch's sequences with a span repeated later (recall)."),
    save_every: int = typer.Option(100, "--save-every", help="Checkpoint every N steps (and at the end)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --out."),
    seed: int = typer.Option(0, "--seed", help="Data order and init seed."),
    mla_rank: Optional[int] = typer.Option(None, "--mla-rank", help=RANK_HELP + " Rewrites an HF student first."),
    mla_energy: Optional[float] = typer.Option(None, "--mla-energy", help=ENERGY_HELP),
    rope_dim: int = typer.Option(32, "--rope-dim", help=ROPE_HELP),
    rope_init: Optional[str] = typer.Option(None, "--rope-init", help=ROPE_INIT_HELP),
    kv_fit: Optional[str] = typer.Option(None, "--kv-fit", help=FIT_HELP + " Calibrated on the training data."),
    cpu: bool = typer.Option(False, "--cpu", help="Stay on the CPU even when a GPU is present."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar (logs still written)."),
) -> None:
    """Distil an MLA student from a teacher's logits (forward KL), with checkpoints; `accelerate launch -m kvexport
    distill ...` runs the same command data-parallel over processes and machines."""
    from kvexport.errors import BadModel, BadUsage
    from kvexport.mla.distill import DistillConfig, check_out_dir, check_teacher, distill, read_tokens
    from kvexport.mla.io import is_mla_dir, load_decoder, load_mla, verify_mla_files
    from kvexport.models.loading import load_tokenizer

    cfg = DistillConfig(tokens=tokens, seq_len=seq_len, batch_size=batch_size, lr=lr, ce_weight=ce_weight,
                        save_every=save_every, seed=seed, warmup=warmup, min_lr=min_lr, copy_fraction=copy_fraction)
    out = out or Path(str(Path(student)).rstrip("/").removesuffix(".gguf") + "-distilled")
    check_out_dir(out, resume)
    student, teacher = resolve_model(student), resolve_model(teacher)
    if not data.is_file():
        raise BadUsage(f"data file {data} does not exist")
    if data.stat().st_size == 0:
        raise BadUsage(f"data file {data} is empty")
    mla_dir = is_mla_dir(student)
    if mla_dir:
        verify_mla_files(student)  # before the tokenizer is read from it
    if mla_dir and (mla_rank is not None or mla_energy is not None):
        raise BadUsage(f"{student} is already an MLA model; drop --mla-rank/--mla-energy")
    settings = None
    if not mla_dir:
        if mla_rank is None and mla_energy is None:
            raise BadUsage(f"{student} is not an MLA directory; give --mla-rank R (or --mla-energy δ) and "
                           "--rope-dim D to rewrite it first")
        settings = _settings(mla_rank, mla_energy, rope_dim, rope_init, kv_fit=kv_fit)
        spec, _, _ = _spec_of(student)
        settings.check_model(spec.head_dim, spec.hidden_size, spec.num_kv_heads, spec.qk_norm)
    s_spec, _, _ = _spec_of(student)
    t_spec, _, _ = _spec_of(teacher)
    if s_spec.vocab_size != t_spec.vocab_size:
        raise BadModel(f"teacher vocabulary ({t_spec.vocab_size} tokens) differs from the student's "
                       f"({s_spec.vocab_size}); distillation needs the same tokenizer")
    s_tok = load_tokenizer(student)
    t_tok = load_tokenizer(teacher) if Path(teacher).is_dir() else None
    if mla_dir:
        stud = load_mla(student)
    else:
        dec, hf = load_decoder(student)
        dec.hf_config = json.loads(hf.config.to_json_string())
    vocab = stud.spec.vocab_size if mla_dir else dec.spec.vocab_size
    ids = read_tokens(data, s_tok, vocab)
    teach, _ = load_decoder(teacher)
    if not mla_dir:
        from kvexport.mla.rewrite import rewrite_to_mla

        n = min(ids.numel() // 64, 8)
        calib = ids[: n * 64].view(n, 64) if n else ids[None]
        stud = rewrite_to_mla(dec, settings, calib)
    check_teacher(stud, teach, s_tok, t_tok)
    try:
        distill(stud, teach, ids, out, cfg, resume=resume, tokenizer_dir=student, cpu=cpu, progress=not no_progress)
    finally:
        # under `accelerate launch` the gloo group must be torn down before the interpreter exits: left to the
        # atexit order, a rank can abort in gloo's threads ("terminate called without an active exception")
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
