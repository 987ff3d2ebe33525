# SPDX-License-Identifier: Apache-2.0
"""Parity of an export with the PyTorch reference (:mod:`kvexport.export.reference`): the prompts it is checked on,
both sides as Polygraphy runners (the candidate decodes greedily, the reference is teacher-forced with its tokens and
follows it at score ties: :mod:`kvexport.export.ties`), the tolerances by dtype and cache format, and the running
figures of a pair (logit errors, token and kept-index agreement)."""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from kvexport.errors import BadUsage
from kvexport.export.reference import reference_generate
from kvexport.export.twin import kept_sets, stacked_logits

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
#: ... whose absolute logit tolerance grows with the model's logits: at least this share of the largest |logit| the
#: reference gives for the prompt. The two runtimes may store a value at a rounding boundary one code apart, and
#: what that moves grows with the depth and the logits' scale: on the 4-layer student (logits within ±14) the
#: runtimes differ by < 0.03; on SmolLM2-135M (30 layers, logits to ±33) by up to 0.44 with every greedy token and
#: kept set equal (2026-12-06).
LOSSY_CACHE_ATOL_SHARE = 2e-2


#: int4 weights that onnxruntime multiplies with int8 activations (MatMulNBits at accuracy level 4, and int4-qdq,
#: which it fuses into that op): the reference has the same weights but float32 activations, so every MatMul's
#: output is off by the activations' rounding, and a greedy token or a kept candidate at a near tie may flip.
#: Measured on the student (SnapKV 96, window 16, chunk 32; validate's 7 default prompts, 64 steps): int4 logits
#: up to 0.22 apart (3.1 % of their range), greedy tokens 99.6 % equal, 86 % of the kept sets equal; int4-qdq 0.24,
#: 99.6 %, 78 %; at accuracy level 0 (float32 activations) 1.1e-5 and everything equal. A kept set counts as equal
#: only when every one of its tokens is, so a long budget over many layers rarely keeps every set equal (SmolLM2,
#: docs/quantized.md), and a random tiny model's near-uniform logits flip greedy tokens at near ties. The gates
#: (:class:`PairStats` ``lossy_weights``): logits as a lossy cache's (a wrong block or scale moves them by a third of
#: their range: tests/quant), greedy tokens 98 % equal counting near ties (the reference's margin within atol), kept
#: sets overlapping by 90 % on average.
LOSSY_WEIGHTS_TOLERANCES = (2.5e-1, 5e-2, 0.98, 0.9)


class ParityRule:
    """How an export is held to its PyTorch reference, decided once from its manifest settings: whether its cache
    format is lossy (:func:`kvexport.export.twin.is_lossy`) and whether onnxruntime's arithmetic on its weights is
    (:func:`kvexport.quant.weights.lossy_arithmetic`), and everything validate takes from that: the gates
    (:attr:`tolerances`), the logit atol's share of the prompt's logits (:attr:`atol_share`), the score tolerance of
    ties (:attr:`tie_rtol`), whether the cache gets its fp32 twin (:attr:`lossy_cache`) and the rule in words
    (:attr:`text`, parity.json's ``tolerances.rule``)."""

    def __init__(self, settings: dict):
        from kvexport.export.twin import is_lossy
        from kvexport.quant.weights import lossy_arithmetic

        self.dtype = settings["dtype"]
        self.kv_dtype = settings.get("kv_dtype")
        self.weights = (settings.get("weights") or {}).get("format")
        #: the cache is stored in a lossy format (int8 / fp8; fp16 / bf16 of an fp32 model)
        self.lossy_cache = bool(is_lossy(self.kv_dtype, self.dtype))
        #: why onnxruntime's arithmetic on the int4 weights is lossy (int8 activations), or None
        self.lossy_weights = lossy_arithmetic(settings.get("weights"))

    @property
    def tolerances(self) -> tuple[float, float, float, float]:
        """(atol, rtol, least token agreement, least kept-index agreement): by the dtype (:data:`TOLERANCES`),
        widened to :data:`LOSSY_CACHE_TOLERANCES` for a lossy cache and to :data:`LOSSY_WEIGHTS_TOLERANCES` for
        lossy weight arithmetic (both: the wider of each). fp16 weights and int4 at accuracy level 0 keep the
        dtype's: the reference holds the same weights and both sides compute in float32."""
        rows = [LOSSY_CACHE_TOLERANCES] * self.lossy_cache + [LOSSY_WEIGHTS_TOLERANCES] * bool(self.lossy_weights)
        if not rows:
            return TOLERANCES[self.dtype]
        return (max(r[0] for r in rows), max(r[1] for r in rows), min(r[2] for r in rows), min(r[3] for r in rows))

    @property
    def atol_share(self) -> float:
        """The share of the prompt's largest |logit| the logit atol is at least (:data:`LOSSY_CACHE_ATOL_SHARE` for
        a lossy cache, else 0)."""
        return LOSSY_CACHE_ATOL_SHARE if self.lossy_cache else 0.0

    @property
    def tie_rtol(self) -> float:
        """The relative score tolerance under which two candidates tie: by the dtype (:data:`TIE_RTOL`), widened for a
        lossy cache (:data:`TIE_RTOL_LOSSY_CACHE`) and for lossy weight arithmetic (:data:`TIE_RTOL_LOSSY_WEIGHTS`)."""
        from kvexport.export.ties import TIE_RTOL, TIE_RTOL_LOSSY_CACHE, TIE_RTOL_LOSSY_WEIGHTS

        r = TIE_RTOL.get(self.dtype, 1e-5)
        r = max(r, TIE_RTOL_LOSSY_CACHE) if self.lossy_cache else r
        return max(r, TIE_RTOL_LOSSY_WEIGHTS) if self.lossy_weights else r

    @property
    def text(self) -> str:
        """Which tolerances apply and why, in words."""
        rules = []
        if self.lossy_cache:
            rules.append(f"lossy cache ({self.kv_dtype} of {self.dtype}; atol at least {LOSSY_CACHE_ATOL_SHARE:.0%} "
                         "of the prompt's largest |logit|)")
        if self.lossy_weights:
            rules.append(f"lossy weights arithmetic ({self.weights}: {self.lossy_weights})")
        if not rules:
            return self.dtype + (f" (the reference holds the export's {self.weights} weights, float32 arithmetic)"
                                 if self.weights else "")
        return "; ".join(rules)


def tolerance_rule(settings: dict) -> str:
    """Which tolerances an export's parity check uses, in words (:attr:`ParityRule.text`)."""
    return ParityRule(settings).text


def tolerances(settings: dict) -> tuple[float, float, float, float]:
    """(atol, rtol, least token agreement, least kept-index agreement) of an export's parity check
    (:attr:`ParityRule.tolerances`)."""
    return ParityRule(settings).tolerances


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
        hit = known.get(feed_key(feed_dict["input_ids"], feed_dict["attention_mask"], f))
        if hit is None and generator is None:
            raise RuntimeError(f"{name}: no stored run for this feed and no generator to run it")
        return hit or generator.generate(feed_dict["input_ids"], feed_dict["attention_mask"], f.shape[1],
                                         forced_tokens=f, keep_logits=True)

    return _make_runner(name, batch, produce)


def feed_key(*arrays) -> bytes:
    return b"|".join(np.ascontiguousarray(x, dtype=np.int64).tobytes() for x in arrays)


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
        if cap:  # a full cache: the prompt and the decode steps fit its slots
            lengths = [n for n in lengths if n < cap // 2] or [1]
    elif cap:  # an evicting cache: any prompt the positions hold, with room to decode (the one above twice the
        # budget included: it compacts in prefill, which a budget of a quarter of the positions would not otherwise)
        lengths = [n for n in lengths if n <= cap - max(64, cap // 8)] or [1]
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


class PairStats:
    """Running per-pair numbers over the prompts (reference vs candidate results).

    ``lossy_weights``: the candidate multiplies int4 weights with int8 activations (:data:`LOSSY_WEIGHTS_TOLERANCES`),
    so every logit may move by up to the tolerance: a greedy token counts as agreeing where the reference scores the
    candidate's token within ``atol`` of its own best (a near tie), and kept sets gate on their mean overlap
    |A ∩ B| / |A| instead of whole-set equality. The strict figures are reported beside them."""

    def __init__(self, lossy_weights: bool = False, atol: float = 0.0, atol_share: float = 0.0):
        self.abs: list[float] = []
        self.base_atol, self.atol_share = float(atol), float(atol_share)
        self.rel: list[float] = []
        self.tok_agree = self.tok_total = self.idx_agree = self.idx_total = 0
        self.lossy_weights, self.atol = bool(lossy_weights), float(atol)
        self.tok_near = 0
        self.idx_overlap = 0.0
        self.poly_ok = True
        self.ties = 0
        self.rows: list[dict] = []

    def prompt_atol(self, ref) -> float:
        """The logit atol for one prompt: the base, or ``atol_share`` (:data:`LOSSY_CACHE_ATOL_SHARE` for a lossy
        cache) of the reference's largest |logit| on it if more; the largest used is what the report gives."""
        a = self.base_atol
        if self.atol_share:
            a = max(a, self.atol_share * float(np.abs(_outputs(ref)["logits"]).max()))
        self.atol = max(self.atol, a)
        return a

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
        picked = np.take_along_axis(a, b.argmax(-1)[..., None], -1)[..., 0]  # the reference's logit of b's token
        self.tok_near += int((agree | (a.max(-1) - picked <= self.atol)).sum())
        ia, it, overlap = kept_sets(ref, cand)
        self.idx_agree += ia
        self.idx_total += it
        self.idx_overlap += overlap
        self.ties += ties
        self.rows.append({"lengths": feed["attention_mask"].sum(-1).tolist(), "compactions": cand.compactions,
                          "max_abs_logit_error": float(err.max()), "token_agreement": float(agree.mean()),
                          "ties_followed": ties})

    def report(self, reference: str, candidate: str, steps: int, atol, rtol, min_tok, min_idx) -> dict:
        token_agreement = self.tok_agree / max(self.tok_total, 1)
        index_agreement = self.idx_agree / self.idx_total if self.idx_total else 1.0
        near = self.tok_near / max(self.tok_total, 1)
        overlap = self.idx_overlap / self.idx_total if self.idx_total else 1.0
        tok, idx = (near, overlap) if self.lossy_weights else (token_agreement, index_agreement)
        passed = bool(self.poly_ok and tok >= min_tok and idx >= min_idx)
        gated = ({"token_agreement": f"near ties within atol {self.atol:g} agree", "index_agreement":
                  "mean kept-set overlap |A ∩ B| / |A|"} if self.lossy_weights else
                 {"token_agreement": "equal greedy tokens", "index_agreement": "equal kept sets"})
        return {
            "reference": reference, "candidate": candidate,
            "max_abs_logit_error": float(max(self.abs)) if self.abs else 0.0,
            "max_rel_logit_error": float(max(self.rel)) if self.rel else 0.0,
            "token_agreement": token_agreement, "index_agreement": index_agreement, "steps": int(steps),
            "token_agreement_near_ties": near, "kept_overlap": overlap,
            "passed": passed, "polygraphy_passed": self.poly_ok,
            "tolerances": {"atol": atol, "rtol": rtol, "token_agreement": min_tok, "index_agreement": min_idx,
                           "gated": gated,
                           "compare": "polygraphy SimpleCompareFunc (elementwise) on stacked per-step logits"},
            "per_step_max_abs_logit_error": self.abs, "per_step_max_rel_logit_error": self.rel,
            "prompts": self.rows, "compared_kept_sets": self.idx_total, "ties_followed": self.ties,
        }
