# SPDX-License-Identifier: Apache-2.0
"""Parity of an export directory against the PyTorch model it came from (same press, budgets, MLA).

For each prompt batch the PyTorch reference (:func:`kvexport.export.reference.torch_generate`) runs
greedily first; both backends are then driven with those tokens (teacher forcing), so every step's
logits are comparable even after a disagreement. Per step we record the largest absolute logit error
and the normwise relative error ``max|a - b| / max|b|``; greedy-token agreement is the fraction of
steps whose onnxruntime argmax equals PyTorch's token; index agreement is the fraction of
(compaction, layer, row, head) whose kept positions are the same set.

The numeric verdict is Polygraphy's: both backends are wrapped as Polygraphy runners (``BaseRunner``
subclasses) and ``Comparator.compare_accuracy`` with ``SimpleCompareFunc(atol, rtol)`` compares the
stacked logits of every step. ``passed`` = Polygraphy passed and token and index agreement reach their
thresholds (1.0 in fp32).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kvexport.atomic import atomic_write_bytes
from kvexport.errors import BadArtifact, BadUsage, ParityFailure

PARITY_FILE = "parity.json"
#: default tolerances per export dtype: (atol, rtol) on logits, least greedy-token and kept-index agreement.
#: fp16 rounds differently in PyTorch and onnxruntime, so a near-tie argmax or top-k may flip now and then.
TOLERANCES = {"fp32": (1e-4, 1e-3, 1.0, 1.0), "fp16": (5e-2, 5e-2, 0.98, 0.95)}


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
    logits = np.stack([res.prompt_logits] + res.step_logits, axis=1).astype(np.float32)  # (B, 1 + steps, V)
    return OrderedDict(logits=logits)


def _key(ids, mask, forced) -> bytes:
    return b"|".join(np.ascontiguousarray(x, dtype=np.int64).tobytes() for x in (ids, mask, forced))


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


def _generator_runner(generator, name: str, batch: int):
    """A Polygraphy runner around any step generator (OrtGenerator, TrtGenerator): teacher-forced generation."""

    def produce(feed_dict):
        f = feed_dict["forced_tokens"]
        return generator.generate(feed_dict["input_ids"], feed_dict["attention_mask"], f.shape[1],
                                  forced_tokens=f, keep_logits=True)

    return _make_runner(name, batch, produce)


def make_runners(decoder, press, settings: dict, generator, batch: int, known: dict | None = None):
    """(PyTorch runner, onnxruntime runner) as Polygraphy runners; each keeps its last full result.

    known: PyTorch results already computed, by :func:`_key` of (input_ids, attention_mask, forced tokens);
    a greedy run forced with its own tokens is the same run, so it is reused instead of recomputed."""
    known = known if known is not None else {}
    from kvexport.export.reference import torch_generate

    def reference(feed_dict):  # the PyTorch reference: a generation per feed dict
        f = feed_dict["forced_tokens"]
        key = _key(feed_dict["input_ids"], feed_dict["attention_mask"], f)
        return known.get(key) or torch_generate(decoder, settings, feed_dict["input_ids"], feed_dict["attention_mask"],
                                                f.shape[1], forced_tokens=f, press=press)

    return _make_runner("pytorch", batch, reference), _generator_runner(generator, "onnxruntime", batch)


# ----------------------------------------------------------------------------- prompts
def default_prompt_lengths(settings: dict) -> list[int]:
    """Below, at and above the budget, and longer than several chunks."""
    C = int(settings["chunk"])
    if settings.get("budgets"):
        b = int(max(settings["budgets"]))
        lengths = [max(1, b // 2), b, 2 * b + 3, 3 * C + 5]
    else:
        lengths = [max(1, C // 2), C, 3 * C + 5]
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


# ----------------------------------------------------------------------------- metrics
def _kept_agreement(ref, ort) -> tuple[int, int]:
    agree = total = 0
    if ref.compaction_steps != ort.compaction_steps:
        n = max(len(ref.compaction_steps), len(ort.compaction_steps))
        return 0, max(n, 1)
    for kr, ko in zip(ref.kept_positions, ort.kept_positions, strict=False):
        for a, b in zip(kr, ko, strict=False):  # per layer (B, Hc, S)
            for r in range(a.shape[0]):
                for h in range(a.shape[1]):
                    x, y = a[r, h], b[r, h]
                    agree += int(np.array_equal(np.sort(x[x >= 0]), np.sort(y[y >= 0])))
                    total += 1
    return agree, total


def load_reference_model(manifest: dict, model=None, root=None):
    """The PyTorch model of an export: ``model`` (HF dir / model / Decoder) or the manifest's source (its path
    relative to the export ``root`` first, then the absolute one), rewritten to MLA with the same settings, in
    the export's dtype."""
    from kvexport.export.exporter import resolve_decoder

    s = manifest["settings"]
    src = model if model is not None else s.get("source")
    rel = s.get("source_relative")
    if model is None and rel and root is not None and (Path(root) / rel).is_dir():
        src = str((Path(root) / rel).resolve())
    if src is None:
        raise BadUsage("this export was made from an in-memory model; pass the model to validate")
    if isinstance(src, str) and not Path(src).exists():
        raise BadArtifact(f"the export's source model {src} no longer exists; pass the model explicitly")
    mla = s.get("mla")
    rank = rope = None
    if mla is not None and mla.get("rewritten_by_export") and not _is_decoder_mla(src):
        rank, rope = mla["settings"].get("kv_rank"), mla["settings"].get("rope_dim")
    dec, _, model_hash, _ = resolve_decoder(src, s["dtype"], rank, rope)
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
        self.rows: list[dict] = []

    def add(self, ref, cand, feed, poly_ok: bool) -> None:
        self.poly_ok = self.poly_ok and poly_ok
        a = np.stack([ref.prompt_logits] + ref.step_logits, 1).astype(np.float64)
        b = np.stack([cand.prompt_logits] + cand.step_logits, 1).astype(np.float64)
        err = np.abs(a - b).max(axis=(0, 2))
        scale = np.abs(a).max(axis=(0, 2))
        self.abs += err.tolist()
        self.rel += (err / np.maximum(scale, 1e-12)).tolist()
        argmax = b[:, :-1].argmax(-1)  # the token chosen after each step (last step chooses nothing new)
        forced = feed["forced_tokens"]
        agree = argmax == forced[:, : argmax.shape[1]]
        self.tok_agree += int(agree.sum())
        self.tok_total += agree.size
        ia, it = _kept_agreement(ref, cand)
        self.idx_agree += ia
        self.idx_total += it
        self.rows.append({"lengths": feed["attention_mask"].sum(-1).tolist(), "compactions": cand.compactions,
                          "max_abs_logit_error": float(err.max()), "token_agreement": float(agree.mean())})

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
            "prompts": self.rows, "compared_kept_sets": self.idx_total,
        }


def validate(path, prompts=None, steps: int = 64, atol: float | None = None, rtol: float | None = None,
             model=None, providers=None, write: bool = True, raise_on_failure: bool = False,
             backend: str = "onnxruntime", engines=None, trt_generator=None) -> dict:
    """Compare an export with its PyTorch model; write ``DIR/parity.json``; return the report dict.

    prompts: None (random token ids at lengths below/at/above the budget and over several chunks),
    a list of lengths, token-id lists or strings. steps: decode steps per prompt (>= 1).
    atol/rtol: logit tolerances (default by dtype: fp32 1e-4 / 1e-3, fp16 5e-2 / 5e-2); token / index
    agreement must be 1.0 in fp32, >= 0.98 / 0.95 in fp16 (:data:`TOLERANCES`).
    backend "tensorrt" adds the pairs ``onnxruntime~tensorrt`` and ``pytorch~tensorrt`` (engines from
    ``engines``, default ``DIR-tensorrt``; ``trt_generator``: an already opened
    :class:`~kvexport.tensorrt.generator.TrtGenerator`). Every pair goes through Polygraphy's comparator.
    Raises :class:`ParityFailure` (exit 6) when ``raise_on_failure`` and a tolerance fails.
    """
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    from kvexport.export.exporter import press_from_dict
    from kvexport.export.runtime import OrtGenerator

    if int(steps) < 1:
        raise BadUsage(f"--steps {steps} must be >= 1")
    if backend not in ("onnxruntime", "tensorrt"):
        raise BadUsage(f"--backend {backend!r} is not one of: onnxruntime, tensorrt")
    if backend == "tensorrt" and trt_generator is None:
        from kvexport.tensorrt.generator import TrtGenerator

        trt_generator = TrtGenerator(path, engines=engines)  # MissingBackend first when TensorRT / a GPU is absent
    gen = OrtGenerator(path, providers=providers)
    s = gen.settings
    d_atol, d_rtol, min_tok, min_idx = TOLERANCES[s["dtype"]]
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)
    press = press_from_dict(s["press"])
    decoder = load_reference_model(gen.manifest, model, root=path)
    tokenizer = None
    if s.get("tokenizer") and prompts is not None and any(isinstance(p, str) for p in prompts):
        from kvexport.models.loading import load_tokenizer

        tokenizer = load_tokenizer(Path(path) / s["tokenizer"])
    batches = make_batches(prompts, s, tokenizer)
    from kvexport.export.reference import torch_generate

    feeds = []
    known = {}
    for ids, mask in batches:
        free = torch_generate(decoder, s, ids, mask, int(steps) + 1, press=press)
        feeds.append(OrderedDict(input_ids=ids, attention_mask=mask, forced_tokens=free.tokens))
        known[_key(ids, mask, free.tokens)] = free
    torch_runner, ort_runner = make_runners(decoder, press, s, gen, int(s["batch"]), known)
    runners = [torch_runner, ort_runner]
    names = {"pytorch~onnxruntime": (0, 1)}
    if trt_generator is not None:
        runners.append(_generator_runner(trt_generator, "tensorrt", int(s["batch"])))
        names.update({"onnxruntime~tensorrt": (1, 2), "pytorch~tensorrt": (0, 2)})
    stats = {n: _PairStats() for n in names}
    from polygraphy.logger import G_LOGGER

    old = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.ERROR
    try:
        for feed in feeds:
            results = Comparator.run(runners, data_loader=[feed])
            func = SimpleCompareFunc(atol=atol, rtol=rtol)
            for n, (i, j) in names.items():
                acc = Comparator.compare_accuracy(results, compare_func=func, comparisons=[(i, j)])
                stats[n].add(runners[i].last, runners[j].last, feed, bool(acc))
    finally:
        G_LOGGER.module_severity = old
    cand = {"onnxruntime": f"onnxruntime:{gen.providers[0]}", "tensorrt": "tensorrt", "pytorch": "pytorch"}
    pairs = {}
    for n, st in stats.items():
        ref_name, cand_name = n.split("~")
        pairs[n] = st.report(ref_name, cand[cand_name], steps, atol, rtol, min_tok, min_idx)
    report = {"export": str(Path(path).resolve()), "settings": {k: s[k] for k in ("mode", "batch", "chunk", "window",
                                                                                  "budgets", "press", "mla", "dtype",
                                                                                  "ops")},
              "pairs": pairs}
    if write:
        atomic_write_bytes(Path(path) / PARITY_FILE, (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
    failed = [n for n, p in pairs.items() if not p["passed"]]
    if raise_on_failure and failed:
        p = pairs[failed[0]]
        raise ParityFailure(f"{path}: {failed[0]}: max abs logit error {p['max_abs_logit_error']:.3g} (atol {atol:g}), "
                            f"token agreement {p['token_agreement']:.3f}, index agreement {p['index_agreement']:.3f}; "
                            f"see {PARITY_FILE}")
    return report
