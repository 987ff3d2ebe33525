# SPDX-License-Identifier: Apache-2.0
"""Is an export what it claims to be? Two comparisons, each against an independent reference.

1. **Parity** with kvexport's PyTorch library path as a user calls it: :func:`kvexport.generation.generate`
   with the export's press, budget, window and chunk, on the *unpadded* prompts (the graphs see padded static
   chunks; the library never pads). The export decodes greedily; the reference is then driven with those
   tokens (teacher forcing), so every step's logits compare even after a disagreement. Per
   step: largest absolute logit error and normwise relative error ``max|a - b| / max|b|``; greedy-token
   agreement = fraction of steps whose argmaxes are equal; index agreement = fraction of
   (compaction, layer, row, head) whose kept positions are the same set. Where the reference's own scores call
   two candidates tied (:mod:`kvexport.export.ties`), the reference follows the export's choice and the tie is
   counted, not failed. The numeric verdict is Polygraphy's: both sides are Polygraphy runners and
   ``Comparator.compare_accuracy`` with ``SimpleCompareFunc(atol, rtol)`` compares the stacked logits.
   ``passed`` = Polygraphy passed and token and index agreement reach their thresholds (1.0 in fp32).
2. **Fidelity** against the original, uncompressed model (:mod:`kvexport.export.fidelity`): what the MLA rank
   and the budget cost, as numbers (agreement, KL, perplexity, recall).

Export parity gates ``raise_on_failure`` (exit 6); fidelity gates it only where asked (``min_agreement``,
``max_ppl_increase``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kvexport.atomic import atomic_write_bytes
from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.errors import BadUsage, ParityFailure
from kvexport.export.parity import PairStats, ParityRule, feed_key, make_batches, make_runners
from kvexport.export.reference import check_reference_source, load_reference_model, reference_kwargs
from kvexport.export.spill import StoredRuns

PARITY_FILE = "parity.json"


def twin_section(decoder, settings: dict, tokenizer, eval_data=None, fidelity_settings=None, say=None) -> dict:
    """A lossy cache (``settings["kv_dtype"]``) against its fp32 twin: the PyTorch library path with the export's
    model, press, budget, window and chunk, run once with ``kv_dtype=fp32`` and once in the export's format, on the
    fidelity check's held-out windows (:mod:`kvexport.export.twin`). -> parity.json's ``twin`` section."""
    from kvexport.export.fidelity import FidelitySettings, _windows, default_prefix, eval_stream
    from kvexport.export.source import press_from_dict
    from kvexport.export.twin import twin_compare

    fs = fidelity_settings or FidelitySettings()
    P = fs.prefix or default_prefix(settings, fs.scored)
    stream, desc = eval_stream(tokenizer, eval_data, fs.seed, int(settings["vocab_size"]), P + fs.scored + 1)
    wins = _windows(stream, fs.sequences, P + fs.scored + 1)
    kw = reference_kwargs(settings, None)
    kw.pop("kv_dtype", None)
    pd = settings["press"]
    factory = (lambda: press_from_dict(pd)) if pd is not None and settings["mode"] != "dynamic" else None
    out = twin_compare(decoder, wins, P, fs.scored, settings["kv_dtype"], factory,
                       window=int(kw.get("window") or settings.get("window") or DEFAULT_WINDOW), chunk=kw["chunk"],
                       capacity=kw.get("capacity"), batch=1, progress=say)  # one window's transients at a time
    out["eval_data"] = desc
    out["label"] = f"{settings['kv_dtype']} cache vs its fp32 twin"
    return out


def validate(path, prompts=None, steps: int = 64, atol: float | None = None, rtol: float | None = None,
             model=None, providers=None, write: bool = True, raise_on_failure: bool = False,
             backend: str = "onnxruntime", engines=None, trt_generator=None, candidate=None,
             fidelity: bool = True, eval_data=None, min_agreement: float | None = None,
             max_ppl_increase: float | None = None, original=None, fidelity_settings=None,
             progress=None) -> dict:
    """Compare an export with kvexport's PyTorch library path and with the original model; write
    ``DIR/parity.json``; return the report dict.

    prompts: None (random token ids: one token, around a chunk, below/at/above the budget, several chunks),
    a list of lengths, token-id lists or strings. steps: decode steps per prompt (>= 1).
    atol/rtol: logit tolerances (default by dtype: fp32 1e-4 / 1e-3, fp16 5e-2 / 5e-2); token / index
    agreement must be 1.0 in fp32, >= 0.98 / 0.95 in fp16 or with a lossy cache format (:class:`~kvexport.export.parity.ParityRule`).
    backend "tensorrt" adds the pairs ``onnxruntime~tensorrt`` and ``pytorch~tensorrt`` (engines from
    ``engines``, default ``DIR-tensorrt``; ``trt_generator``: an already opened
    :class:`~kvexport.tensorrt.generator.TrtGenerator`). ``candidate``: validate this step generator (same API as
    :class:`~kvexport.runtime.onnxruntime.OrtGenerator`) instead of onnxruntime's. Every pair goes through Polygraphy.
    fidelity: also compare with the original model (``original``: its HF directory; default: the one the
    manifest names) on ``eval_data`` (a text file; default: the bundled held-out text); ``fidelity_settings``:
    a :class:`~kvexport.export.fidelity.FidelitySettings`. ``min_agreement`` / ``max_ppl_increase`` gate it.
    A quantized export's reference is the PyTorch cache in the export's ``kv_dtype``; with fidelity on, a lossy
    format (:func:`~kvexport.export.twin.is_lossy`) also gets ``twin``: that cache against its fp32 twin
    (:func:`twin_section`). A weight-quantized export's reference holds the export's int4 / fp16 weights
    (:func:`~kvexport.export.reference.load_reference_model`), while fidelity measures it against the original
    (fp32) model like any compression; parity.json's ``tolerances.rule`` says which tolerances applied and why.
    progress: ``progress(message)`` at each sub-step.
    Raises :class:`ParityFailure` (exit 6) when ``raise_on_failure`` and a tolerance or a gate fails.
    """
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    from kvexport.export.source import press_from_dict
    from kvexport.manifest import ONNX_EXPORT as KIND
    from kvexport.manifest import verify_manifest
    from kvexport.models.release import free_memory
    from kvexport.runtime.onnxruntime import open_onnxruntime

    say = progress or (lambda msg: None)
    if int(steps) < 1:
        raise BadUsage(f"--steps {steps} must be >= 1")
    if backend not in ("onnxruntime", "tensorrt"):
        raise BadUsage(f"--backend {backend!r} is not one of: onnxruntime, tensorrt")
    for name, v, lo, hi in (("--min-agreement", min_agreement, 0.0, 1.0), ("--max-ppl-increase", max_ppl_increase,
                                                                           0.0, float("inf"))):
        if v is not None and not (lo <= float(v) <= hi):
            raise BadUsage(f"{name} {v} is outside [{lo:g}, {hi:g}]")
    if (min_agreement is not None or max_ppl_increase is not None) and not fidelity:
        raise BadUsage("--min-agreement / --max-ppl-increase gate the fidelity section; drop --no-fidelity")
    if backend == "tensorrt" and trt_generator is None:
        from kvexport.tensorrt.generator import TrtGenerator

        trt_generator = TrtGenerator(path, engines=engines)  # MissingBackend first when TensorRT / a GPU is absent
    # memory: one model at a time. The candidate's sessions run every prompt first (parity and fidelity) and are
    # closed; then the PyTorch reference is loaded alone (parity, the fp32 twin) and released; then the original
    # model alone (fidelity). The export's weights and a PyTorch model's are never resident together.
    manifest = candidate.manifest if candidate is not None else verify_manifest(path, KIND)
    s = manifest["settings"]
    held = ParityRule(s)  # lossy cache / weights: the gates, the atol's share, the ties' tolerance, the twin
    d_atol, d_rtol, min_tok, min_idx = held.tolerances
    rule = held.text + ("" if atol is None and rtol is None else "; atol / rtol as given")
    atol_share = held.atol_share if atol is None else 0.0
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)
    press = press_from_dict(s["press"])
    if model is None:  # a missing or changed source fails now, not after the candidate's runs
        check_reference_source(manifest, root=path)
    say(f"opening the {'candidate' if candidate is not None else 'onnxruntime sessions'}")
    gen = candidate if candidate is not None else open_onnxruntime(path, providers=providers)
    s = gen.settings
    tokenizer = None
    if s.get("tokenizer"):
        from kvexport.models.loading import load_tokenizer

        tokenizer = load_tokenizer(Path(path) / s["tokenizer"])
    if prompts is not None and any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise BadUsage("text prompts need the export's tokenizer/ directory; give token ids instead")
    batches = make_batches(prompts, s, tokenizer)
    B = int(s["batch"])
    tie_rtol = held.tie_rtol
    cand_name = getattr(gen, "backend", "onnxruntime")
    providers_used = list(gen.providers)
    known = StoredRuns("kvexport-validate-")  # the candidate's logits wait on disk for the reference's
    feeds = []
    for k, (ids, mask) in enumerate(batches):
        say(f"parity: prompt {k + 1}/{len(batches)} ({int(mask.sum(-1).max())} tokens), {cand_name}")
        # the export decodes greedily; the reference is then fed the same tokens, step by step
        free = gen.generate(ids, mask, int(steps) + 1, keep_logits=True)
        forced = np.asarray(free.tokens, np.int64)
        known[feed_key(ids, mask, forced)] = free
        feeds.append(OrderedDict(input_ids=ids, attention_mask=mask, forced_tokens=forced))
    fid = None
    if fidelity:
        from kvexport.export.fidelity import FidelityRun, FidelitySettings

        fid = FidelityRun(path, s, tokenizer, original=original, eval_data=eval_data,
                          fidelity=fidelity_settings or FidelitySettings(), progress=say)
        fid.candidate(gen)
    if candidate is None:  # ours: its runs are stored, its weights leave before the reference's arrive
        gen.close()
    gen = None
    free_memory()
    say("loading the PyTorch reference")
    decoder = load_reference_model(manifest, model, root=path)
    cand_runner, ref_runner = make_runners(decoder, press, s, None, B, cand_name, tie_rtol, known)
    runners = [cand_runner, ref_runner]
    names = {f"pytorch~{cand_name}": (1, 0)}
    if trt_generator is not None:
        trt_runner, trt_ref = make_runners(decoder, press, s, trt_generator, B, "tensorrt", tie_rtol)
        runners += [trt_runner, trt_ref]
        names.update({"pytorch~tensorrt": (3, 2), "onnxruntime~tensorrt": (0, 2)})
    stats = {n: PairStats(held.lossy_weights is not None, atol, atol_share) for n in names}
    from polygraphy.logger import G_LOGGER

    old = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.ERROR
    try:
        for k, feed in enumerate(feeds):
            say(f"parity: prompt {k + 1}/{len(feeds)} ({int(feed['attention_mask'].sum(-1).max())} tokens), "
                "reference")
            results = Comparator.run(runners, data_loader=[feed])
            for n, (i, j) in names.items():
                func = SimpleCompareFunc(atol=stats[n].prompt_atol(runners[i].last), rtol=rtol)
                acc = Comparator.compare_accuracy(results, compare_func=func, comparisons=[(i, j)])
                referee = getattr(runners[i], "referee", None)
                stats[n].add(runners[i].last, runners[j].last, feed, bool(acc),
                             ties=referee.accepted if referee is not None else 0)
    finally:
        G_LOGGER.module_severity = old
    twin = None
    if fidelity and held.lossy_cache:
        twin = twin_section(decoder, s, tokenizer, eval_data, fidelity_settings, say)
    # the reference (and the runners holding it) are done: free them before fidelity loads the original model
    known.close()
    decoder = runners = cand_runner = ref_runner = known = trt_runner = trt_ref = None  # noqa: F841
    free_memory()
    labels = {"onnxruntime": f"onnxruntime:{providers_used[0]}", "tensorrt": "tensorrt", "pytorch": "pytorch"}
    pairs = {}
    for n, st in stats.items():
        ref_name, c_name = n.split("~")
        pairs[n] = st.report("kvexport.generation.generate (PyTorch, unpadded)" if ref_name == "pytorch" else ref_name,
                             labels.get(c_name, c_name), steps, st.atol, rtol, min_tok, min_idx)
    report = {"export": str(Path(path).resolve()),
              "settings": {k: s[k] for k in ("mode", "batch", "chunk", "window", "budgets", "press", "mla", "dtype",
                                             "ops")},
              "pairs": pairs}
    w = s.get("weights")
    report["settings"]["weights"] = w["format"] if w else "fp32"
    report["tolerances"] = {"rule": rule, "atol": atol, "rtol": rtol, "token_agreement": min_tok,
                            "index_agreement": min_idx}
    if w:  # what the reference is: the model's own weights through the block rule, not the graphs' tensors
        report["weights"] = {"format": w["format"], "reference": "kvexport.quant.reference.quantized_decoder: the "
                             "source model's weights with the export's block rule, matched by sha256",
                             "quantized": len(w["tensors"]), "kept": len(w["skipped"]),
                             **{k: w[k] for k in ("block_size", "symmetric", "accuracy_level") if k in w}}
    if fid is not None:
        fid.original()
        report["fidelity"] = fid.report(min_agreement, max_ppl_increase)
    if twin is not None:
        report["twin"] = twin
    if write:
        atomic_write_bytes(Path(path) / PARITY_FILE, (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
    failed = [n for n, p in pairs.items() if not p["passed"]]
    if raise_on_failure and failed:
        p = pairs[failed[0]]
        raise ParityFailure(f"{path}: {failed[0]}: max abs logit error {p['max_abs_logit_error']:.3g} (atol {atol:g}), "
                            f"token agreement {p['token_agreement']:.3f}, index agreement {p['index_agreement']:.3f}; "
                            f"see {PARITY_FILE}")
    gates = (report.get("fidelity") or {}).get("gates") or {}
    if raise_on_failure and gates.get("passed") is False:
        raise ParityFailure(f"{path}: fidelity against the original model: {gates['failed']}; see {PARITY_FILE}")
    return report
