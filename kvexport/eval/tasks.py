# SPDX-License-Identifier: Apache-2.0
"""The task set behind "accuracy" in the MLA and combination studies: one held-out language-modelling task
and three long-range recall tasks, all built offline from the held-out stdlib split and fixed templates.

Every example is a *context* of exactly ``context_len`` tokens that is prefilled into the cache (and
compressed there when a press is given, once, after prefill), followed by a continuation:

- ``next_token``: held-out windows of ``context_len + future_len + 1`` tokens; the ``future_len`` tokens
  after the context are fed teacher-forced; score = fraction of those steps whose argmax is the true next
  token (top-1 next-token accuracy).
- ``code_recall``: Python code. Three lines bind fresh names to random 5-digit integers
  (``buffer_limit = 48213``), held-out stdlib code follows as filler, and the context ends with one of the
  names again: ``\\nbuffer_limit =``. Greedy generation must produce the bound value.
- ``passkey``: the passkey test (Mohtashami & Jaggi, 2023, "Landmark Attention") as a Python comment
  block: filler sentences, ``# The pass key is 71432. Remember it. 71432 is the pass key.`` in the first
  half, more filler, then ``# What is the pass key? The pass key is``.
- ``span_recall``: held-out code whose last ``SPAN_CUE`` tokens repeat a span from its first half (the
  only earlier occurrence of those tokens); greedy generation must continue with the ``SPAN_ANSWER``
  tokens that followed the span there. Copying a passage seen far back, the form of recall that small
  models trained on little text (the bundled references) can do at all.

Recall scoring is exact match. Code recall and passkey: :func:`extract_answer` takes the generated text,
drops leading whitespace and keeps the leading run of ``[0-9]``; the example scores 1 iff that equals the
answer. Span recall: the text of the first ``SPAN_ANSWER`` generated tokens must equal the answer's text.
Contexts are token-exact: the pieces (header, filler, query) are tokenized separately and concatenated,
filler cut at a token so that every context has exactly ``context_len`` tokens (no padding, one
budget per batch). Seeds fix names, values, depths and filler offsets.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

import torch

from kvexport.errors import BadUsage

TASKS = ("next_token", "code_recall", "passkey", "span_recall")
#: span_recall: tokens of the repeated cue that ends the context, and tokens to reproduce after it
SPAN_CUE, SPAN_ANSWER = 16, 8

WORDS = (
    "buffer", "limit", "retry", "offset", "width", "depth", "timeout", "index", "count", "level", "weight", "scale",
    "quota", "margin", "port", "block", "chunk", "frame", "token", "batch", "window", "cursor", "packet", "record",
)
FILLER_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
)
_ANSWER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class TaskSettings:
    """context_len: tokens prefilled (and compressed); future_len: scored tokens of ``next_token``;
    n_next / n_recall: examples of the next-token task / of each recall task; batch: examples per forward."""

    context_len: int = 192
    future_len: int = 32
    n_next: int = 16
    n_recall: int = 32
    batch: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.context_len < 48:
            raise BadUsage(f"task context length {self.context_len} must be >= 48 tokens (room for filler)")
        if self.future_len < 1 or self.n_next < 1 or self.n_recall < 1 or self.batch < 1:
            raise BadUsage("future_len, n_next, n_recall and batch must be >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RecallExample:
    """prompt: exactly context_len token ids; answer: the digits to produce; kind: task name."""

    prompt: list[int]
    answer: str
    kind: str
    depth: float  # where the answer sits in the context, 0 = start, 1 = end
    answer_ids: tuple[int, ...] = ()  # span_recall: the tokens to reproduce (scored on their text)


def extract_answer(generated: str) -> str:
    """Generated text -> the prediction: leading whitespace dropped, then the leading run of digits ('' if none)."""
    m = _ANSWER.match(generated.lstrip())
    return m.group(0) if m else ""


def exact_match(generated: str, answer: str) -> bool:
    return extract_answer(generated) == answer


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _bos(tok) -> list[int]:
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def _fit(head: list[int], filler: list[int], tail: list[int], n: int, what: str) -> list[int]:
    room = n - len(head) - len(tail)
    if room < 0 or len(filler) < room:
        raise BadUsage(f"{what}: context_len {n} leaves no room for filler (header {len(head)}, query {len(tail)} "
                       f"tokens, filler available {len(filler)})")
    return head + filler[:room] + tail


def code_recall_examples(tok, settings: TaskSettings, texts: list[str]) -> list[RecallExample]:
    """``settings.n_recall`` code-recall contexts from held-out ``texts`` (filler), seeded."""
    rng = random.Random(settings.seed * 1000 + 1)
    out = []
    pool = [t for t in texts if len(t) > 4000]
    for _ in range(settings.n_recall):
        names: list[str] = []
        while len(names) < 3:
            nm = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
            if nm not in names and nm.split("_")[0] != nm.split("_")[1]:
                names.append(nm)
        values = [str(rng.randint(10000, 99999)) for _ in names]
        target = rng.randrange(3)
        header = "".join(f"{n} = {v}\n" for n, v in zip(names, values, strict=True)) + "\n"
        text = rng.choice(pool)
        start = text.find("\n", rng.randrange(len(text) // 2)) + 1
        head = _bos(tok) + _ids(tok, header)
        tail = _ids(tok, f"\n{names[target]} =")
        prompt = _fit(head, _ids(tok, text[start:start + 6000]), tail, settings.context_len, "code_recall")
        depth = len(_bos(tok) + _ids(tok, "".join(f"{n} = {v}\n" for n, v in
                                                zip(names[: target + 1], values[: target + 1], strict=True))))
        out.append(RecallExample(prompt, values[target], "code_recall", depth / settings.context_len))
    return out


def passkey_examples(tok, settings: TaskSettings) -> list[RecallExample]:
    """``settings.n_recall`` passkey contexts (comment-block filler), the key in the first half, seeded."""
    rng = random.Random(settings.seed * 1000 + 2)
    out = []
    for _ in range(settings.n_recall):
        key = str(rng.randint(10000, 99999))
        filler = _ids(tok, "".join(f"# {rng.choice(FILLER_SENTENCES)}\n" for _ in range(settings.context_len)))
        needle = _ids(tok, f"# The pass key is {key}. Remember it. {key} is the pass key.\n")
        tail = _ids(tok, "\n# What is the pass key? The pass key is")
        head = _bos(tok)
        room = settings.context_len - len(head) - len(needle) - len(tail)
        if room < 8:
            raise BadUsage(f"passkey: context_len {settings.context_len} is too short for the needle and query")
        # the needle sits after a whole filler line, in the first half of the filler
        nl = _ids(tok, "\n")[-1]
        cut = max(0, int(rng.uniform(0.05, 0.5) * room))
        while cut > 0 and filler[cut - 1] != nl:
            cut -= 1
        prompt = head + filler[:cut] + needle + filler[cut:room] + tail
        out.append(RecallExample(prompt, key, "passkey", (len(head) + cut + len(needle)) / settings.context_len))
    return out


def _occurs(seq: list[int], sub: list[int]) -> int:
    """How many times ``sub`` occurs in ``seq`` (overlapping)."""
    n = len(sub)
    return sum(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


def span_recall_examples(tok, settings: TaskSettings, texts: list[str]) -> list[RecallExample]:
    """``settings.n_recall`` span-recall contexts from held-out ``texts``, seeded: the context is held-out code
    whose last SPAN_CUE tokens are a copy of a span in its first half, unique in the context; the answer is
    the SPAN_ANSWER tokens that followed that span."""
    rng = random.Random(settings.seed * 1000 + 3)
    C = settings.context_len
    body = C - len(_bos(tok)) - SPAN_CUE
    if body < SPAN_CUE + SPAN_ANSWER + 1:
        raise BadUsage(f"span_recall: context_len {C} is too short for a {SPAN_CUE}-token cue and its answer")
    hi = max(2, body // 2 - SPAN_CUE - SPAN_ANSWER)  # the span ends in the first half when there is room
    lo = min(max(1, int(0.05 * body)), hi - 1)
    pool = [t for t in texts if len(t) > 4000]
    out: list[RecallExample] = []
    for _ in range(100 * settings.n_recall):
        if len(out) == settings.n_recall:
            break
        text = rng.choice(pool)
        start = text.find("\n", rng.randrange(len(text) // 2)) + 1
        filler = _ids(tok, text[start : start + 6000])[:body]
        at = rng.randrange(lo, hi)
        cue, answer = filler[at : at + SPAN_CUE], filler[at + SPAN_CUE : at + SPAN_CUE + SPAN_ANSWER]
        if len(filler) < body or _occurs(filler, cue) != 1:
            continue  # short file, or an ambiguous cue (repeated code): draw again
        prompt = _bos(tok) + filler + cue
        depth = (len(_bos(tok)) + at + SPAN_CUE + SPAN_ANSWER) / C
        out.append(RecallExample(prompt, tok.decode(answer), "span_recall", depth, tuple(answer)))
    if len(out) < settings.n_recall:
        raise BadUsage(f"span_recall: found {len(out)} of {settings.n_recall} held-out spans whose "
                       f"{SPAN_CUE}-token cue is unique in its context; use fewer --n-recall examples")
    return out


def recall_examples(tok, settings: TaskSettings) -> dict[str, list[RecallExample]]:
    from kvexport.eval.data import heldout_texts

    texts = heldout_texts()
    return {"code_recall": code_recall_examples(tok, settings, texts),
            "passkey": passkey_examples(tok, settings),
            "span_recall": span_recall_examples(tok, settings, texts)}


def answer_tokens(tok, answer: str) -> int:
    """Tokens to generate for a numeric answer: its own tokens after a space, plus one (to see where it ends)."""
    return len(_ids(tok, " " + answer)) + 1


def _new_tokens(tok, e: RecallExample) -> int:
    return len(e.answer_ids) if e.answer_ids else answer_tokens(tok, e.answer)


def prediction(tok, e: RecallExample, generated: list[int]) -> str:
    """What an example's generated tokens answer: the text of the first len(answer_ids) tokens for a span,
    else :func:`extract_answer` of the generated text."""
    if e.answer_ids:
        return tok.decode(generated[: len(e.answer_ids)])
    return extract_answer(tok.decode(generated))


class TaskSet:
    """The built examples (token ids) of all four tasks, made once and scored for many models/caches."""

    def __init__(self, tok, settings: TaskSettings | None = None):
        from kvexport.eval.data import heldout_windows

        self.tok = tok
        self.settings = s = settings or TaskSettings()
        # next-token windows start 1 token in: a different grid than the press study's
        self.windows = heldout_windows(tok, s.n_next, s.context_len + s.future_len + 1, offset=1)
        if self.windows.shape[0] == 0:
            raise BadUsage("the held-out split is too short for one next-token window")
        self.recall = recall_examples(tok, s)

    def describe(self) -> dict:
        return {"tasks": list(TASKS), "settings": self.settings.to_dict(),
                "examples": {"next_token": int(self.windows.shape[0]) * self.settings.future_len,
                             **{k: len(v) for k, v in self.recall.items()}},
                "span_recall": {"cue_tokens": SPAN_CUE, "answer_tokens": SPAN_ANSWER},
                "accuracy": "mean of the four task scores (next-token top-1 accuracy; code_recall, passkey and "
                            "span_recall exact match)"}


@torch.no_grad()
def next_token_accuracy(decoder, windows: torch.Tensor, settings: TaskSettings, press=None) -> float:
    """windows (N, P+F+1) -> top-1 accuracy of the F teacher-forced next tokens after a (compressed) P-token context."""
    from kvexport.eval.press_study import run_window

    P, F = settings.context_len, settings.future_len
    hit, n = 0, 0
    for s in range(0, windows.shape[0], settings.batch):
        ids = windows[s : s + settings.batch]
        _, logits = run_window(decoder, ids, P, F, press)
        hit += (logits.argmax(-1) == ids[:, P + 1 : P + F + 1]).sum().item()
        n += ids.shape[0] * F
    return hit / n


@torch.no_grad()
def recall_accuracy(decoder, tok, examples: list[RecallExample], settings: TaskSettings, press=None,
                    return_predictions: bool = False):
    """Exact-match rate of greedy answers after a (compressed) context; with ``return_predictions`` also the
    extracted predictions."""
    from kvexport.generation import generate

    preds: list[str] = []
    hits = 0
    new = max(_new_tokens(tok, e) for e in examples)
    for s in range(0, len(examples), settings.batch):
        chunk = examples[s : s + settings.batch]
        ids = torch.tensor([e.prompt for e in chunk], dtype=torch.long)
        res = generate(decoder, ids, press=press, window=new + 1, max_new_tokens=new)
        for e, row in zip(chunk, res.tokens.tolist(), strict=True):
            p = prediction(tok, e, row)
            preds.append(p)
            hits += p == e.answer
    acc = hits / len(examples)
    return (acc, preds) if return_predictions else acc


def evaluate_tasks(decoder, taskset: TaskSet, press=None) -> dict:
    """-> {"next_token": acc, "code_recall": em, "passkey": em, "span_recall": em, "accuracy": mean of the four}."""
    s = taskset.settings
    out = {"next_token": next_token_accuracy(decoder, taskset.windows, s, press)}
    for k, ex in taskset.recall.items():
        out[k] = recall_accuracy(decoder, taskset.tok, ex, s, press)
    out["accuracy"] = sum(out[k] for k in TASKS) / len(TASKS)
    return out
