# SPDX-License-Identifier: Apache-2.0
"""A quantized cache against its fp32 twin: the same model, press, budget, window and chunk, two independent runs
of the PyTorch library path (:func:`kvexport.generation.generate`), one with ``kv_dtype="fp32"`` and one with the
lossy format (docs/quantized.md).

Per window (N, P + T) of held-out text: the fp32 twin prefills the first P tokens and decodes T tokens greedily;
its tokens are then forced into the quantized run (teacher forcing), so both see the same T inputs and the T
next-token distributions compare position by position:

- ``next_token_agreement``: argmax(quantized) == argmax(fp32) (the fp32 twin's greedy token), over all positions;
- ``mean_kl``: KL(fp32 ‖ quantized) in nats, averaged over positions; ``max_abs_logit_diff``: the largest |Δlogit|;
- ``fp32_margin``: the fp32 twin's top-1 minus top-2 logit, median over all positions and over the disagreeing
  ones (a disagreement at a near-tie is rounding noise deciding a coin toss, not a broken cache);
- ``compactions_equal``: how many windows compacted at the same steps in both runs; ``kept_agreement``: the share
  of (compaction, layer, row, head) kept sets that are equal (eviction decisions the quantization changed);
  ``kept_overlap``: the mean share of the fp32 twin's kept tokens the quantized cache also kept.

Resident bytes of both caches come from the runs' own buffers (``GenerationResult.resident_bytes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.export.fidelity import _log_softmax

#: cache format -> the model dtypes whose K/V it stores exactly (nothing to compare with a twin)
LOSSLESS_FOR = {"fp32": ("fp32", "fp16", "bf16"), "fp16": ("fp16",), "bf16": ("bf16",)}


def is_lossy(kv_dtype: str | None, model_dtype: str) -> bool:
    """True when a cache of ``kv_dtype`` loses information against the model's own dtype: int8 / fp8 always,
    fp16 / bf16 when the model is fp32."""
    if kv_dtype is None:
        return False
    return model_dtype not in LOSSLESS_FOR.get(str(kv_dtype), ())


def stacked_logits(res) -> np.ndarray:
    """(B, T, V) float64 of a generation result (torch or NumPy): the logits at the last prompt token, then after
    each decode step."""
    return np.stack([_array(res.prompt_logits)] + [_array(x) for x in res.step_logits], 1).astype(np.float64)


def kept_sets(a, b) -> tuple[int, int, float]:
    """Two runs' kept sets (``GenerationResult``-like: ``compaction_steps``, ``kept_positions`` per compaction and
    layer (B, Hc, cap), torch or NumPy) -> (equal, compared, summed overlap |A ∩ B| / |A|) over every compaction,
    layer, row and head; runs that compacted at different steps compare as one unequal set. Used by validation's
    parity (export vs PyTorch) and by the twin (quantized vs fp32)."""
    eq = total = 0
    overlap = 0.0
    if list(a.compaction_steps) != list(b.compaction_steps):
        return 0, max(len(a.compaction_steps), len(b.compaction_steps), 1), 0.0
    for ka, kb in zip(a.kept_positions, b.kept_positions, strict=True):
        for x, y in zip(ka, kb, strict=True):  # per layer (B, Hc, cap)
            x, y = _array(x), _array(y)
            for r in range(x.shape[0]):
                for h in range(x.shape[1]):
                    u, v = x[r, h], y[r, h]
                    u, v = np.sort(u[u >= 0]), np.sort(v[v >= 0])
                    eq += int(np.array_equal(u, v))
                    overlap += np.intersect1d(u, v).size / max(u.size, 1)
                    total += 1
    return eq, total, overlap


def _array(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def twin_compare(decoder, windows, prefix: int, scored: int, kv_dtype: str, press_factory=None, window: int = DEFAULT_WINDOW,
                 chunk: int | None = None, capacity: int | None = None, batch: int = 8, track_kept: bool = True,
                 progress=None) -> dict[str, Any]:
    """The ``kv_dtype`` cache of ``decoder`` against its fp32 twin on ``windows`` (N, >= prefix) token ids.

    press_factory: ``() -> press`` (a fresh press per run; None = full cache of ``capacity`` slots).
    -> the figures of the module docstring, plus ``per_window`` agreement and both runs' ``resident_bytes``.
    """
    return twin_compare_many(decoder, windows, prefix, scored, (kv_dtype,), press_factory, window, chunk, capacity,
                             batch, track_kept, progress)[kv_dtype]


def twin_compare_many(decoder, windows, prefix: int, scored: int, kv_dtypes, press_factory=None, window: int = DEFAULT_WINDOW,
                      chunk: int | None = None, capacity: int | None = None, batch: int = 8, track_kept: bool = True,
                      progress=None) -> dict[str, dict[str, Any]]:
    """:func:`twin_compare` for several formats against one fp32 run per window batch -> {kv_dtype: figures}."""
    return {k: acc.result() for k, acc in _run(decoder, windows, prefix, scored, tuple(kv_dtypes), press_factory,
                                               window, chunk, capacity, batch, track_kept, progress).items()}


class _Acc:
    """Running figures of one format against the fp32 twin."""

    def __init__(self, kv_dtype: str, prefix: int, track_kept: bool):
        self.kv_dtype, self.prefix, self.track_kept = kv_dtype, prefix, track_kept
        self.agree = self.n = self.comp_equal = self.kept_eq = self.kept_total = self.windows = 0
        self.kl_sum = self.max_abs = self.kept_overlap = 0.0
        self.margins: list[np.ndarray] = []
        self.bad_margins: list[np.ndarray] = []
        self.per_window: list[float] = []
        self.bytes_ref: dict[str, int] = {}
        self.bytes_q: dict[str, int] = {}

    def add(self, ref, got, T: int) -> None:
        a, b = stacked_logits(ref)[:, :T], stacked_logits(got)[:, :T]
        la, lb = _log_softmax(a), _log_softmax(b)
        ok = a.argmax(-1) == b.argmax(-1)  # (B, T)
        self.windows += ok.shape[0]
        self.agree += int(ok.sum())
        self.n += ok.size
        self.per_window += ok.mean(-1).tolist()
        self.kl_sum += float((np.exp(la) * (la - lb)).sum(-1).sum())
        self.max_abs = max(self.max_abs, float(np.abs(a - b).max()))
        top2 = np.sort(a, -1)[..., -2:]
        margin = top2[..., 1] - top2[..., 0]
        self.margins.append(margin.ravel())
        self.bad_margins.append(margin[~ok])
        self.comp_equal += int(list(ref.compaction_steps) == list(got.compaction_steps)) * ok.shape[0]
        if self.track_kept:
            e, t, o = kept_sets(ref, got)
            self.kept_eq += e
            self.kept_total += t
            self.kept_overlap += o
        self.bytes_ref, self.bytes_q = dict(ref.resident_bytes), dict(got.resident_bytes)

    def result(self) -> dict[str, Any]:
        allm = np.concatenate(self.margins)
        badm = np.concatenate(self.bad_margins)
        kvd, n = self.kv_dtype, max(self.n, 1)
        return {
            "candidate": f"{kvd} cache (kvexport.generation.generate, kv_dtype={kvd})",
            "reference": "its fp32 twin (kvexport.generation.generate, kv_dtype=fp32, same model and settings)",
            "kv_dtype": kvd, "windows": self.windows, "prefix_tokens": int(self.prefix), "scored_tokens": self.n,
            "next_token_agreement": self.agree / n, "mean_kl": self.kl_sum / n, "max_abs_logit_diff": self.max_abs,
            "per_window_agreement": self.per_window,
            "fp32_margin": {"median_all": float(np.median(allm)),
                            "median_disagreeing": float(np.median(badm)) if badm.size else None,
                            "disagreements": int(badm.size)},
            "compactions_equal": self.comp_equal,
            "kept_agreement": self.kept_eq / self.kept_total if self.kept_total else None,
            "kept_overlap": self.kept_overlap / self.kept_total if self.kept_total else None,
            "resident_bytes": {"fp32": self.bytes_ref, kvd: self.bytes_q},
            "cache_bytes": {"fp32": _cache_proper(self.bytes_ref), kvd: _cache_proper(self.bytes_q)},
        }


def _cache_proper(b: dict[str, int]) -> int:
    """K/V (or latent) rows + their scales: the bytes the format changes."""
    return int(b.get("kv", 0)) + int(b.get("scales", 0))


def _run(decoder, windows, prefix, scored, kv_dtypes, press_factory, window, chunk, capacity, batch, track_kept,
         progress) -> dict[str, _Acc]:
    import torch

    from kvexport.generation import generate

    say = progress or (lambda msg: None)
    wins = torch.as_tensor(np.asarray(windows))[:, :prefix].long()
    T = int(scored)
    accs = {k: _Acc(k, prefix, track_kept) for k in kv_dtypes}
    kw = dict(window=window, chunk=chunk, max_new_tokens=T, keep_logits=True, track_kept=track_kept)
    if press_factory is None:
        kw["capacity"] = capacity
    for s in range(0, wins.shape[0], batch):
        ids = wins[s : s + batch]
        what = f"windows {s + 1}-{s + ids.shape[0]}/{wins.shape[0]} ({prefix} + {T} tokens)"
        say(f"twin: fp32 cache, {what}")
        ref = generate(decoder, ids, press=press_factory() if press_factory else None, kv_dtype="fp32", **kw)
        for k in kv_dtypes:
            say(f"twin: {k} cache, {what}")
            got = generate(decoder, ids, press=press_factory() if press_factory else None, kv_dtype=k,
                           forced_tokens=ref.tokens, **kw)
            accs[k].add(ref, got, T)
    return accs


def twin_compare_exports(reference_dir, exports: dict, windows, prefix: int, scored: int, track_kept: bool = True,
                         threads: int | None = None, progress=None) -> dict[str, dict[str, Any]]:
    """Exports against an fp32 export on onnxruntime (:class:`~kvexport.runtime.onnxruntime.OrtGenerator`), the same
    figures as :func:`twin_compare`: the reference export decodes ``scored`` tokens greedily after each window's
    first ``prefix`` tokens, and its tokens are forced into each export of ``exports`` ({label: directory}, e.g.
    {"int8": ...}); each export's batch size is its own, ``windows`` (N, >= prefix) must fill whole batches.
    What a user compares when converting the same model twice, with and without ``--kv-dtype``."""
    from kvexport.errors import BadUsage
    from kvexport.runtime.onnxruntime import open_onnxruntime

    say = progress or (lambda msg: None)
    wins = np.asarray(windows)[:, :prefix].astype(np.int64)
    ref_gen = open_onnxruntime(reference_dir, threads=threads)
    gens = {k: open_onnxruntime(d, threads=threads) for k, d in exports.items()}
    B = ref_gen.batch
    if wins.shape[0] % B or any(g.batch != B for g in gens.values()):
        raise BadUsage(f"{wins.shape[0]} windows do not fill batches of {B} (every export takes batch "
                       f"{sorted({B, *(g.batch for g in gens.values())})})")
    T = int(scored)
    accs = {k: _Acc(k, prefix, track_kept) for k in exports}
    for s in range(0, wins.shape[0], B):
        ids = wins[s : s + B]
        what = f"windows {s + 1}-{s + B}/{wins.shape[0]} ({prefix} + {T} tokens)"
        say(f"export twin: reference, {what}")
        ref = ref_gen.generate(ids, max_new_tokens=T, keep_logits=True, track_kept=track_kept)
        for k, g in gens.items():
            say(f"export twin: {k}, {what}")
            got = g.generate(ids, max_new_tokens=T, forced_tokens=ref.tokens, keep_logits=True, track_kept=track_kept)
            accs[k].add(ref, got, T)
    out = {}
    for k, acc in accs.items():
        r = acc.result()
        r["candidate"] = f"{k} export ({Path(exports[k]).name}, onnxruntime)"
        r["reference"] = f"the fp32 export ({Path(reference_dir).name}, onnxruntime)"
        out[k] = r
    return out


__all__ = ["twin_compare", "twin_compare_many", "twin_compare_exports", "is_lossy", "kept_sets"]
