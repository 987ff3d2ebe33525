# SPDX-License-Identifier: Apache-2.0
"""Shared CLI pieces: model argument resolution, press options, prompt encoding, consoles.

Imports nothing heavy at module level: ``kvexport --help`` loads this module (torch is imported by the
functions that need it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvexport.errors import BadUsage

if TYPE_CHECKING:
    import torch

PRESS_HELP = (
    "Eviction press: streaming_llm, knorm, keydiff, tova, snapkv, pyramidkv, expected_attention, "
    "observed_attention, random ('optimal' needs future queries: evaluation only); 'none' keeps every token."
)


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> left-padded input_ids, attention_mask (B, N)."""
    import torch

    if not prompts:
        raise BadUsage("no --prompt given")
    if tokenizer is None:
        raise BadUsage("this model directory has no tokenizer; kvexport needs tokenizer.json beside the weights")
    seqs = []
    for p in prompts:
        if not p.strip():
            raise BadUsage("the prompt is empty; give some text")
        ids = tokenizer(p, add_special_tokens=True, verbose=False)["input_ids"]  # no warning past model_max_length
        if not ids:
            raise BadUsage(f"the prompt {p[:30]!r} encodes to no tokens")
        seqs.append(ids)
    n = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (n - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
    return input_ids, mask


def read_prompt_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise BadUsage(f"prompt file {path} does not exist") from None
    except UnicodeDecodeError:
        raise BadUsage(f"prompt file {path} is not UTF-8 text") from None


def cache_summary(resident: dict[str, int]) -> str:
    """The generate commands' memory line from a run's ``resident_bytes``: the cache as stored (K/V or latent, plus
    the scales of an int8 / fp8 cache) and every byte the sequence keeps resident."""
    kv, scales = resident["kv"] / 1024, resident.get("scales", 0) / 1024
    parts = f" (K/V {kv:.1f} + scales {scales:.1f})" if scales else ""
    return f"cache {kv + scales:.1f} KiB{parts}, {resident['total'] / 1024:.1f} KiB resident"

NEIGHBORS_HELP = "A kept token keeps this many neighbours on each side (ScorerPress.neighbors; 0: the press's own ranking)."
LOOKAHEAD_HELP = ("The prompt's last L tokens observe every earlier prefill chunk (kvexport.cache.plan rule 3b; 0: each "
                  "chunk observes itself). A press that observes, with --chunk.")


def print_completions(console, prompts: list[str], texts: list[str]) -> None:
    """One line per prompt, ``'prompt' -> 'completion'`` (Python reprs), never wrapped (a pipe or a file gets the
    line whole, whatever its length) and never read as markup (a completion may hold ``[i]`` or ``[/]``)."""
    from rich.markup import escape

    for p, text in zip(prompts, texts, strict=True):
        console.print(f"[bold]{escape(repr(p[:60]))}[/] -> {escape(repr(text))}", highlight=False, soft_wrap=True)
