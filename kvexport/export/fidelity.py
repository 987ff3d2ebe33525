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

import inspect
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import BadArtifact, BadUsage
from kvexport.export.spill import SpilledArrays


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


class FidelityRun:
    """The fidelity check in two halves that never share memory: :meth:`candidate` runs the export on every
    window and recall prompt, :meth:`original` then loads the original model alone, runs it on the same inputs and
    releases it, and :meth:`report` scores the two (the caller closes the export's sessions in between, so the
    export's weights and the original's are never resident together)."""

    def __init__(self, path, settings: dict, tokenizer, original=None, eval_data=None,
                 fidelity: FidelitySettings | None = None, progress=None):
        self.say = progress or (lambda msg: None)
        self.st = st = fidelity or FidelitySettings()
        self.s = settings
        self.tokenizer = tokenizer
        self.orig_dir = find_original(path, settings, original)
        self.out: dict[str, Any] = {"reference": "original model (transformers, full cache)", "settings": asdict(st)}
        if self.orig_dir is None:
            self.out["skipped"] = ("the original model is unknown (the export's source is an MLA directory that "
                                   "does not name it); pass --original DIR")
            return
        self.out["original"] = str(self.orig_dir)
        vocab = _config_vocab(self.orig_dir)
        if vocab is not None and vocab != int(settings["vocab_size"]):
            raise BadArtifact(f"the original model {self.orig_dir} has {vocab} tokens, the export "
                              f"{settings['vocab_size']}; pass the model it was converted from with --original")
        self.P = st.prefix or default_prefix(settings, st.scored)
        self.T = st.scored
        stream, self.out["eval_data"] = eval_stream(tokenizer, eval_data, st.seed, int(settings["vocab_size"]),
                                                    self.P + self.T + 1)
        self.wins = _windows(stream, st.sequences, self.P + self.T + 1)
        self.B = int(settings["batch"])
        self.tasks, self.recall_skipped = _recall_tasks(tokenizer, self.P, st)
        self.cand_logits = SpilledArrays("kvexport-fidelity-")  # on disk until the original's are there
        self.cand_recall: dict[str, list[list[int]]] = {}
        self.orig_logits: list[np.ndarray] = []
        self.orig_recall: dict[str, list[list[int]]] = {}

    def _groups(self):
        """(start, real, group) over the windows, each group filled to the export's static batch."""
        for start in range(0, self.wins.shape[0], self.B):
            group = self.wins[start : start + self.B]
            while group.shape[0] < self.B:  # the export's static batch: repeat the last window, scored once
                group = np.concatenate([group, group[-1:]])
            yield start, min(self.B, self.wins.shape[0] - start), group

    def candidate(self, gen) -> None:
        """The export's logits on every window (prefill P, then T teacher-forced steps) and its greedy answers to
        the recall prompts."""
        self.out["candidate"] = f"{getattr(gen, 'backend', 'onnxruntime')}:{gen.providers[0]}"
        if "skipped" in self.out:
            return
        P, T, B = self.P, self.T, self.B
        for start, real, group in self._groups():
            self.say(f"fidelity: text {start + 1}-{start + real}/{self.wins.shape[0]} ({P} + {T} tokens), export")
            res = gen.generate(group[:, :P], np.ones((B, P), np.int64), T, forced_tokens=group[:, P : P + T],
                               keep_logits=True, track_kept=False)
            self.cand_logits.append(
                np.stack([np.asarray(res.prompt_logits)] + [np.asarray(x) for x in res.step_logits], 1)[:real, :T])
        for name, (examples, prompts, new) in self.tasks.items():
            self.say(f"fidelity: recall probe {name} ({len(examples)} examples, {prompts.shape[1]} tokens), export")
            got: list[list[int]] = []
            for k in range(0, len(examples), B):
                group = prompts[k : k + B]
                real = group.shape[0]
                if real < B:
                    group = np.concatenate([group, np.repeat(group[-1:], B - real, 0)])
                got += [list(map(int, row)) for row in gen.generate(group, np.ones_like(group), new,
                                                                    track_kept=False).tokens[:real]]
            self.cand_recall[name] = got

    def original(self) -> None:
        """The original model, loaded now in fp32 and released before returning: its logits on the same windows
        and its greedy answers to the same recall prompts."""
        if "skipped" in self.out:
            return
        import torch

        from kvexport.models.loading import load_hf_model
        from kvexport.models.release import free_memory

        self.say("fidelity: loading the original model")
        hf = load_hf_model(self.orig_dir, "fp32")
        if int(hf.config.vocab_size) != int(self.s["vocab_size"]):
            raise BadArtifact(f"the original model {self.orig_dir} has {hf.config.vocab_size} tokens, the export "
                              f"{self.s['vocab_size']}; pass the model it was converted from with --original")
        P, T = self.P, self.T
        try:
            for start, real, group in self._groups():
                self.say(f"fidelity: text {start + 1}-{start + real}/{self.wins.shape[0]} ({P} + {T} tokens), "
                         "original")
                ids = torch.from_numpy(group[:real, : P + T])
                with torch.no_grad():  # the prefix in chunks, then the scored positions' logits only
                    cache = _prefill_chunks(hf, ids[:, : P - 1])
                    lo = hf(ids[:, P - 1 : P + T - 1], use_cache=True, **{_cache_kw(hf): cache}).logits
                self.orig_logits.append(lo.float().numpy())
                cache = lo = None
            pad = getattr(self.tokenizer, "pad_token_id", None) or 0
            for name, (examples, prompts, new) in self.tasks.items():
                self.say(f"fidelity: recall probe {name} ({len(examples)} examples), original")
                t = torch.from_numpy(prompts)
                with torch.no_grad():  # generate goes on from a cache of the prompt but its last token
                    go = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=pad,
                                     **{_cache_kw(hf): _prefill_chunks(hf, t[:, :-1])})[:, prompts.shape[1]:]
                self.orig_recall[name] = go.tolist()
        finally:
            hf = None  # noqa: F841
            free_memory()

    def report(self, min_agreement: float | None = None, max_ppl_increase: float | None = None) -> dict[str, Any]:
        """The fidelity section of parity.json from both halves' outputs."""
        out = dict(self.out)
        if "skipped" not in out:
            agree = n = 0
            kl_sum = ce_o = ce_c = 0.0
            for (_, real, group), lo, lc in zip(self._groups(), self.orig_logits, self.cand_logits, strict=True):
                target = group[:real, self.P : self.P + self.T]
                la, lb = _log_softmax(lo), _log_softmax(lc)
                agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
                n += target.size
                kl_sum += float((np.exp(la) * (la - lb)).sum(-1).sum())
                ce_o -= float(np.take_along_axis(la, target[..., None], -1).sum())
                ce_c -= float(np.take_along_axis(lb, target[..., None], -1).sum())
            ppl_o, ppl_c = float(np.exp(ce_o / n)), float(np.exp(ce_c / n))
            out.update({"prefix_tokens": self.P, "scored_tokens": int(n), "sequences": int(self.wins.shape[0]),
                        "next_token_agreement": agree / n, "mean_kl": kl_sum / n, "ppl_original": ppl_o,
                        "ppl_converted": ppl_c, "ppl_increase": ppl_c / ppl_o - 1.0})
            out["recall"] = self._recall_report()
        out["gates"] = _gates(out, min_agreement, max_ppl_increase)
        from kvexport.export.quality import quality_verdict

        out["quality"] = quality_verdict(out)
        return out

    def _recall_report(self) -> dict[str, Any]:
        if self.recall_skipped is not None:
            return {"skipped": self.recall_skipped}
        from kvexport.eval.tasks import prediction

        out: dict[str, Any] = {"context_tokens": self.recall_context}
        for name, (examples, _, _) in self.tasks.items():
            hits_o = sum(prediction(self.tokenizer, e, g) == e.answer for e, g in zip(examples, self.orig_recall[name],
                                                                                     strict=True))
            hits_c = sum(prediction(self.tokenizer, e, g) == e.answer for e, g in zip(examples, self.cand_recall[name],
                                                                                     strict=True))
            out[name] = {"original": hits_o / len(examples), "converted": hits_c / len(examples),
                         "examples": len(examples)}
        return out

    @property
    def recall_context(self) -> int:
        return max(48, self.P)


#: tokens per forward when the original model reads a long prefix: its eager attention holds (heads x chunk x
#: keys) floats per call instead of (heads x prefix x prefix), 0.64 GB per window at SmolLM2's 4.2k-token default
PREFILL_CHUNK = 512


def _prefill_chunks(hf, ids, chunk: int = PREFILL_CHUNK):
    """A transformers cache of ``ids`` (B, N) read by ``hf`` ``chunk`` tokens at a time (only each chunk's last
    logits computed): the same keys and values as one forward over ``ids``, a bounded transient."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
    for s in range(0, ids.shape[1], chunk):
        hf(ids[:, s : s + chunk], use_cache=True, **last, **{_cache_kw(hf): cache})
    return cache


def _cache_kw(hf) -> str:
    """What transformers calls a model's cache argument: ``cache`` from 5.x's rename on, ``past_key_values``
    before it (forward and generate alike)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def measure_fidelity(path, gen, tokenizer, original=None, eval_data=None, settings: FidelitySettings | None = None,
                     min_agreement: float | None = None, max_ppl_increase: float | None = None,
                     progress=None) -> dict[str, Any]:
    """The fidelity section of parity.json for the export at ``path`` run by ``gen`` (a step generator), in one
    call (:class:`FidelityRun`'s halves in turn, ``gen`` kept open; :func:`kvexport.export.validation.validate`
    closes its sessions between them)."""
    run = FidelityRun(path, gen.settings, tokenizer, original, eval_data, settings, progress)
    run.candidate(gen)
    run.original()
    return run.report(min_agreement, max_ppl_increase)


def _config_vocab(model_dir: Path) -> int | None:
    """config.json's vocab_size, read before anything is loaded (None where the file does not say)."""
    import json

    try:
        v = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(v) if isinstance(v, int) else None


def _recall_tasks(tokenizer, context: int, st: FidelitySettings):
    """({task: (examples, prompts (N, context) int64, new tokens)}, None) for span_recall and passkey at
    ``context`` tokens, or ({}, why the probe is skipped)."""
    if st.recall == 0:
        return {}, "recall probe off (recall=0)"
    if tokenizer is None:
        return {}, "the export has no tokenizer; the recall probe builds its contexts from text"
    from kvexport.eval.data import heldout_texts
    from kvexport.eval.tasks import TaskSettings, passkey_examples, span_recall_examples

    ts = TaskSettings(context_len=max(48, context), n_recall=st.recall, seed=st.seed)
    try:
        tasks = {"span_recall": span_recall_examples(tokenizer, ts, heldout_texts()),
                 "passkey": passkey_examples(tokenizer, ts)}
    except BadUsage as e:
        return {}, f"recall probe: {e}"
    out = {}
    for name, examples in tasks.items():
        new = max(len(e.answer_ids) if e.answer_ids else len(tokenizer(" " + e.answer)["input_ids"]) + 1
                  for e in examples)
        out[name] = (examples, np.asarray([e.prompt for e in examples], np.int64), new)  # one length per task
    return out, None


def gate_failure(fid: dict[str, Any] | None) -> str | None:
    """parity.json's ``fidelity`` -> one line naming the gate that failed (``--min-agreement``,
    ``--max-ppl-increase``), or None when none did (the gates themselves: :func:`_gates`)."""
    if not isinstance(fid, dict):
        return None
    g = fid.get("gates") or {}
    if g.get("passed") is not False:
        return None
    why = []
    if g.get("min_agreement") is not None and fid.get("next_token_agreement", 1.0) < g["min_agreement"]:
        why.append(f"next-token agreement {_pct(fid['next_token_agreement'])} < --min-agreement "
                   f"{g['min_agreement']:g}")
    if g.get("max_ppl_increase") is not None and fid.get("ppl_increase", 0.0) > g["max_ppl_increase"]:
        why.append(f"perplexity {_pct(fid['ppl_increase'], signed=True)} > --max-ppl-increase "
                   f"{g['max_ppl_increase']:g}")
    return "fidelity gate failed: " + ("; ".join(why) or "see the fidelity block of parity.json")


def _pct(v, signed: bool = False) -> str:
    return f"{100 * float(v):+.1f} %" if signed else f"{100 * float(v):.1f} %"


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
