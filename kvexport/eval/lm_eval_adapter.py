# SPDX-License-Identifier: Apache-2.0
"""lm-evaluation-harness model ``kvexport``: score a kvexport model (HF directory or converted MLA directory),
optionally with a static-budget press, on any lm-eval task.

Needs the optional extra ``eval`` (``pip install 'kvexport[eval]'``, i.e. ``lm-eval``). Import this module
(or pass ``--include_path``-free ``lm_eval --model kvexport`` after ``import kvexport.eval.lm_eval_adapter``
in a wrapper) to register the model. Example, X-EcoMLA's nine tasks on a converted model::

    python -c "import kvexport.eval.lm_eval_adapter, lm_eval.__main__ as m; m.cli_evaluate()" \\
        --model kvexport --model_args pretrained=out/llama-mla,press=expected_attention,ratio=0.5 \\
        --tasks arc_challenge,arc_easy,hellaswag,mmlu,openbookqa,piqa,pubmedqa,race,winogrande

Model arguments: ``pretrained`` (directory), ``press`` / ``ratio`` / ``budget`` (eviction of the context after
prefill; none by default), ``max_length`` (default the model's max positions, capped at 4096), ``dtype``
(fp32/fp16/bf16), ``device`` (default cuda when available, else cpu; also the fallback for an unavailable cuda). Semantics per request type:

- ``loglikelihood(context, continuation)``: context tokens are prefilled (compressed by the press, once), the
  continuation is fed teacher-forced; returns (Σ log p(continuation), whether every token was the argmax).
  Trailing spaces of the context move to the continuation (lm-eval's HF convention). Without a press this
  is one plain forward over context + continuation.
- ``loglikelihood_rolling(text)``: lm-eval's disjoint rolling windows of ``max_length`` tokens, the first
  one predicted from the BOS (or EOS) token; returns the summed log-likelihood.
- ``generate_until(context, {until, max_gen_toks})``: greedy decoding with :func:`kvexport.generation.generate`
  (static cache, press applied to the context), cut at the first stop string.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.errors import BadUsage


@register_model("kvexport")
class KVExportLM(LM):
    """lm-eval model over a kvexport :class:`~kvexport.models.decoder.Decoder` (GQA or MLA)."""

    def __init__(self, pretrained: str, press: str | None = None, ratio: float | None = None,
                 budget: int | None = None, window: int = DEFAULT_WINDOW, max_length: int | None = None, dtype: str = "fp32",
                 device: str | None = None, batch_size: int | str = 1, max_gen_toks: int = 256, **kwargs):
        super().__init__()
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's CLI asks for cuda by default
        from kvexport.mla.io import load_decoder
        from kvexport.models.loading import load_tokenizer
        from kvexport.presses import build_press

        self.decoder, _ = load_decoder(pretrained, dtype)
        self.decoder.to(device).eval()
        self.tokenizer = load_tokenizer(pretrained)
        if self.tokenizer is None:
            raise BadUsage(f"{pretrained} has no tokenizer; lm-eval needs text in and out")
        self.press = build_press(press, int(budget) if budget is not None else None,
                                 float(ratio) if ratio is not None else None)
        self.window = int(window)
        self.max_gen_toks = int(max_gen_toks)
        self._device = torch.device(device)
        spec = self.decoder.spec
        self.max_length = int(max_length) if max_length else min(spec.max_position_embeddings, 4096)
        tok = self.tokenizer
        self.prefix_token = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if self.prefix_token is None:
            raise BadUsage(f"{pretrained}'s tokenizer has neither a BOS nor an EOS token to start texts with")

    # ------------------------------------------------------------------ helpers
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.prefix_token

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_space = len(context) - len(context.rstrip())
        if n_space:
            continuation, context = context[-n_space:] + continuation, context[:-n_space]
        ctx = [self.prefix_token] + self.tok_encode(context)
        return ctx, self.tok_encode(continuation)

    @torch.no_grad()
    def _logprobs(self, ctx: list[int], cont: list[int]) -> torch.Tensor:
        """-> (len(cont), V) log-probabilities predicting each continuation token (context compressed by the
        press after prefill, continuation teacher-forced)."""
        total = ctx + cont
        if len(total) > self.max_length + 1:  # keep the end: the continuation and as much context as fits
            total = total[-(self.max_length + 1):]
            ctx = total[: len(total) - len(cont)]
        if not ctx:
            raise BadUsage(f"continuation of {len(cont)} tokens does not fit max_length {self.max_length}")
        dev = self._device
        if self.press is None:
            x = torch.tensor([total[:-1]], device=dev)
            pos = torch.arange(x.shape[1], device=dev)[None]
            logits = self.decoder(x, pos, None)[0, len(ctx) - 1:]
        else:  # the context compressed after its prefill, the continuation forced; its cache has len(cont) + 1 slots
            from kvexport.runtime.loop import generate
            from kvexport.runtime.torch_driver import TorchDriver

            driver = TorchDriver(self.decoder, self.press, window=len(cont) + 1)
            res = generate(driver, [ctx], max_new_tokens=len(cont), forced_tokens=[cont], keep_logits=True)
            logits = torch.cat([res.prompt_logits, *res.step_logits])
        return logits.float().log_softmax(-1)

    def _score(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        lp = self._logprobs(ctx, cont)
        target = torch.tensor(cont, device=lp.device)
        return lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())

    # ------------------------------------------------------------------ lm-eval API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args[:2]
            res = self._score(*self._encode_pair(context, continuation))
            out.append(res)
            self.cache_hook.add_partial("loglikelihood", (context, continuation), res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        out = []
        for req in requests:
            (text,) = req.args[:1]
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token, max_seq_len=self.max_length,
                context_len=1))
            total = sum(self._score(list(c), list(t))[0] for c, t in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from kvexport.generation import generate

        out = []
        for req in requests:
            context, kw = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            ids = [self.prefix_token] + self.tok_encode(context)
            ids = ids[-max(1, self.max_length - n_new):]
            res = generate(self.decoder, torch.tensor([ids], device=self._device), press=self.press,
                           window=max(self.window, 1), max_new_tokens=n_new, eos_token_id=self.eot_token_id)
            toks = [t for t in res.tokens[0].tolist()]
            if self.eot_token_id in toks:
                toks = toks[: toks.index(self.eot_token_id)]
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            for s in until:
                if s and s in text:
                    text = text.split(s)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, kw), text)
        return out
