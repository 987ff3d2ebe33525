# SPDX-License-Identifier: Apache-2.0
"""The lm-evaluation-harness adapter against the HF model: log-likelihoods, rolling perplexity, greedy
generation, and a whole offline lm-eval run on a local JSON multiple-choice task."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvexport.paths import DEFAULT_MODEL

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install 'kvexport[eval]')")
pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="bundled student not trained")

DOCS = [
    {"question": "def add(a, b):\n    return a", "choices": [" + b", " ]] b", " * 3"], "label": 0},
    {"question": "import os\nimport", "choices": [" sys", " 42", " (("], "label": 0},
    {"question": "for i in", "choices": [" range(10):", " if else", " ))"], "label": 0},
    {"question": "class Foo", "choices": ["(object):", " = = ", "]]"], "label": 1},
]


class Req:  # the one attribute the adapter reads from lm-eval's Instance
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def setup():
    from kvexport.eval.lm_eval_adapter import KVExportLM
    from kvexport.models.loading import load_hf_model

    return KVExportLM(pretrained=str(DEFAULT_MODEL)), load_hf_model(DEFAULT_MODEL)


def _hf_loglik(hf, tok, context, continuation):
    ctx = [tok.bos_token_id] + tok(context, add_special_tokens=False)["input_ids"]
    cont = tok(continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        lp = hf(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].log_softmax(-1)
    t = torch.tensor(cont)
    return lp.gather(-1, t[:, None]).sum().item(), bool((lp.argmax(-1) == t).all())


def test_loglikelihood_matches_hf(setup):
    lm, hf = setup
    reqs = [Req(d["question"], c) for d in DOCS for c in d["choices"]] + [Req("x = 1\n", "y = 2")]
    got = lm.loglikelihood(reqs)
    for r, (ll, greedy) in zip(reqs, got, strict=True):
        ctx, cont = r.args
        n = len(ctx) - len(ctx.rstrip())  # trailing whitespace moves to the continuation (lm-eval's HF rule)
        if n:
            ctx, cont = ctx[:-n], ctx[-n:] + cont
        ref_ll, ref_greedy = _hf_loglik(hf, lm.tokenizer, ctx, cont)
        assert ll == pytest.approx(ref_ll, abs=1e-3) and greedy == ref_greedy


def test_press_at_ratio_zero_equals_no_press(setup):
    from kvexport.eval.lm_eval_adapter import KVExportLM

    lm, _ = setup
    lm0 = KVExportLM(pretrained=str(DEFAULT_MODEL), press="knorm", ratio=0.0)
    lm5 = KVExportLM(pretrained=str(DEFAULT_MODEL), press="knorm", ratio=0.5)
    reqs = [Req(d["question"] * 3, c) for d in DOCS for c in d["choices"]]
    a, b, c = lm.loglikelihood(reqs), lm0.loglikelihood(reqs), lm5.loglikelihood(reqs)
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-3)
    assert [x[0] for x in a] != pytest.approx([x[0] for x in c], abs=1e-3)  # eviction changes the scores


def test_rolling_matches_hf(setup):
    """One window: Σ log p of every token from BOS. Several windows (max_length 16): lm-eval's disjoint windows."""
    from lm_eval import utils

    from kvexport.eval.lm_eval_adapter import KVExportLM

    lm, hf = setup
    text = "def main():\n    print('hello')\n    return 0\n"
    ids = lm.tok_encode(text)
    with torch.no_grad():
        lp = hf(torch.tensor([[lm.prefix_token] + ids])).logits[0, :-1].log_softmax(-1)
    ref = lp.gather(-1, torch.tensor(ids)[:, None]).sum().item()
    assert lm.loglikelihood_rolling([Req(text)])[0] == pytest.approx(ref, abs=1e-3)
    short = KVExportLM(pretrained=str(DEFAULT_MODEL), max_length=16)
    total = 0.0
    for c, t in map(utils.make_disjoint_window, utils.get_rolling_token_windows(ids, lm.prefix_token, 16, 1)):
        with torch.no_grad():
            lp = hf(torch.tensor([list(c) + list(t)])).logits[0, len(c) - 1 : -1].log_softmax(-1)
        total += lp.gather(-1, torch.tensor(t)[:, None]).sum().item()
    assert short.loglikelihood_rolling([Req(text)])[0] == pytest.approx(total, abs=1e-3)


def test_generate_until_matches_hf_greedy(setup):
    lm, hf = setup
    tok = lm.tokenizer
    ctx = "import os\n\n\ndef "
    out = lm.generate_until([Req(ctx, {"until": ["\n\n"], "max_gen_toks": 12})])[0]
    ids = torch.tensor([[tok.bos_token_id] + tok(ctx, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in ref:
        ref = ref[: ref.index(tok.eos_token_id)]
    assert out == tok.decode(ref, skip_special_tokens=True).split("\n\n")[0]


def test_offline_lm_eval_run_on_local_json_task(setup, tmp_path, monkeypatch):
    """``lm_eval.simple_evaluate`` with model "kvexport" on a local JSON task: acc = argmax of HF log-likelihoods."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    import kvexport.eval.lm_eval_adapter  # noqa: F401 - registers "kvexport"

    _, hf = setup
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "kvx_local.yaml").write_text(
        "task: kvx_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    res = lm_eval.simple_evaluate(model="kvexport", model_args=f"pretrained={DEFAULT_MODEL}", tasks=["kvx_local"],
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    from kvexport.models.loading import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    # lm-eval joins question and choice with target_delimiter " " (choices keep their own leading spaces)
    ref = sum(
        max(range(len(d["choices"])), key=lambda i: _hf_loglik(hf, tok, d["question"], " " + d["choices"][i])[0])
        == d["label"]
        for d in DOCS
    ) / len(DOCS)
    assert res["results"]["kvx_local"]["acc,none"] == pytest.approx(ref)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
