# SPDX-License-Identifier: Apache-2.0
"""What compression cost: an export against the **original, uncompressed model** (transformers, full cache).

Held-out text (the bundled held-out split of the Python standard library, :mod:`kvexport.eval.data`, or a text
file the user gives) is cut into ``sequences`` windows of ``prefix + scored + 1`` tokens. The export prefills the
``prefix`` (compressed as it would be in use) and is then fed the next ``scored`` tokens one at a time (teacher
forcing); the original model reads each whole window with transformers. At each of the ``scored`` positions:

- next-token agreement: the two argmaxes are equal;
- KL(original ‖ export) of the next-token distributions, in nats, averaged over positions;
- perplexity of each on the true next tokens, and the relative increase ``ppl_export / ppl_original - 1``.

The prefix defaults to twice the export's capacity (so eviction acts), bounded by its position range. A
recall probe (:mod:`kvexport.eval.tasks`: ``span_recall``, a repeated span of held-out code to continue, and
``passkey``, a bound value to retrieve) runs greedy on both at a context of the same length; it needs the
export's tokenizer (without one, and for ``--eval-data`` without one, the section says so). Without a
tokenizer the text part uses random token ids (``eval_data: "random"``: agreement and KL still mean something,
perplexity less so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import BadArtifact, BadUsage


@dataclass(frozen=True)
class FidelitySettings:
    """sequences x (prefix + scored) tokens of text; ``recall`` examples per recall task (0 = no probe)."""

    sequences: int = 4
    scored: int = 64
    prefix: int | None = None  # default: 2 x the export's capacity, bounded by its position range
    recall: int = 8
    seed: int = 0

    def __post_init__(self):
        if self.sequences < 1 or self.scored < 1 or self.recall < 0:
            raise BadUsage("fidelity needs sequences >= 1, scored >= 1 and recall >= 0")
        if self.prefix is not None and self.prefix < 1:
            raise BadUsage(f"fidelity prefix {self.prefix} must be >= 1")


def find_original(path, settings: dict, original=None) -> Path | None:
    """The original model's HF directory: ``original``, else what the manifest records (``original`` /
    ``original_relative``), else the export's source when that is an HF (not an MLA) directory."""
    if original is not None:
        p = Path(original)
        if not p.is_dir():
            raise BadUsage(f"--original {p} is not a model directory")
        return p
    root = Path(path)
    for key_rel, key_abs in (("original_relative", "original"), ("source_relative", "source")):
        rel, ab = settings.get(key_rel), settings.get(key_abs)
        cands = ([root / rel] if rel else []) + ([Path(ab)] if ab else [])
        for c in cands:
            if not c.is_dir():
                continue
            from kvexport.mla.io import is_mla_dir, source_model

            if is_mla_dir(c):  # a saved MLA model: the HF directory it was rewritten from, when it records one
                up = source_model(c)
                if up is not None:
                    return up.resolve()
            elif (c / "config.json").is_file():
                return c.resolve()
    return None


def default_prefix(settings: dict, scored: int) -> int:
    caps = settings.get("capacities") or []
    base = 2 * int(max(caps)) if caps and settings.get("budgets") else 512
    limit = int(settings.get("max_positions") or base + scored + 1)
    if settings.get("mode") == "static" and not settings.get("budgets"):
        limit = min(limit, int(min(caps)))
    return max(1, min(base, limit - scored - 1))


def eval_stream(tokenizer, eval_data, seed: int, vocab: int, need: int):
    """(tokens (N,) int64, description) of the evaluation text."""
    if eval_data is not None:
        f = Path(eval_data)
        if not f.is_file():
            raise BadUsage(f"--eval-data {f} is not a file (give a UTF-8 text file)")
        if tokenizer is None:
            raise BadUsage("--eval-data needs the export's tokenizer (its tokenizer/ directory is missing)")
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadUsage(f"--eval-data {f} is not UTF-8 text") from None
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) < need:
            raise BadUsage(f"--eval-data {f} has {len(ids)} tokens; fidelity needs at least {need} (one window)")
        return np.asarray(ids, np.int64), str(f.resolve())
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return rng.integers(3, vocab, size=need * 8), "random"
    from kvexport.eval.data import heldout_stream

    return heldout_stream(tokenizer).numpy(), "bundled:stdlib-heldout"


def _windows(stream: np.ndarray, n: int, length: int) -> np.ndarray:
    total = stream.shape[0] // length
    if total == 0:
        raise BadUsage(f"the evaluation text has {stream.shape[0]} tokens, fewer than one {length}-token window")
    idx = np.linspace(0, total - 1, min(n, total)).astype(int)
    return np.stack([stream[i * length : (i + 1) * length] for i in idx])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def measure_fidelity(path, gen, tokenizer, original=None, eval_data=None, settings: FidelitySettings | None = None,
                     min_agreement: float | None = None, max_ppl_increase: float | None = None,
                     progress=None) -> dict[str, Any]:
    """The fidelity section of parity.json for the export at ``path`` run by ``gen`` (a step generator)."""
    import torch

    from kvexport.models.loading import load_hf_model

    say = progress or (lambda msg: None)
    st = settings or FidelitySettings()
    s = gen.settings
    orig_dir = find_original(path, s, original)
    out: dict[str, Any] = {"reference": "original model (transformers, full cache)",
                           "candidate": f"{getattr(gen, 'backend', 'onnxruntime')}:{gen.providers[0]}",
                           "settings": asdict(st)}
    if orig_dir is None:
        out["skipped"] = ("the original model is unknown (the export's source is an MLA directory that does not "
                          "name it); pass --original DIR")
        out["gates"] = _gates(out, min_agreement, max_ppl_increase)
        return out
    out["original"] = str(orig_dir)
    hf = load_hf_model(orig_dir, "fp32")
    if int(hf.config.vocab_size) != int(s["vocab_size"]):
        raise BadArtifact(f"the original model {orig_dir} has {hf.config.vocab_size} tokens, the export "
                          f"{s['vocab_size']}; pass the model it was converted from with --original")
    P = st.prefix or default_prefix(s, st.scored)
    T = st.scored
    stream, desc = eval_stream(tokenizer, eval_data, st.seed, int(s["vocab_size"]), P + T + 1)
    wins = _windows(stream, st.sequences, P + T + 1)
    B = int(s["batch"])
    agree = n = 0
    kl_sum = ce_o = ce_c = 0.0
    for start in range(0, wins.shape[0], B):
        group = wins[start : start + B]
        while group.shape[0] < B:  # the export's static batch: repeat the last window, scored once
            group = np.concatenate([group, group[-1:]])
        real = min(B, wins.shape[0] - start)
        say(f"fidelity: text {start + 1}-{start + real}/{wins.shape[0]} ({P} + {T} tokens)")
        with torch.no_grad():
            lo = hf(torch.from_numpy(group[:real, : P + T])).logits[:, P - 1 : P + T - 1].float().numpy()
        res = gen.generate(group[:, :P], np.ones((B, P), np.int64), T, forced_tokens=group[:, P : P + T],
                           keep_logits=True, track_kept=False)
        lc = np.stack([np.asarray(res.prompt_logits)] + [np.asarray(x) for x in res.step_logits], 1)[:real, :T]
        target = group[:real, P : P + T]
        la, lb = _log_softmax(lo), _log_softmax(lc)
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        n += target.size
        kl_sum += float((np.exp(la) * (la - lb)).sum(-1).sum())
        ce_o -= float(np.take_along_axis(la, target[..., None], -1).sum())
        ce_c -= float(np.take_along_axis(lb, target[..., None], -1).sum())
    ppl_o, ppl_c = float(np.exp(ce_o / n)), float(np.exp(ce_c / n))
    out.update({"eval_data": desc, "prefix_tokens": P, "scored_tokens": int(n), "sequences": int(wins.shape[0]),
                "next_token_agreement": agree / n, "mean_kl": kl_sum / n, "ppl_original": ppl_o,
                "ppl_converted": ppl_c, "ppl_increase": ppl_c / ppl_o - 1.0})
    out["recall"] = _recall(hf, gen, tokenizer, P, st, say)
    out["gates"] = _gates(out, min_agreement, max_ppl_increase)
    return out


def _recall(hf, gen, tokenizer, context: int, st: FidelitySettings, say) -> dict[str, Any]:
    """span_recall and passkey, greedy, original vs export, at ``context`` tokens."""
    if st.recall == 0:
        return {"skipped": "recall probe off (recall=0)"}
    if tokenizer is None:
        return {"skipped": "the export has no tokenizer; the recall probe builds its contexts from text"}
    import torch

    from kvexport.eval.data import heldout_texts
    from kvexport.eval.tasks import TaskSettings, passkey_examples, prediction, span_recall_examples

    ts = TaskSettings(context_len=max(48, context), n_recall=st.recall, seed=st.seed)
    try:
        tasks = {"span_recall": span_recall_examples(tokenizer, ts, heldout_texts()),
                 "passkey": passkey_examples(tokenizer, ts)}
    except BadUsage as e:
        return {"skipped": f"recall probe: {e}"}
    B = int(gen.settings["batch"])
    out: dict[str, Any] = {"context_tokens": ts.context_len}
    for name, examples in tasks.items():
        say(f"fidelity: recall probe {name} ({len(examples)} examples, {ts.context_len} tokens)")
        new = max(len(e.answer_ids) if e.answer_ids else len(tokenizer(" " + e.answer)["input_ids"]) + 1
                  for e in examples)
        prompts = np.asarray([e.prompt for e in examples], np.int64)  # every context has the same length
        with torch.no_grad():
            go = hf.generate(torch.from_numpy(prompts), attention_mask=torch.ones_like(torch.from_numpy(prompts)),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or 0)[:, prompts.shape[1]:]
        hits_o = hits_c = 0
        for k in range(0, len(examples), B):
            group = prompts[k : k + B]
            real = group.shape[0]
            if real < B:
                group = np.concatenate([group, np.repeat(group[-1:], B - real, 0)])
            got = gen.generate(group, np.ones_like(group), new, track_kept=False).tokens
            for j in range(real):
                e = examples[k + j]
                hits_o += prediction(tokenizer, e, go[k + j].tolist()) == e.answer
                hits_c += prediction(tokenizer, e, got[j].tolist()) == e.answer
        out[name] = {"original": hits_o / len(examples), "converted": hits_c / len(examples),
                     "examples": len(examples)}
    return out


def _gates(f: dict, min_agreement, max_ppl_increase) -> dict[str, Any]:
    g: dict[str, Any] = {"min_agreement": min_agreement, "max_ppl_increase": max_ppl_increase, "passed": None}
    if min_agreement is None and max_ppl_increase is None:
        return g
    if "skipped" in f:
        g["passed"], g["failed"] = False, f"not measured ({f['skipped']})"
        return g
    fails = []
    if min_agreement is not None and f["next_token_agreement"] < float(min_agreement):
        fails.append(f"next-token agreement {f['next_token_agreement']:.3f} < {float(min_agreement):g}")
    if max_ppl_increase is not None and f["ppl_increase"] > float(max_ppl_increase):
        fails.append(f"perplexity +{100 * f['ppl_increase']:.1f} % > +{100 * float(max_ppl_increase):g} %")
    g["passed"] = not fails
    if fails:
        g["failed"] = "; ".join(fails)
    return g
