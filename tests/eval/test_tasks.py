# SPDX-License-Identifier: Apache-2.0
"""The task set: exact-match scoring on hand-built cases, example construction, and the scores against HF."""

from __future__ import annotations

import pytest
import torch

from kvexport.eval.tasks import (
    SPAN_ANSWER,
    SPAN_CUE,
    TASKS,
    TaskSet,
    TaskSettings,
    evaluate_tasks,
    exact_match,
    extract_answer,
    next_token_accuracy,
    recall_accuracy,
)
from kvexport.paths import DEFAULT_MODEL

needs_student = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="bundled student not trained")


@pytest.mark.parametrize(
    ("generated", "answer", "pred", "hit"),
    [
        (" 48213\n", "48213", "48213", True),
        ("48213.", "48213", "48213", True),
        ("\n  07 is it", "07", "07", True),
        (" 4821", "48213", "4821", False),  # too short
        (" 482130", "48213", "482130", False),  # too long: exact, not prefix
        (" x 48213", "48213", "", False),  # the answer must come first
        ("", "1", "", False),
        (" -48213", "48213", "", False),
    ],
)
def test_exact_match_hand_built(generated, answer, pred, hit):
    assert extract_answer(generated) == pred
    assert exact_match(generated, answer) is hit


@pytest.fixture(scope="module")
def student():
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import load_hf_model, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    dec, _ = load_decoder(DEFAULT_MODEL)
    return tok, dec, load_hf_model(DEFAULT_MODEL)


SMALL = TaskSettings(context_len=64, future_len=6, n_next=3, n_recall=4, batch=4, seed=3)


@needs_student
def test_examples_are_exact_deterministic_and_hold_the_answer(student):
    tok = student[0]
    a, b = TaskSet(tok, SMALL), TaskSet(tok, SMALL)
    assert torch.equal(a.windows, b.windows) and a.windows.shape == (3, 64 + 6 + 1)
    other = TaskSet(tok, TaskSettings(**{**SMALL.to_dict(), "seed": 4}))
    for kind in ("code_recall", "passkey", "span_recall"):
        ex = a.recall[kind]
        assert [e.prompt for e in ex] == [e.prompt for e in b.recall[kind]]
        assert [e.answer for e in ex] != [e.answer for e in other.recall[kind]]
        for e in ex:
            assert len(e.prompt) == 64 and e.prompt[0] == tok.bos_token_id
            text = tok.decode(e.prompt)
            assert e.answer in text and (kind == "span_recall" or len(e.answer) == 5)
            assert 0 < e.depth < 0.7  # the answer sits well before the query
    for e in a.recall["span_recall"]:
        cue, ans = e.prompt[-SPAN_CUE:], list(e.answer_ids)
        assert len(ans) == SPAN_ANSWER and tok.decode(ans) == e.answer
        hits = [i for i in range(len(e.prompt) - SPAN_CUE) if e.prompt[i : i + SPAN_CUE] == cue]
        assert len(hits) == 1  # the cue's one earlier occurrence, in the first half, followed by the answer
        i = hits[0]
        assert i < 32 and e.prompt[i + SPAN_CUE : i + SPAN_CUE + SPAN_ANSWER] == ans
    code = tok.decode(a.recall["code_recall"][0].prompt)
    name = code.rsplit("\n", 1)[1].removesuffix(" =")
    assert f"{name} = {a.recall['code_recall'][0].answer}\n" in code  # the query names a bound variable
    assert tok.decode(a.recall["passkey"][0].prompt).endswith("The pass key is")


@needs_student
def _hf_greedy(hf, tok, examples, new: int) -> list[list[int]]:
    """HF greedy decoding of ``new`` tokens after each example's prompt -> the generated ids per example."""
    ids = torch.tensor([e.prompt for e in examples])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=tok.pad_token_id)
    return out[:, ids.shape[1]:].tolist()


def test_scores_match_hf(student):
    """Without a press: next-token accuracy = HF argmax accuracy; recall predictions = HF greedy decoding."""
    tok, dec, hf = student
    ts = TaskSet(tok, SMALL)
    P, F = SMALL.context_len, SMALL.future_len
    with torch.no_grad():
        logits = hf(ts.windows[:, : P + F]).logits[:, P:]
    ref = (logits.argmax(-1) == ts.windows[:, P + 1 :]).float().mean().item()
    assert next_token_accuracy(dec, ts.windows, SMALL) == pytest.approx(ref)
    ex = ts.recall["code_recall"]
    acc, preds = recall_accuracy(dec, tok, ex, SMALL, return_predictions=True)
    new = max(len(tok(" " + e.answer, add_special_tokens=False)["input_ids"]) + 1 for e in ex)
    assert preds == [extract_answer(tok.decode(r)) for r in _hf_greedy(hf, tok, ex, new)]
    assert acc == sum(p == e.answer for p, e in zip(preds, ex, strict=True)) / len(ex)
    scores = evaluate_tasks(dec, ts)
    assert scores["accuracy"] == pytest.approx(sum(scores[k] for k in TASKS) / 4)
    # span recall: the text of the first SPAN_ANSWER greedy tokens, as HF decodes them
    ex = ts.recall["span_recall"]
    acc, preds = recall_accuracy(dec, tok, ex, SMALL, return_predictions=True)
    assert preds == [tok.decode(r) for r in _hf_greedy(hf, tok, ex, SPAN_ANSWER)]
    assert acc == sum(p == e.answer for p, e in zip(preds, ex, strict=True)) / len(ex)
