# SPDX-License-Identifier: Apache-2.0
"""The compression sweep on a real model: what each cache setting keeps of the original, against the bytes it holds.

A *setting* (:class:`Setting`) is a press and budget, how the prompt is fed (chunks of ``chunk`` columns, as
``kvexport convert`` exports it, or in one piece), an MLA rewrite (undistilled, calibrated on English prose), and
a cache format (fp32, int8, ...). Every setting runs on kvexport's PyTorch library path
(:func:`kvexport.generation.generate`, the reference every export is validated against) and is compared with the
original model (the same decoder with a full, uncompressed fp32 cache, equal to transformers' logits within 1e-4,
tests/real):

- ``text``: ``windows`` held-out prose windows (:func:`kvexport.eval.data.prose_stream`) of ``context`` tokens
  are prefilled (compressed as in use), then ``scored`` next tokens are fed teacher-forced (decode steps, decode
  compactions included). At each scored position: next-token agreement of the argmaxes, KL(original ‖ setting) in
  nats, and the perplexity of both on the true tokens (``ppl_increase = ppl / ppl_original - 1``).
- ``passkey`` / ``span_recall`` at each probe length, one prompt per depth (:mod:`kvexport.eval.longctx`),
  greedy; accuracy and the original's accuracy on the same prompts.
- ``resident_bytes``: every byte the setting's cache holds for one sequence (K/V or latent storage, scales,
  positions, query ring: :meth:`kvexport.cache.static_cache.StaticCache.resident_bytes`), measured at each probe
  length; ``full_bytes`` the original's full fp32 cache at that length.

Results are appended to a JSON-lines file one setting at a time (a rerun skips the settings already there), so a
sweep of many hours can stop and go on.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvexport.errors import BadUsage
from kvexport.models.attention import fused_eager_attention


@dataclass(frozen=True)
class Setting:
    """One cache setting. ``press`` None = no eviction; ``chunk`` None = the prompt in one piece; ``mla``: None or
    a per-token compression ratio of the MLA rewrite (1.0 = the exact rewrite); ``kv_dtype`` None = fp32."""

    press: str | None = None
    budget: int | None = None
    window: int = 32
    chunk: int | None = 512
    mla: float | None = None
    kv_dtype: str | None = None
    press_kw: tuple[tuple[str, Any], ...] = ()
    generate_kw: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        parts = [self.press or "full"]
        if self.press is not None:
            parts += [f"b{self.budget}", f"w{self.window}"]
        parts.append(f"c{self.chunk}" if self.chunk else "single")
        if self.mla is not None:
            parts.append(f"mla{self.mla:g}x")
        if self.kv_dtype:
            parts.append(self.kv_dtype)
        parts += [f"{k}={v}" for k, v in self.press_kw + self.generate_kw]
        return "/".join(parts)


@dataclass
class SweepSpec:
    """What every setting is measured on (module docstring)."""

    windows: int = 2
    context: int = 4096
    scored: int = 64
    probe_lengths: tuple[int, ...] = (1536, 4096, 8192)
    probe_kinds: tuple[str, ...] = ("passkey", "span_recall")
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    #: prose tokens the MLA rewrites are calibrated on (0: the rewrite's default, what convert's rewrite stage uses)
    calibration_tokens: int = 8192
    #: the MLA rewrites equalize their latent (what convert does for an int8 cache: MLASettings.equalize_latent)
    mla_equalize: bool = False
    #: where the text windows come from: the held-out prose (reports) or the calibration prose (choosing settings)
    text_split: str = "heldout"
    seed: int = 0
    threads: int | None = None
    only_lengths: dict[str, tuple[int, ...]] = field(default_factory=dict)  # setting key -> probe lengths


def mla_settings_for(spec, ratio: float):
    """(kv_rank, rope_dim) of an MLA rewrite ``ratio`` times smaller per token than the GQA cache: the exact rewrite
    at 1.0; below it d_rope = head_dim (the RoPE part the undistilled studies keep, docs/mla.md), r_kv the rest."""
    from kvexport.mla.config import MLASettings

    full = 2 * spec.num_kv_heads * spec.head_dim
    if ratio <= 1.0:
        n = spec.num_kv_heads * spec.head_dim
        return MLASettings(kv_rank=n, rope_dim=n)
    total = int(round(full / ratio / 2)) * 2
    rope = min(spec.head_dim, total // 2)
    rope -= rope % 2
    return MLASettings(kv_rank=total - rope, rope_dim=rope)


class Sweep:
    """Runs settings on one model; holds the original's references (text logits, probe answers) once."""

    def __init__(self, model_dir: str | Path, spec: SweepSpec | None = None, log=print,
                 ref_cache: str | Path | None = None):
        from kvexport.eval.data import prose_stream
        from kvexport.eval.longctx import probes
        from kvexport.mla.io import load_decoder
        from kvexport.models.loading import load_tokenizer

        self.spec = spec or SweepSpec()
        if self.spec.threads:
            torch.set_num_threads(int(self.spec.threads))
        self.model_dir = str(model_dir)
        self.decoder, _ = load_decoder(model_dir)
        self.decoder.eval()
        self.tok = load_tokenizer(model_dir)
        if self.tok is None:
            raise BadUsage(f"{model_dir} has no tokenizer; the sweep needs text")
        self.log = log
        self.ref_cache = ref_cache
        s = self.spec
        stream = prose_stream(self.tok, s.text_split)
        need = s.context + s.scored
        total = stream.numel() // need
        if total < s.windows:
            raise BadUsage(f"held-out prose has {stream.numel()} tokens: fewer than {s.windows} windows of {need}")
        idx = torch.linspace(0, total - 1, s.windows).long().tolist()
        self.windows = torch.stack([stream[i * need : (i + 1) * need] for i in idx])  # (W, context + scored)
        self.probes = probes(self.tok, s.probe_kinds, s.probe_lengths, s.depths, s.seed)
        self._mla: dict[float, Any] = {}
        self._ref: dict[str, Any] | None = None

    # ------------------------------------------------------------------ models
    def model(self, mla: float | None):
        if mla is None:
            return self.decoder
        if mla not in self._mla:
            from kvexport.eval.data import prose_stream
            from kvexport.mla.rewrite import rewrite_to_mla

            s = self.spec
            calib = None  # 0 tokens: the rewrite's own default calibration, as `kvexport convert --mla-rank` makes it
            if s.calibration_tokens:
                calib = prose_stream(self.tok, "calibration")[: s.calibration_tokens]
                calib = calib[: (calib.numel() // 512) * 512].reshape(-1, 512)
            settings = mla_settings_for(self.decoder.spec, mla)
            if s.mla_equalize:
                from dataclasses import replace

                settings = replace(settings, equalize_latent=True)
            self._mla.clear()  # one rewrite held at a time
            t = time.time()
            self._mla[mla] = rewrite_to_mla(self.decoder, settings, calib)
            self.log(f"  MLA {mla:g}x rewritten in {time.time() - t:.0f} s")
        return self._mla[mla]

    # ------------------------------------------------------------------ one run
    def _generate(self, st: Setting, dec, ids, n_new, forced=None):
        from kvexport.generation import generate
        from kvexport.presses import make_press

        press = None if st.press is None else make_press(st.press, budget=st.budget, **dict(st.press_kw))
        return generate(dec, ids, press=press, window=st.window, chunk=st.chunk, max_new_tokens=n_new,
                        forced_tokens=forced, keep_logits=forced is not None, kv_dtype=st.kv_dtype,
                        **dict(st.generate_kw))

    def _text_logits(self, st: Setting, dec) -> torch.Tensor:
        """(W, scored, V) logits at the scored positions, teacher-forced."""
        s = self.spec
        ctx, fut = self.windows[:, : s.context], self.windows[:, s.context :]
        out = []
        for i in range(ctx.shape[0]):  # one window at a time: the single-shot prefill of 4k+ tokens is large
            r = self._generate(st, dec, ctx[i : i + 1], s.scored, forced=fut[i : i + 1])
            out.append(torch.stack([r.prompt_logits] + r.step_logits, 1)[:, : s.scored])
        return torch.cat(out)

    def _probe(self, st: Setting, dec, kind: str, length: int) -> dict[str, Any]:
        from kvexport.eval.tasks import exact_match, prediction

        exs = self.probes[(kind, length)]
        ids = torch.tensor([e.prompt for e in exs])
        n_new = max(len(e.answer_ids) if e.answer_ids else 8 for e in exs)
        r = self._generate(st, dec, ids, n_new)
        preds = [prediction(self.tok, e, r.tokens[i].tolist()) for i, e in enumerate(exs)]
        hits = [bool(exact_match(p, e.answer)) if not e.answer_ids else p == e.answer for p, e in zip(preds, exs, strict=True)]
        return {"hits": hits, "answers": [e.answer for e in exs], "predictions": preds,
                "resident_bytes": {k: int(v) // ids.shape[0] for k, v in r.resident_bytes.items()},
                "slots": int(max(r.cache.plan.capacities))}

    def reference(self) -> dict[str, Any]:
        with fused_eager_attention():
            return self._reference()

    def _reference(self) -> dict[str, Any]:
        """The original's text logits and probe results (full fp32 cache, the prompt in chunks of 512); kept in
        ``ref_cache`` (a directory) when the sweep has one, so other tiers and processes reuse them (a probe the
        kept file lacks is measured and added)."""
        if self._ref is None and self.ref_cache is not None and self._ref_file().is_file():
            self._ref = torch.load(self._ref_file(), weights_only=False)
        st, dec, changed, t = Setting(chunk=512), self.decoder, False, time.time()
        if self._ref is None:
            self._ref = {"logits": self._text_logits(st, dec), "probes": {}}
            changed = True
        for key in self.probes:
            if key not in self._ref["probes"]:
                self._ref["probes"][key] = self._probe(st, dec, *key)
                changed = True
        if changed:
            self.log(f"  original measured in {time.time() - t:.0f} s")
            if self.ref_cache is not None:
                from kvexport.atomic import atomic_write_bytes

                buf = io.BytesIO()
                torch.save(self._ref, buf)
                self._ref_file().parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache yet
                atomic_write_bytes(self._ref_file(), buf.getvalue())
        return self._ref

    def _ref_file(self) -> Path:
        s = self.spec
        key = json.dumps([self.model_dir, s.windows, s.context, s.scored, list(s.depths), s.seed]
                         + ([s.text_split] if s.text_split != "heldout" else []))
        return Path(self.ref_cache) / f"reference-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"

    def measure(self, st: Setting, model=None, label: str | None = None) -> dict[str, Any]:
        """One setting's measures; ``model``: another decoder of the same model (e.g. a recovered MLA rewrite) to
        run the setting on instead of the one ``st.mla`` names, recorded as ``label``. Attention runs through
        torch's fused kernel (:func:`~kvexport.models.attention.fused_eager_attention`), for the original too."""
        with fused_eager_attention():
            return self._measure(st, model, label)

    def _measure(self, st: Setting, model, label) -> dict[str, Any]:
        s = self.spec
        ref = self.reference()
        dec = self.model(st.mla) if model is None else model
        t = time.time()
        logits = self._text_logits(st, dec)
        targets = self.windows[:, s.context : s.context + s.scored]
        lp_ref = ref["logits"].float().log_softmax(-1)
        lp = logits.float().log_softmax(-1)
        nll = -lp.gather(-1, targets[..., None]).mean().item()
        nll_ref = -lp_ref.gather(-1, targets[..., None]).mean().item()
        text = {"agreement": (logits.argmax(-1) == ref["logits"].argmax(-1)).float().mean().item(),
                "kl": (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item(),
                "ppl": math.exp(nll), "ppl_original": math.exp(nll_ref),
                "ppl_increase": math.exp(nll - nll_ref) - 1.0,
                "tokens": int(targets.numel()), "context": s.context}
        probes: dict[str, Any] = {}
        lengths_for = s.only_lengths.get(st.key)
        for (kind, n) in self.probes:
            if lengths_for is not None and n not in lengths_for:
                continue
            if st.chunk is None and n > 4096:
                continue  # single-shot prefill past 4k tokens: the attention matrix alone is several GB here
            got = self._probe(st, dec, kind, n)
            orig = ref["probes"][(kind, n)]
            probes[f"{kind}@{n}"] = {"accuracy": sum(got["hits"]) / len(got["hits"]),
                                     "original": sum(orig["hits"]) / len(orig["hits"]),
                                     "predictions": got["predictions"], "answers": got["answers"],
                                     "resident_bytes": got["resident_bytes"], "slots": got["slots"],
                                     "full_bytes": orig["resident_bytes"], "full_slots": orig["slots"]}
        key = st.key if label is None else f"{st.key}/{label}"
        return {"setting": key, **asdict(st), "text": text, "probes": probes, "seconds": round(time.time() - t, 1)}


def run(model_dir, settings: list[Setting], out: str | Path, spec: SweepSpec | None = None, log=print,
        ref_cache: str | Path | None = None) -> list[dict]:
    """Measure every setting not yet in ``out`` (JSON lines), appending one line per setting. Returns all lines.
    ``ref_cache``: a directory where the original's measures are kept for other runs of the same spec."""
    out = Path(out)
    done = {}
    if out.is_file():
        for line in out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["setting"]] = r
    todo = [st for st in settings if st.key not in done]
    if todo:
        sw = Sweep(model_dir, spec, log=log, ref_cache=ref_cache)
        for i, st in enumerate(todo):
            log(f"[{i + 1}/{len(todo)}] {st.key}")
            r = sw.measure(st)
            done[st.key] = r
            with out.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            log(f"  agreement {r['text']['agreement']:.3f} ppl +{r['text']['ppl_increase']:.1%} "
                + " ".join(f"{k} {v['accuracy']:.2f}" for k, v in r["probes"].items()) + f" ({r['seconds']} s)")
    return list(done.values())


__all__ = ["Setting", "SweepSpec", "Sweep", "run", "mla_settings_for"]
