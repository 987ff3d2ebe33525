# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert``: load -> rewrite -> (distill) -> export -> (engine) -> validate -> profile -> report.

Everything that can be refused is refused before the first stage (settings, model directory, ranks,
``--out``, TensorRT for ``--target tensorrt`` without ``--allow-partial``). Stages then run inside a
temporary sibling of ``--out`` that is renamed onto it only at the end (kvexport.manifest's
``atomic_output``), so a failed stage leaves nothing behind. See :mod:`kvexport.layout` for
what the directory holds.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvexport import layout
from kvexport.atomic import rebase_paths
from kvexport.convert.config import ConvertConfig, default_budget, default_rope_dim
from kvexport.convert.pipeline import Pipeline, Stage, StageRecord, StageSkipped
from kvexport.errors import BadUsage, MissingBackend, ParityFailure

#: tokens a distillation sees when --distill-tokens is not given
DEFAULT_DISTILL_TOKENS = 65536


@dataclass
class ConvertState:
    """What stages hand to each other."""

    cfg: ConvertConfig
    model_path: Path
    work: Path
    spec: Any = None
    hf: Any = None
    decoder: Any = None
    mla_decoder: Any = None
    export_source: Any = None
    out: Path | None = None  # the final --out (work is renamed onto it at the end)
    #: progress(message) shows a sub-step of the running stage (None when nobody would see it: not a terminal)
    progress: Any = None
    parity: dict[str, Any] | None = None
    engine_missing: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)


def tensorrt_problem() -> str | None:
    """None when TensorRT engines can be built here, else one line saying what is missing."""
    from kvexport.tensorrt.backend import import_tensorrt

    try:
        import_tensorrt()
    except MissingBackend as e:
        return str(e)
    from kvexport.profile.memory import gpu_present

    if not gpu_present():
        return "TensorRT is installed but no NVIDIA GPU is visible"
    return None


def resolve_settings(cfg: ConvertConfig) -> tuple[ConvertConfig, Path, Any]:
    """Check and complete the settings against the model; -> (cfg, model dir, ModelSpec). No work done."""
    from kvexport.models.gguf import is_gguf, resolve_model
    from kvexport.models.loading import check_model_dir
    from kvexport.profile.run import model_spec

    budget_given = cfg.budget is not None
    cfg.resolve()
    model_path = Path(resolve_model(cfg.model)).resolve()
    # convert.json names what the user gave: a .gguf file is resolved to its cached directory again on a rerun
    cfg.model = str(Path(cfg.model).resolve()) if is_gguf(cfg.model or "") else str(model_path)
    check_model_dir(model_path)
    spec = model_spec(model_path)
    if cfg.uses_press and not budget_given:  # the default budget fits the model's positions
        cfg.budget = default_budget(spec.max_position_embeddings)
    if cfg.uses_mla:
        if cfg.rope_dim is None:
            cfg.rope_dim = default_rope_dim(spec.head_dim)
        mla_settings(cfg).check_model(spec.head_dim, spec.hidden_size, spec.num_kv_heads)
    if cfg.uses_press:
        from kvexport.presses import make_press

        make_press(cfg.press, budget=cfg.budget)  # refuses a budget the press cannot take
        from kvexport.cache.plan import capacities
        from kvexport.export.source import NOT_EXPORTABLE

        if cfg.press in NOT_EXPORTABLE:
            raise BadUsage(f"--press {cfg.press} cannot be exported: {NOT_EXPORTABLE[cfg.press]}")
        ctx_max = int(spec.max_position_embeddings)
        if capacities([cfg.budget], cfg.window)[0] > ctx_max:
            raise BadUsage(f"--budget {cfg.budget} + --window {cfg.window} exceeds the model's {ctx_max} positions")
    if cfg.max_positions is not None and cfg.max_positions > int(spec.max_position_embeddings):
        raise BadUsage(f"--max-positions {cfg.max_positions} exceeds the model's {spec.max_position_embeddings} "
                       "positions")
    if cfg.chunk > int(spec.max_position_embeddings):
        raise BadUsage(f"--chunk {cfg.chunk} exceeds the model's {spec.max_position_embeddings} positions")
    if cfg.distills:
        cfg.distill_teacher = resolve_model(cfg.distill_teacher)
        if not Path(cfg.distill_teacher).is_dir():
            raise BadUsage(f"--distill-teacher {cfg.distill_teacher} is not a model directory")
        check_model_dir(cfg.distill_teacher)
        t_spec = model_spec(cfg.distill_teacher)
        if t_spec.vocab_size != spec.vocab_size:
            raise BadUsage(f"the teacher's vocabulary ({t_spec.vocab_size} tokens) differs from the model's "
                           f"({spec.vocab_size}); distillation needs the same tokenizer")
        if cfg.distill_tokens is None:
            cfg.distill_tokens = DEFAULT_DISTILL_TOKENS
    return cfg, model_path, spec


def mla_settings(cfg: ConvertConfig):
    from kvexport.mla.config import MLASettings, equalizes_latent

    return MLASettings(kv_rank=cfg.mla_rank, energy=cfg.mla_energy, rope_dim=int(cfg.rope_dim),
                       equalize_latent=equalizes_latent(cfg.kv_dtype))


# ----------------------------------------------------------------------------- stages
def stage_load(st: ConvertState) -> str:
    """The model for the rewrite, in fp32 (its SVDs); without MLA nothing here reads the weights (the export
    loads the directory itself, in the export's dtype): only the checkpoint's headers are read, so a bf16
    checkpoint of 8B parameters is never widened to a 32 GB fp32 copy."""
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import checkpoint_size, load_tokenizer
    from kvexport.quiet import quiet_libraries

    quiet_libraries()  # no `Loading weights` bar, no accelerate checkpoint warnings in the stage lines
    n, size = checkpoint_size(st.model_path)
    if st.cfg.uses_mla:  # an fp32 checkpoint is memory-mapped: only the pages the rewrite reads become resident
        st.decoder, st.hf = load_decoder(st.model_path, "fp32")
        n = sum(p.numel() for p in st.hf.parameters())
    if load_tokenizer(st.model_path) is None:
        st.notes["tokenizer"] = "none"
    st.notes["parameters"] = int(n)
    st.notes["weight_bytes"] = int(size)  # in the checkpoint's dtype
    return f"{st.spec.family}, {st.spec.num_layers} layers, {n / 1e6:.2f}M parameters"


def stage_choose(st: ConvertState) -> str:
    """--choose: the smallest cache that meets the targets on calibration text (kvexport.convert.choose), applied to
    the settings; every candidate tried, its numbers and why it was kept or dropped go to DIR/choice.json and
    convert.json. Nothing meeting the targets fails the conversion, naming the closest candidate."""
    from kvexport.convert.choose import Targets, choose

    cfg = st.cfg
    targets = Targets(min_agreement=0.90 if cfg.min_agreement is None else cfg.min_agreement,
                      max_ppl_increase=0.10 if cfg.max_ppl_increase is None else cfg.max_ppl_increase,
                      min_recall=0.90 if cfg.min_recall is None else cfg.min_recall)
    ctx = int(st.spec.max_position_embeddings)
    context = cfg.choose_context or min(4096, ctx // 2)
    if context > ctx:
        raise BadUsage(f"--choose-context {context} exceeds the model's {ctx} positions")
    say = st.progress or (lambda _m: None)
    choice = choose(st.model_path, targets, context=context, positions=min(8192, ctx), window=cfg.window,
                    chunk=cfg.chunk, log=lambda m: say(m.strip()))
    record = choice.to_dict()
    _write_json(st.work / layout.CHOICE_JSON, record)
    st.notes["choice"] = record
    if choice.chosen is None:
        near = min(choice.trail, key=lambda r: len(r["misses"]), default=None)
        why = "" if near is None else f"; closest: {near['family']} at budget {near['budget']} ({'; '.join(near['misses'])})"
        raise ParityFailure(f"--choose: no candidate met the targets at {context} tokens{why}; nothing was written "
                            "(loosen a target: --min-agreement, --max-ppl-increase, --min-recall)")
    c = choice.chosen
    cfg.press = c["press"] or "none"
    cfg.budget = c["budget"]
    cfg.neighbors = c["neighbors"] if c["press"] else None
    cfg.lookahead = c["lookahead"] if c["press"] else None
    if cfg.lookahead:
        from kvexport.presses import PRESSES

        cfg.lookahead = cfg.lookahead if PRESSES[c["press"]].observes else 0
    cfg.kv_dtype = c["kv_dtype"]
    if c.get("mla"):  # the rewrite stage makes the rank as it was measured (docs/convert.md)
        cfg.mla_rank, cfg.rope_dim = c["mla"]["kv_rank"], c["mla"]["rope_dim"]
    if not c["press"]:
        cfg.window = None
    # convert.json then reproduces the chosen conversion itself (the search is recorded beside it)
    cfg.choose, cfg.min_recall, cfg.choose_context = False, None, None
    return (f"{c['family']}" + (f", budget {c['budget']}" if c["budget"] else "")
            + f": {c['resident_bytes'] / 2**20:.1f} MiB at {min(8192, ctx)} tokens, agreement {c['agreement']:.1%}, "
            f"ppl {c['ppl_increase']:+.1%}; {len(choice.trail)} candidates in {choice.seconds:.0f} s")


def stage_rewrite(st: ConvertState) -> str:
    from kvexport.mla.io import save_mla
    from kvexport.mla.rewrite import rewrite_to_mla

    if not st.cfg.uses_mla:  # enabled for --choose, which may pick a rank or not
        raise StageSkipped("no MLA (eviction is applied in the export)")
    if st.decoder is None:  # --choose picked a rank: the load stage did not read the weights
        from kvexport.mla.io import load_decoder

        st.decoder, st.hf = load_decoder(st.model_path, "fp32")
    # the original is not read again (distill loads its teacher itself): the HF model, which shares the Decoder's
    # tensors, is dropped first, and the Decoder is rewritten in place, each layer's GQA projections freed in turn
    dec = st.decoder
    release(st, "decoder", "hf")
    refit, calib = None, None
    if st.cfg.refit_steps:
        from kvexport.eval.data import calibration_windows
        from kvexport.mla.refit import RefitSettings
        from kvexport.models.loading import load_tokenizer

        refit = RefitSettings(steps=int(st.cfg.refit_steps))
        calib = calibration_windows(load_tokenizer(st.model_path), refit.sequences, refit.seq_len, st.spec.vocab_size,
                                    seed=st.cfg.seed)
    dec = rewrite_to_mla(dec, mla_settings(st.cfg), calib, progress=st.progress, inplace=True, refit=refit)
    st.mla_decoder = dec
    save_mla(dec, st.work / layout.MLA_DIR, tokenizer_dir=st.model_path, hf_config=_hf_config(st.model_path))
    ranks = [p.kv_rank for p in dec.mla_plans]
    st.notes["mla_ranks"] = ranks
    full = 2 * st.spec.num_kv_heads * st.spec.head_dim
    per = sum(r + st.cfg.rope_dim for r in ranks) / len(ranks)
    line = f"MLA r_kv {_ranks_text(ranks)}, d_rope {st.cfg.rope_dim}: {full / per:.1f}× smaller per token"
    if refit is not None:
        fit = dec.refit_summary
        _write_json(st.work / layout.REFIT_JSON, fit)
        st.notes["refit"] = {k: fit[k] for k in ("steps", "tokens", "lr", "seconds", "loss_before", "loss_after")}
        line += (f"; refit {fit['steps']} steps x {len(fit['layers'])} layers on {fit['tokens']} tokens in "
                 f"{fit['seconds']:.0f} s: attention error {fit['loss_before']:.3f} -> {fit['loss_after']:.3f}")
    return line


def stage_distill(st: ConvertState) -> str:
    """Forward-KL distillation of the MLA student against the teacher (kvexport.mla.distill), then DIR/mla
    is replaced by the distilled model; the run's summary is kept as DIR/distill_summary.json."""
    from kvexport.mla.distill import DistillConfig, check_teacher, distill, read_tokens
    from kvexport.mla.io import load_decoder, load_mla, save_mla
    from kvexport.models.loading import load_tokenizer

    cfg = st.cfg
    tok = load_tokenizer(st.model_path)
    ids = read_tokens(cfg.distill_data, tok, st.spec.vocab_size)
    teacher, _ = load_decoder(cfg.distill_teacher, "fp32")
    check_teacher(st.mla_decoder, teacher, tok, load_tokenizer(cfg.distill_teacher))
    dcfg = DistillConfig(tokens=int(cfg.distill_tokens), seed=cfg.seed)
    if ids.numel() <= dcfg.seq_len:
        dcfg.seq_len = max(8, int(ids.numel()) - 1)
    run_dir = st.work / "distill"
    summary = distill(st.mla_decoder, teacher, ids, run_dir, dcfg, tokenizer_dir=st.model_path, progress=False)
    mla_dir = st.work / layout.MLA_DIR
    dec = load_mla(run_dir)
    shutil.rmtree(mla_dir)
    save_mla(dec, mla_dir, tokenizer_dir=st.model_path, hf_config=_hf_config(st.model_path))
    _write_json(st.work / "distill_summary.json", summary)
    shutil.rmtree(run_dir, ignore_errors=True)
    st.mla_decoder = dec
    final = summary.get("final") or {}
    st.notes["distill"] = {"steps": summary.get("steps"), "tokens": summary.get("tokens"), "final": final}
    kl = final.get("kl")
    return f"{summary.get('tokens')} tokens from {Path(cfg.distill_teacher).name}" + \
        (f", final KL {kl:.4f}" if kl is not None else "")


def stage_export(st: ConvertState) -> str:
    """DIR/onnx (+ DIR/baseline). A large checkpoint is exported in a child process (kvexport.convert.isolate),
    from the saved MLA directory: what the exporter leaves behind goes with the child, not into validate's peak."""
    from kvexport.convert.exporting import baseline_job, converted_job, export_in_child, run_jobs

    child = export_in_child(st)
    if child:
        from kvexport.convert.isolate import call_in_child

        jobs = [converted_job(st, in_memory=False)] + ([baseline_job(st)] if st.cfg.baseline else [])
        release(st, "mla_decoder")  # saved in DIR/mla: the child maps it from there
        call_in_child(run_jobs, jobs, progress=st.progress, what="export")
    else:
        run_jobs([converted_job(st)], progress=st.progress)
        # validate and profile load what they compare from disk: the converted model is not needed in memory again
        release(st, "mla_decoder")
        if st.cfg.baseline:
            run_jobs([baseline_job(st)], progress=st.progress)
            # the baseline's HF model is garbage held in reference cycles: collected now, its mapped checkpoint pages
            # leave with it instead of staying resident beside validate's models (+1 W on the 385M shape)
            release(st)
    msg = f"{_dir_size(st.work / layout.ONNX_DIR) / 2**20:.1f} MiB"
    if st.cfg.weights not in (None, "fp32"):
        msg += f" ({st.cfg.weights} weights)"
    if st.cfg.baseline:
        msg += f"; baseline {_dir_size(st.work / layout.BASELINE_DIR) / 2**20:.1f} MiB"
    return msg + ("; in a child process" if child else "")


def stage_engine(st: ConvertState) -> str:
    """One TensorRT engine per exported graph into DIR/engine (kvexport.tensorrt.build_engine)."""
    problem = tensorrt_problem()
    if problem is not None:
        # only reached with --allow-partial (checked up front otherwise)
        st.engine_missing = problem
        raise StageSkipped(problem)
    from kvexport.tensorrt.engine import build_engine, find_onnx_graphs, write_build_record

    out = st.work / layout.ENGINE_DIR
    out.mkdir()
    reports = [build_engine(g, out / (g.stem + ".engine"), fp16=st.cfg.fp16)
               for g in find_onnx_graphs(st.work / layout.ONNX_DIR)]
    write_build_record(out, reports)
    from kvexport.manifest import MANIFEST, sha256_file, write_manifest
    from kvexport.tensorrt.generator import ENGINE_KIND

    onnx_manifest = st.work / layout.ONNX_DIR / MANIFEST
    write_manifest(out, ENGINE_KIND, {"tensorrt": reports[0].tensorrt if reports else None, "fp16": st.cfg.fp16,
                                      "export_manifest_sha256": sha256_file(onnx_manifest)})
    return f"{len(reports)} engines, {_dir_size(out) / 2**20:.1f} MiB, TensorRT {reports[0].tensorrt if reports else '?'}"


def stage_validate(st: ConvertState) -> str:
    """Parity of DIR/onnx against the PyTorch model it was made from (the MLA decoder in DIR/mla, or the source
    model; a quantized export against the PyTorch cache in the same ``kv_dtype``), + the TensorRT pairs when engines
    were built, + what compression cost against the original model (the fidelity settings), + a lossy cache format
    against its fp32 twin (parity.json's ``twin``, kvexport.export.twin); DIR/parity.json. A failed tolerance or fidelity gate fails the stage."""
    from kvexport.convert.config import fidelity_kwargs
    from kvexport.export.fidelity import gate_failure
    from kvexport.export.validation import validate
    from kvexport.report.collect import normalize_parity
    from kvexport.report.sections import fidelity_summary

    cfg = st.cfg
    kw = fidelity_kwargs(cfg.eval_data, cfg.min_agreement, cfg.max_ppl_increase, cfg.fidelity)
    if cfg.target == "tensorrt" and st.engine_missing is None and (st.work / layout.ENGINE_DIR / "engines.json").is_file():
        kw.update(backend="tensorrt", engines=st.work / layout.ENGINE_DIR)  # + onnxruntime~tensorrt, pytorch~tensorrt
    if st.progress is not None:
        kw["progress"] = st.progress
    parity = validate(st.work / layout.ONNX_DIR, steps=cfg.validate_steps, write=False, raise_on_failure=False, **kw)
    parity = rebase_paths(parity, st.work, st.out)  # the final directory's paths, not the temporary one's
    st.parity = parity
    layout.write_parity(st.work, parity)
    norm = normalize_parity(parity)
    if not norm["passed"]:
        bad = [p for p in norm["pairs"] if not p.get("passed")]
        what = "; ".join(f"{p['pair']}: max abs logit error {p.get('max_abs_logit_error', float('nan')):.3g}, "
                         f"token agreement {p.get('token_agreement', float('nan')):.3f}, "
                         f"index agreement {p.get('index_agreement', float('nan')):.3f}" for p in bad)
        raise ParityFailure(f"parity FAILED ({what or 'no backend pair compared'}); nothing was written, rerun "
                            "with --no-validate to keep the export anyway")
    gate = gate_failure(parity.get("fidelity"))
    if gate:
        raise ParityFailure(f"{gate}; nothing was written (loosen the gate or choose a milder compression)")
    msg = f"PASSED ({', '.join(p['pair'] for p in norm['pairs'])})"
    if isinstance(parity.get("fidelity"), dict):
        msg += f"; vs the original: {fidelity_summary(parity['fidelity'])}"
    if isinstance(parity.get("twin"), dict):
        from kvexport.report.sections import twin_label, twin_summary

        msg += f"; {twin_label(parity['twin'])}: {twin_summary(parity['twin'])}"
    return msg


def stage_profile(st: ConvertState) -> str:
    from kvexport.profile.run import profile_dir

    backend = "tensorrt" if st.cfg.target == "tensorrt" and st.engine_missing is None else "onnxruntime"
    prof = profile_dir(st.work, backend=backend, contexts=st.cfg.contexts, decode_steps=st.cfg.decode_steps,
                       baseline=st.cfg.baseline, seed=st.cfg.seed, repeats=st.cfg.repeats, progress=st.progress,
                       shown_as=st.out)
    base = {r["context"]: r for r in (prof["variants"].get("baseline") or {}).get("contexts") or []}
    parts = []
    for r in prof["variants"]["converted"]["contexts"]:
        b = base.get(r["context"])
        parts.append(f"{r['context']}: {r['decode_ms_p50']:.2f}" + (f" vs {b['decode_ms_p50']:.2f}" if b else ""))
    return f"{backend}: decode p50 ms " + ("converted vs baseline " if base else "") + "; ".join(parts)


def stage_report(st: ConvertState) -> str:
    from kvexport.report import write_report

    rep = write_report(st.work, shown_as=st.out)
    return f"report.html, report.md, {len(rep.get('plots') or {})} plots"


# ----------------------------------------------------------------------------- driver
def convert_json(st: ConvertState, records: list[StageRecord]) -> dict[str, Any]:
    import kvexport

    spec = st.spec.to_dict() if st.spec is not None else {}
    from kvexport.models.gguf import gguf_source

    source = gguf_source(st.model_path)
    name = Path(source["file"]).stem if source else st.model_path.name
    model = {"name": name, "path": str(st.model_path), "family": st.spec.family if st.spec else None,
             **{k: v for k, v in spec.items() if k not in ("rope",)}}
    if source:
        model["gguf"] = {**source, "path": st.cfg.model}  # dequantized to fp32: "the original" of every comparison
    if "parameters" in st.notes:
        model["parameters"] = st.notes["parameters"]
    out = {
        "format": "kvexport-convert",
        "version": 1,
        "kvexport_version": getattr(kvexport, "__version__", "?"),
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "settings": st.cfg.to_dict(),
        "model": model,
        "stages": [r.to_dict() for r in records],
        "reproduce": "kvexport convert --config DIR/convert.json --out NEW_DIR",
    }
    if "choice" in st.notes:
        out["choice"] = st.notes["choice"]
    if "distill" in st.notes:
        out["distill"] = st.notes["distill"]
    if "mla_ranks" in st.notes:
        out["mla"] = {"kv_ranks": st.notes["mla_ranks"], "rope_dim": st.cfg.rope_dim}
    if st.engine_missing:
        out["engine_missing"] = st.engine_missing
    return out


def run_convert(cfg: ConvertConfig, out: str | Path, force: bool = False, console=None) -> dict[str, Any]:
    """Run a whole conversion into ``out``; -> convert.json's content. Raises the failed stage's error
    (named), :class:`MissingBackend` after keeping the ONNX result for ``--target tensorrt
    --allow-partial`` without TensorRT."""
    from kvexport.manifest import atomic_output, check_out_dir

    cfg.check()
    if cfg.target == "tensorrt" and not cfg.allow_partial:  # before anything slow: loading the model takes a while
        problem = tensorrt_problem()
        if problem is not None:
            raise MissingBackend(f"--target tensorrt: {problem}; nothing was written (add --allow-partial to keep "
                                 "the ONNX result, or use --target onnx)")
    cfg, model_path, spec = resolve_settings(cfg)
    out = Path(out)
    check_out_dir(out, force)
    with atomic_output(out, force) as tmp:
        st = ConvertState(cfg=cfg, model_path=model_path, work=Path(tmp), spec=spec, out=out)
        stages = [
            Stage("load", lambda: stage_load(st)),
            Stage("choose", lambda: stage_choose(st), cfg.choose, "no --choose"),
            Stage("rewrite", lambda: stage_rewrite(st), cfg.uses_mla or cfg.choose,
                  "no MLA (eviction is applied in the export)"),
            Stage("distill", lambda: stage_distill(st), cfg.distills, "no --distill-teacher"),
            Stage("export", lambda: stage_export(st)),
            Stage("engine", lambda: stage_engine(st), cfg.target == "tensorrt", "--target onnx"),
            Stage("validate", lambda: stage_validate(st), cfg.validate, "--no-validate"),
            Stage("profile", lambda: stage_profile(st), cfg.profile, "--no-profile"),
        ]
        pipe = Pipeline(stages, console=console)
        st.progress = with_eta(pipe.step) if pipe.live else None

        def report() -> str:
            # convert.json first (the report reads it), then the report; convert.json is rewritten at the end
            _write_json(st.work / layout.CONVERT_JSON, convert_json(st, pipe.records))
            return stage_report(st)

        stages.append(Stage("report", report))
        # the settings are known now; later stages (profile, report) read them back from DIR
        _write_json(st.work / layout.CONVERT_JSON, convert_json(st, []))
        records = pipe.run()
        cj = convert_json(st, records)
        _write_json(st.work / layout.CONVERT_JSON, cj)
        layout.record_outputs(st.work)  # sha256 of convert.json, parity.json, profile-*.json, report.*
    if st.engine_missing:
        raise MissingBackend(f"--target tensorrt: {st.engine_missing}; kept the ONNX result in {out} "
                             "(--allow-partial), no engine was built")
    return cj


# ----------------------------------------------------------------------------- helpers
def release(st: ConvertState, *names: str) -> None:
    """Drop the state's references to models a later stage does not need, and give their memory back."""
    from kvexport.models.release import free_memory

    for n in names:
        setattr(st, n, None)
    free_memory()


_COUNTER = re.compile(r"(\d+)(?:-\d+)?/(\d+)")


def with_eta(show):
    """Wrap a ``progress(message)`` callback so that a counted sub-step (``"parity: prompt 3/7"``, ``"exporting
    decode.onnx (2/4)"``) also shows the time left at the pace of the phase's steps so far (a phase: the first
    word and the total; it restarts when the count does)."""
    state = {"phase": None, "t0": 0.0, "k0": 0}

    def progress(message: str) -> None:
        m = _COUNTER.search(message)
        if m is None:
            state["phase"] = None
            show(message)
            return
        k, n = int(m.group(1)), int(m.group(2))
        phase = (message.split(" ", 1)[0], n)  # "exporting", "parity:", "fidelity:", "converted:" ...
        now = time.perf_counter()
        if phase != state["phase"] or k <= state["k0"]:
            state.update(phase=phase, t0=now, k0=k)
            show(message)
            return
        per = (now - state["t0"]) / (k - state["k0"])
        show(f"{message} · ~{_duration(per * (n - k + 1))} left")

    return progress


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def _hf_config(model_path: Path) -> dict[str, Any]:
    try:
        return json.loads((model_path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks[0]) if len(set(ranks)) == 1 else ",".join(map(str, ranks))


def _dir_size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.exists() else 0


__all__ = ["run_convert", "resolve_settings", "ConvertState", "tensorrt_problem"]
