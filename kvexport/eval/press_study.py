# SPDX-License-Identifier: Apache-2.0
"""The Expected-Attention press study (Devoto et al., 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution", Fig. "layer output discrepancy vs compression").

Protocol, per held-out window of ``P + F + 1`` tokens (B windows at a time, no padding):

1. prefill the first ``P`` tokens in one chunk into a cache with press ``p`` at ratio ``r``; each layer
   keeps ``press.layer_budgets(L, P)`` tokens (kvpress's ``int(P * (1 - r))``; PyramidKV per layer);
2. feed the next ``F`` tokens one at a time (teacher forcing) in decode mode; the cache has ``F + 1``
   free slots, so nothing more is evicted: only the prefill compression is measured;
3. the reference is the same run with ``press=None`` (every token kept), so ratio 0 gives exactly 0.

Metrics, for the F future tokens t = P .. P+F-1:

- ``discrepancy``: ``‖h_l,t − h̃_l,t‖₂`` over the hidden dimension, where ``h_l,t`` is the output of decoder
  layer ``l`` (the residual stream after its MLP, before the final norm) with the full cache and
  ``h̃_l,t`` with the compressed one; mean over windows, future tokens and layers (per layer in
  ``discrepancy_per_layer``). ``relative_discrepancy`` divides each term by ``‖h_l,t‖₂`` first.
- ``ppl``: ``exp`` of the mean cross-entropy of the F next tokens (t+1) predicted with the compressed cache.
- ``agreement``: fraction of the F steps whose argmax token equals the full-cache argmax.

The Optimal oracle (``OptimalPress``) is given the true future queries of the F tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvexport.errors import BadUsage
from kvexport.eval.metrics import agreement_count, layer_discrepancy, nll_sum, relative_discrepancy
from kvexport.presses import PRESSES, OptimalPress, make_press
from kvexport.runtime.loop import generate
from kvexport.runtime.torch_driver import TorchDriver

#: the presses of the paper's figure, then the oracle and a random baseline
STUDY_PRESSES = (
    "expected_attention",
    "knorm",
    "tova",
    "keydiff",
    "snapkv",
    "pyramidkv",
    "streaming_llm",
    "random",
    "optimal",
)
DEFAULT_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

METRIC_DOC = {
    "discrepancy": "mean over windows, the F future tokens and the L layers of ||h - h_compr||_2 over the hidden "
    "dim; h = output of each decoder layer (residual stream after the MLP, before the final norm); only the "
    "prompt is compressed (once, after prefill); future tokens are teacher-forced",
    "relative_discrepancy": "same mean of ||h - h_compr||_2 / ||h||_2",
    "ppl": "exp(mean cross-entropy of the next token at each of the F future steps, compressed cache)",
    "agreement": "fraction of the F future steps whose argmax equals the full-cache argmax",
    "kept_per_layer": "prompt tokens each layer keeps after compression: int(P * (1 - ratio)) (kvpress's rule); "
    "PyramidKV: its per-layer pyramid (lower layers keep more)",
}


@dataclass
class PressStudy:
    """Settings: ``prompt_len`` P tokens compressed, ``future_len`` F tokens scored, ``batch`` windows at once."""

    ratios: tuple[float, ...] = DEFAULT_RATIOS
    presses: tuple[str, ...] = STUDY_PRESSES
    prompt_len: int = 192
    future_len: int = 32
    batch: int = 8
    press_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        bad = [p for p in self.presses if p not in PRESSES]
        if bad:
            raise BadUsage(f"unknown press {bad[0]!r}; accepted: {', '.join(PRESSES)}")
        if any(not (0.0 <= r < 1.0) for r in self.ratios):
            raise BadUsage(f"ratios {list(self.ratios)} must lie in [0, 1)")
        if self.prompt_len < 2 or self.future_len < 1 or self.batch < 1:
            raise BadUsage("prompt_len must be >= 2, future_len and batch >= 1")


@torch.no_grad()
def run_window(decoder, ids: torch.Tensor, prompt_len: int, future_len: int, press=None):
    """ids (B, P+F+1) -> (hidden (L, B, F, H), logits (B, F, V)) for the F teacher-forced future tokens,
    with the prompt compressed by ``press`` after prefill (None: nothing evicted)."""
    B, P, F = ids.shape[0], prompt_len, future_len
    L = decoder.spec.num_layers
    # the prompt in one chunk, then the F future tokens forced one at a time; the cache has F + 1 free slots
    driver = TorchDriver(decoder, press, window=F + 1, capacity=P + F + 1, batch=B)
    hidden: list[list[torch.Tensor]] = [[] for _ in range(L)]
    hooks = [
        layer.register_forward_hook(lambda m, a, out, i=i: hidden[i].append(out[0][:, -1]))
        for i, layer in enumerate(decoder.layers)
    ]
    try:
        res = generate(driver, ids[:, :P], max_new_tokens=F + 1, forced_tokens=ids[:, P : P + F + 1],
                       keep_logits=True)
    finally:
        for h in hooks:
            h.remove()
    # each hook's first call is the prefill's (one chunk): the future tokens' outputs come after it
    return torch.stack([torch.stack(h[1:], 1) for h in hidden]), torch.stack(res.step_logits, 1)


def _press(name: str, ratio: float, decoder, ids, study: PressStudy):
    kw = dict(study.press_kwargs.get(name, {}))
    if name == "optimal":
        P, F = study.prompt_len, study.future_len
        pos = torch.arange(P + F, device=ids.device).expand(ids.shape[0], P + F)
        kw["future"] = OptimalPress.record_future(decoder, ids[:, : P + F], pos, start=P)
    return make_press(name, compression_ratio=ratio, **kw)


@torch.no_grad()
def press_study(decoder, windows: torch.Tensor, study: PressStudy, progress=None) -> dict:
    """windows (N, >= P+F+1) held-out token ids -> the JSON-able study result (see module doc)."""
    P, F = study.prompt_len, study.future_len
    if windows.ndim != 2 or windows.shape[1] < P + F + 1 or windows.shape[0] == 0:
        raise BadUsage(f"need at least one window of {P + F + 1} tokens (prompt {P} + future {F} + 1)")
    windows = windows[:, : P + F + 1]
    L = decoder.spec.num_layers
    acc: dict = {
        (p, r): {"d": torch.zeros(L), "rel": torch.zeros(L), "nll": 0.0, "agree": 0.0}
        for p in study.presses
        for r in study.ratios
    }
    full_nll, n = 0.0, 0
    for s in range(0, windows.shape[0], study.batch):
        ids = windows[s : s + study.batch]
        targets = ids[:, P + 1 : P + F + 1]  # (B, F)
        h_ref, lg_ref = run_window(decoder, ids, P, F)
        full_nll += nll_sum(lg_ref, targets)
        for p in study.presses:
            for r in study.ratios:
                press = _press(p, r, decoder, ids, study)
                h, lg = run_window(decoder, ids, P, F, press)
                a = acc[(p, r)]
                a["kept"] = press.layer_budgets(L, P)
                a["d"] += layer_discrepancy(h, h_ref).sum((1, 2)).cpu()  # (L,)
                a["rel"] += relative_discrepancy(h, h_ref).sum((1, 2)).cpu()
                a["nll"] += nll_sum(lg, targets)
                a["agree"] += agreement_count(lg, lg_ref)
                if progress:
                    progress(p, r, s)
        n += ids.shape[0] * F
    results: dict = {p: {} for p in study.presses}
    for (p, r), a in acc.items():
        results[p][f"{r:g}"] = {
            "discrepancy": (a["d"].sum() / (n * L)).item(),
            "discrepancy_per_layer": (a["d"] / n).tolist(),
            "relative_discrepancy": (a["rel"].sum() / (n * L)).item(),
            "ppl": math.exp(a["nll"] / n),
            "agreement": a["agree"] / n,
            "kept_per_layer": a["kept"],
        }
    return {
        "study": "press discrepancy vs compression ratio (Expected Attention, Devoto et al. 2025)",
        "metrics": METRIC_DOC,
        "settings": {
            "prompt_len": P,
            "future_len": F,
            "windows": int(windows.shape[0]),
            "layers": L,
            "ratios": list(study.ratios),
            "presses": list(study.presses),
            "press_kwargs": study.press_kwargs,
        },
        "full_cache": {"ppl": math.exp(full_nll / n), "tokens_scored": n},
        "results": results,
    }
