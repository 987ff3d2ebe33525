# SPDX-License-Identifier: Apache-2.0
"""Offline fixtures for distillation tests: a tiny BPE tokenizer trained on the fly, text, tiny model dirs."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the cache keeps a small latent for every token and the heads read it back . a press scores tokens "
         "and the budget stays fixed while the model decodes ; keys values queries rotate by position").split()


def make_text(n_words: int, seed: int) -> str:
    """Deterministic word salad with some structure (bigram-ish: each word prefers a few successors)."""
    rng = random.Random(seed)
    out, w = [], WORDS[0]
    for _ in range(n_words):
        out.append(w)
        w = WORDS[(WORDS.index(w) + rng.choice((1, 1, 2, 5))) % len(WORDS)] if rng.random() < 0.8 else rng.choice(WORDS)
    return " ".join(out)


def save_tokenizer(directory: Path, vocab_size: int = 128) -> None:
    """Train a BPE tokenizer (whitespace pre-tokenizer) with ``vocab_size`` entries and save it HF-style."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([make_text(3000, 99)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(directory))


def model_dir(directory: Path, family: str = "llama", seed: int = 0, **kw) -> Path:
    from kvexport.models.tiny import tiny_model

    tiny_model(family, seed=seed, **kw).save_pretrained(str(directory))
    save_tokenizer(directory)
    return directory


def student_and_teacher(teacher_dir):
    """(MLA student rewritten at r_kv 12, d_rope 8, teacher Decoder) from a teacher directory."""
    from kvexport.mla import MLASettings, rewrite_to_mla
    from kvexport.mla.io import load_decoder

    teacher, _ = load_decoder(teacher_dir)
    return rewrite_to_mla(teacher, MLASettings(kv_rank=12, rope_dim=8)), teacher
