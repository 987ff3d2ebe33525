# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the hardening tests: one tiny model directory (random Llama + a tiny byte-level BPE tokenizer),
one MLA rewrite of it and two tiny exports, each made once per session; helpers that run the real CLI."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kvexport.cli import main

VOCAB = 320
#: stderr lines that are progress output of transformers/torch, not kvexport messages
NOISE = re.compile(r"Loading weights|Writing model shards|torchvision|^W\d{4} ")
#: the static export every test shares: StreamingLLM, budget 16, window 8, chunk 8
EXPORT_ARGS = ["--press", "streaming_llm", "--budget", "16", "--window", "8", "--chunk", "8"]
TEXT = ("The quick brown fox jumps over the lazy dog. Static caches keep a fixed number of tokens; "
        "presses score every cached token and keep the best. ") * 20


def make_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer with a few hundred tokens, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.save_pretrained(str(out))


def make_model_dir(out: Path, vocab: int = VOCAB, max_positions: int = 32768, seed: int = 0) -> Path:
    from kvexport.models.tiny import tiny_model

    tiny_model("llama", seed=seed, vocab_size=vocab, max_positions=max_positions, head_dim=16,
               hidden_size=64).save_pretrained(out)
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, 4 heads / 2 KV heads, head_dim 16, 32768 positions) with a tokenizer."""
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def export_dir(model_dir, tmp_path_factory) -> Path:
    """`kvexport export` of model_dir with EXPORT_ARGS (a static cache of 16 + 8 slots per layer)."""
    out = tmp_path_factory.mktemp("export") / "x"
    assert main(["export", str(model_dir), "--out", str(out), *EXPORT_ARGS]) == 0
    return out


@pytest.fixture(scope="session")
def full_export_dir(model_dir, tmp_path_factory) -> Path:
    """A full-cache export (no press) with a 24-token capacity: longer prompts must be refused."""
    out = tmp_path_factory.mktemp("export") / "full"
    assert main(["export", str(model_dir), "--out", str(out), "--chunk", "8", "--max-positions", "24"]) == 0
    return out


@pytest.fixture(scope="session")
def mla_dir(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mla") / "m"
    assert main(["rewrite", str(model_dir), "--out", str(out), "--mla-rank", "16", "--rope-dim", "8"]) == 0
    return out


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def messages(err: str) -> list[str]:
    """kvexport's own stderr lines (progress bars and torch warnings dropped)."""
    return [ln for ln in err.splitlines() if ln.strip() and not NOISE.search(ln)]


def run_cli(args, capsys) -> tuple[int, list[str]]:
    """Run ``kvexport ARGS`` in-process; -> (exit code, kvexport's stderr lines). Asserts there is no traceback."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, messages(err)


def leftovers(parent: Path, name: str) -> list[str]:
    """Temporary siblings (``.NAME.*``) that an interrupted or failed writer left behind."""
    return sorted(p.name for p in Path(parent).glob(f".{name}.*"))
