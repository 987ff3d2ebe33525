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
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kvexport.atomic import atomic_write_bytes
from kvexport.errors import BadArtifact, BadUsage, ParityFailure
from kvexport.export.spill import StoredRuns
from kvexport.export.twin import kept_sets, stacked_logits

PARITY_FILE = "parity.json"
#: default tolerances per export dtype: (atol, rtol) on logits, least greedy-token and kept-index agreement.
#: fp16 rounds differently in PyTorch and onnxruntime, so a near-tie argmax or top-k may flip now and then.
TOLERANCES = {"fp32": (1e-4, 1e-3, 1.0, 1.0), "fp16": (5e-2, 5e-2, 0.98, 0.95)}
#: a cache stored in a lossy format (int8 / fp8; fp16 / bf16 of an fp32 model): the two runtimes compute a row to
#: within float rounding, and a number that lands within that distance of a rounding boundary is stored one code
#: (or one float16 step) apart, after which both runs carry on from slightly different caches, and a press whose
#: candidates score within one code of each other keeps another of them. Measured on the student's int8 conversion
#: at convert's defaults (validate's 7 default prompts, 64 steps): codes never more than one step apart, greedy
#: tokens all equal, 28 of 36 kept sets equal, logits up to 0.14 apart (2.2 % of their range). The gates: greedy
#: tokens as fp16's, logits within 0.25, kept sets 75 % equal (tests/export/test_quantized_student.py checks the
#: codes themselves against the PyTorch cache).
LOSSY_CACHE_TOLERANCES = (2.5e-1, 5e-2, 0.98, 0.75)


def tolerances(settings: dict) -> tuple[float, float, float, float]:
    """(atol, rtol, least token agreement, least kept-index agreement) of an export's parity check: by its dtype
    (:data:`TOLERANCES`), widened to :data:`LOSSY_CACHE_TOLERANCES` when its cache format is lossy."""
    from kvexport.export.twin import is_lossy

    if is_lossy(settings.get("kv_dtype"), settings["dtype"]):
        return LOSSY_CACHE_TOLERANCES
    return TOLERANCES[settings["dtype"]]


# ----------------------------------------------------------------------------- polygraphy runners
def _runner_base():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


def _metadata(batch: int):
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    meta.add("input_ids", np.int64, (batch, -1))
    meta.add("attention_mask", np.int64, (batch, -1))
    meta.add("forced_tokens", np.int64, (batch, -1))
    return meta


def _outputs(res) -> OrderedDict:
    logits = np.stack([_np(res.prompt_logits)] + [_np(x) for x in res.step_logits], axis=1).astype(np.float32)
    return OrderedDict(logits=logits)  # (B, 1 + steps, V)


def _np(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _make_runner(name: str, batch: int, produce):
    """A Polygraphy runner (``BaseRunner`` subclass) named ``name``: ``infer`` calls ``produce(feed_dict)`` (a
    generation result with ``prompt_logits`` / ``step_logits``), keeps it as ``.last`` and returns its stacked
    logits (B, 1 + steps, V)."""
    Base = _runner_base()

    class _Runner(Base):
        def __init__(self):
            super().__init__(name=name)
            self.last = None

        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def get_input_metadata_impl(self):
            return _metadata(batch)

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            self.last = produce(feed_dict)
            self.inference_time = time.perf_counter() - t0
            return _outputs(self.last)

    return _Runner()


def _generator_runner(generator, name: str, batch: int, known=None):
    """A Polygraphy runner around any step generator (OrtGenerator, TrtGenerator): teacher-forced generation.
    known: results already computed (a dict or :class:`~kvexport.export.spill.StoredRuns`), by the bytes of
    (input_ids, attention_mask, forced tokens): a greedy run
    forced with its own tokens is the same run, so it is reused instead of recomputed. ``generator`` None: every
    feed must be in ``known`` (the generator's sessions were closed after computing them)."""
    known = known if known is not None else {}

    def produce(feed_dict):
        f = feed_dict["forced_tokens"]
        hit = known.get(_key(feed_dict["input_ids"], feed_dict["attention_mask"], f))
        if hit is None and generator is None:
            raise RuntimeError(f"{name}: no stored run for this feed and no generator to run it")
        return hit or generator.generate(feed_dict["input_ids"], feed_dict["attention_mask"], f.shape[1],
                                         forced_tokens=f, keep_logits=True)

    return _make_runner(name, batch, produce)


def _key(*arrays) -> bytes:
    return b"|".join(np.ascontiguousarray(x, dtype=np.int64).tobytes() for x in arrays)


def reference_kwargs(settings: dict, press) -> dict:
    """The :func:`kvexport.generation.generate` settings that match an export (press, window, chunk, capacity,
    the cache format ``kv_dtype``)."""
    if settings["mode"] == "dynamic":
        return {"press": None, "chunk": int(settings["chunk"])}
    # a quantized export is compared with the PyTorch cache in the same format (it writes the same codes)
    kvd = {"kv_dtype": settings["kv_dtype"]} if settings.get("kv_dtype") else {}
    if press is None:
        return {"press": None, "chunk": int(settings["chunk"]), "capacity": int(min(settings["capacities"])), **kvd}
    return {"press": press, "window": int(settings["window"]), "chunk": int(settings["chunk"]), **kvd}


def reference_generate(decoder, settings: dict, press, ids, mask, n_new: int, forced=None, tie_break=None):
    """The library path on unpadded prompts: :func:`kvexport.generation.generate` with the export's settings."""
    import torch

    from kvexport.generation import generate

    dev = next(decoder.parameters()).device
    t_ids = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=dev)
    t_mask = torch.as_tensor(np.asarray(mask), dtype=torch.long, device=dev)
    kw = reference_kwargs(settings, press)
    if kw["press"] is not None:
        L = decoder.spec.num_layers
        got = [int(b) for b in kw["press"].layer_budgets(L, int(t_mask.sum(-1).max()))]
        if got != [int(b) for b in settings["budgets"]]:
            raise BadArtifact(f"the press gives per-layer budgets {got}, the export was made with "
                              f"{settings['budgets']}; re-export with this kvexport version")
    return generate(decoder, t_ids, t_mask, max_new_tokens=n_new, forced_tokens=forced, keep_logits=True,
                    track_kept=True, tie_break=tie_break, **kw)


def make_runners(decoder, press, settings: dict, generator, batch: int, name: str = "onnxruntime",
                 rtol_ties: float = 1e-5, known=None):
    """(candidate runner, PyTorch reference runner) as Polygraphy runners; run the candidate first: the reference
    follows its choices at ties (:class:`~kvexport.export.ties.TieReferee`) and keeps the referee as ``.referee``."""
    from kvexport.export.ties import TieReferee

    cand = _generator_runner(generator, name, batch, known)

    def reference(feed_dict):
        seen = cand.last
        kept = dict(zip(seen.compaction_steps, seen.kept_positions, strict=True)) if seen is not None else {}
        referee = TieReferee(kept, rtol_ties)
        ref_runner.referee = referee
        return reference_generate(decoder, settings, press, feed_dict["input_ids"], feed_dict["attention_mask"],
                                  feed_dict["forced_tokens"].shape[1], forced=feed_dict["forced_tokens"],
                                  tie_break=referee)

    ref_runner = _make_runner("pytorch" if name == "onnxruntime" else f"pytorch[{name}]", batch, reference)
    ref_runner.referee = None
    return cand, ref_runner


# ----------------------------------------------------------------------------- prompts
def default_prompt_lengths(settings: dict) -> list[int]:
    """One token, around a chunk, below / at / above the budget, and longer than several chunks (lengths that
    are not multiples of the chunk, so the last chunk is padded)."""
    C = int(settings["chunk"])
    lengths = [1, max(1, C - 1), C + 1, 3 * C + 5]
    if settings.get("budgets"):
        b = int(max(settings["budgets"]))
        lengths += [max(1, b // 2), b, 2 * b + 3]
    cap = int(settings.get("max_positions") or 0)
    if settings.get("mode") == "static" and not settings.get("budgets"):
        cap = min(cap or 10**9, int(min(settings["capacities"])))
    if cap:
        lengths = [n for n in lengths if n < cap // 2] or [1]
    return sorted(set(lengths))


def make_batches(prompts, settings: dict, tokenizer, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """prompts: None (random ids of the default lengths), lengths, token-id lists or strings ->
    left-padded (input_ids, attention_mask) batches of the export's batch size."""
    B = int(settings["batch"])
    V = int(settings["vocab_size"])
    rng = np.random.default_rng(seed)
    if prompts is None:
        prompts = default_prompt_lengths(settings)
    seqs: list[list[int]] = []
    for p in prompts:
        if isinstance(p, (int, np.integer)):
            seqs.append(rng.integers(3, V, size=int(p)).tolist())
        elif isinstance(p, str):
            if not p.strip():
                raise BadUsage("a prompt is empty; give some text")
            if tokenizer is None:
                raise BadUsage("text prompts need the export's tokenizer/ directory; give token ids instead")
            seqs.append(list(tokenizer(p, add_special_tokens=True)["input_ids"]))
        else:
            seqs.append([int(x) for x in p])
        if not seqs[-1]:
            raise BadUsage("a prompt encodes to no tokens")
    batches = []
    for i in range(0, len(seqs), B):
        group = seqs[i : i + B]
        while len(group) < B:  # fill the static batch with shorter variants of the last prompt
            last = group[-1]
            group.append(last[: max(1, len(last) - len(group))])
        n = max(len(s) for s in group)
        ids = np.array([[0] * (n - len(s)) + s for s in group], np.int64)
        mask = np.array([[0] * (n - len(s)) + [1] * len(s) for s in group], np.int64)
        batches.append((ids, mask))
    return batches


def check_reference_source(manifest: dict, root=None) -> str:
    """The export's source model as the manifest records it (relative to the export ``root`` first, then the
    absolute path); one line when it is unknown or gone. Cheap: nothing is loaded."""
    s = manifest["settings"]
    src = s.get("source")
    rel = s.get("source_relative")
    if rel and root is not None and (Path(root) / rel).is_dir():
        src = str((Path(root) / rel).resolve())
    if src is None:
        raise BadUsage("this export was made from an in-memory model; pass the model to validate")
    if not Path(src).exists():
        raise BadArtifact(f"the export's source model {src} no longer exists; pass the model explicitly")
    return src


def load_reference_model(manifest: dict, model=None, root=None):
    """The PyTorch model of an export: ``model`` (HF dir / model / Decoder) or the manifest's source (its path
    relative to the export ``root`` first, then the absolute one), rewritten to MLA with the same settings, in
    the export's dtype."""
    from kvexport.export.exporter import resolve_decoder

    s = manifest["settings"]
    src = model if model is not None else check_reference_source(manifest, root)
    mla = s.get("mla")
    rank = rope = None
    equalize = False
    if mla is not None and mla.get("rewritten_by_export") and not _is_decoder_mla(src):
        rank, rope = mla["settings"].get("kv_rank"), mla["settings"].get("rope_dim")
        equalize = bool(mla["settings"].get("equalize_latent", False))
    dec, _, model_hash, _ = resolve_decoder(src, s["dtype"], rank, rope, equalize)
    if model is None and model_hash != manifest.get("model_hash"):
        raise BadArtifact(f"the source model {src} changed since the export (hash differs); re-export it")
    return dec


def _is_decoder_mla(src) -> bool:
    from kvexport.export.exporter import _is_mla
    from kvexport.models.decoder import Decoder

    return isinstance(src, Decoder) and _is_mla(src)


class _PairStats:
    """Running per-pair numbers over the prompts (reference vs candidate results)."""

    def __init__(self):
        self.abs: list[float] = []
        self.rel: list[float] = []
        self.tok_agree = self.tok_total = self.idx_agree = self.idx_total = 0
        self.poly_ok = True
        self.ties = 0
        self.rows: list[dict] = []

    def add(self, ref, cand, feed, poly_ok: bool, ties: int = 0) -> None:
        self.poly_ok = self.poly_ok and poly_ok
        a, b = stacked_logits(ref), stacked_logits(cand)
        err = np.abs(a - b).max(axis=(0, 2))
        scale = np.abs(a).max(axis=(0, 2))
        self.abs += err.tolist()
        self.rel += (err / np.maximum(scale, 1e-12)).tolist()
        agree = b.argmax(-1) == a.argmax(-1)  # the greedy choice after every step, candidate vs reference
        self.tok_agree += int(agree.sum())
        self.tok_total += agree.size
        ia, it, _ = kept_sets(ref, cand)
        self.idx_agree += ia
        self.idx_total += it
        self.ties += ties
        self.rows.append({"lengths": feed["attention_mask"].sum(-1).tolist(), "compactions": cand.compactions,
                          "max_abs_logit_error": float(err.max()), "token_agreement": float(agree.mean()),
                          "ties_followed": ties})

    def report(self, reference: str, candidate: str, steps: int, atol, rtol, min_tok, min_idx) -> dict:
        token_agreement = self.tok_agree / max(self.tok_total, 1)
        index_agreement = self.idx_agree / self.idx_total if self.idx_total else 1.0
        passed = bool(self.poly_ok and token_agreement >= min_tok and index_agreement >= min_idx)
        return {
            "reference": reference, "candidate": candidate,
            "max_abs_logit_error": float(max(self.abs)) if self.abs else 0.0,
            "max_rel_logit_error": float(max(self.rel)) if self.rel else 0.0,
            "token_agreement": token_agreement, "index_agreement": index_agreement, "steps": int(steps),
            "passed": passed, "polygraphy_passed": self.poly_ok,
            "tolerances": {"atol": atol, "rtol": rtol, "token_agreement": min_tok, "index_agreement": min_idx,
                           "compare": "polygraphy SimpleCompareFunc (elementwise) on stacked per-step logits"},
            "per_step_max_abs_logit_error": self.abs, "per_step_max_rel_logit_error": self.rel,
            "prompts": self.rows, "compared_kept_sets": self.idx_total, "ties_followed": self.ties,
        }


def twin_section(decoder, settings: dict, tokenizer, eval_data=None, fidelity_settings=None, say=None) -> dict:
    """A lossy cache (``settings["kv_dtype"]``) against its fp32 twin: the PyTorch library path with the export's
    model, press, budget, window and chunk, run once with ``kv_dtype=fp32`` and once in the export's format, on the
    fidelity check's held-out windows (:mod:`kvexport.export.twin`). -> parity.json's ``twin`` section."""
    from kvexport.export.exporter import press_from_dict
    from kvexport.export.fidelity import FidelitySettings, _windows, default_prefix, eval_stream
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
                       window=int(kw.get("window") or settings.get("window") or 32), chunk=kw["chunk"],
                       capacity=kw.get("capacity"), batch=8, progress=say)
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
    agreement must be 1.0 in fp32, >= 0.98 / 0.95 in fp16 or with a lossy cache format (:func:`tolerances`).
    backend "tensorrt" adds the pairs ``onnxruntime~tensorrt`` and ``pytorch~tensorrt`` (engines from
    ``engines``, default ``DIR-tensorrt``; ``trt_generator``: an already opened
    :class:`~kvexport.tensorrt.generator.TrtGenerator`). ``candidate``: validate this step generator (same API as
    :class:`~kvexport.runtime.onnxruntime.OrtGenerator`) instead of onnxruntime's. Every pair goes through Polygraphy.
    fidelity: also compare with the original model (``original``: its HF directory; default: the one the
    manifest names) on ``eval_data`` (a text file; default: the bundled held-out text); ``fidelity_settings``:
    a :class:`~kvexport.export.fidelity.FidelitySettings`. ``min_agreement`` / ``max_ppl_increase`` gate it.
    A quantized export's reference is the PyTorch cache in the export's ``kv_dtype``; with fidelity on, a lossy
    format (:func:`~kvexport.export.twin.is_lossy`) also gets ``twin``: that cache against its fp32 twin
    (:func:`twin_section`).
    progress: ``progress(message)`` at each sub-step.
    Raises :class:`ParityFailure` (exit 6) when ``raise_on_failure`` and a tolerance or a gate fails.
    """
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    from kvexport.export.exporter import press_from_dict
    from kvexport.export.ties import TIE_RTOL
    from kvexport.export.twin import is_lossy
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
    d_atol, d_rtol, min_tok, min_idx = tolerances(s)
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
    tie_rtol = TIE_RTOL.get(s["dtype"], 1e-5)
    cand_name = getattr(gen, "backend", "onnxruntime")
    providers_used = list(gen.providers)
    known = StoredRuns("kvexport-validate-")  # the candidate's logits wait on disk for the reference's
    feeds = []
    for k, (ids, mask) in enumerate(batches):
        say(f"parity: prompt {k + 1}/{len(batches)} ({int(mask.sum(-1).max())} tokens), {cand_name}")
        # the export decodes greedily; the reference is then fed the same tokens, step by step
        free = gen.generate(ids, mask, int(steps) + 1, keep_logits=True)
        forced = np.asarray(free.tokens, np.int64)
        known[_key(ids, mask, forced)] = free
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
    stats = {n: _PairStats() for n in names}
    from polygraphy.logger import G_LOGGER

    old = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.ERROR
    try:
        for k, feed in enumerate(feeds):
            say(f"parity: prompt {k + 1}/{len(feeds)} ({int(feed['attention_mask'].sum(-1).max())} tokens), "
                "reference")
            results = Comparator.run(runners, data_loader=[feed])
            func = SimpleCompareFunc(atol=atol, rtol=rtol)
            for n, (i, j) in names.items():
                acc = Comparator.compare_accuracy(results, compare_func=func, comparisons=[(i, j)])
                referee = getattr(runners[i], "referee", None)
                stats[n].add(runners[i].last, runners[j].last, feed, bool(acc),
                             ties=referee.accepted if referee is not None else 0)
    finally:
        G_LOGGER.module_severity = old
    twin = None
    if fidelity and is_lossy(s.get("kv_dtype"), s["dtype"]):
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
                             labels.get(c_name, c_name), steps, atol, rtol, min_tok, min_idx)
    report = {"export": str(Path(path).resolve()),
              "settings": {k: s[k] for k in ("mode", "batch", "chunk", "window", "budgets", "press", "mla", "dtype",
                                             "ops")},
              "pairs": pairs}
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
