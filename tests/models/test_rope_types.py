# SPDX-License-Identifier: Apache-2.0
"""RoPE variants, faithful or refused: the fixed-frequency ones (default, linear, llama3, yarn) give the HF
model's logits past their original context; the length-dependent ones (dynamic NTK, longrope), whose frequencies
transformers recomputes from the sequence length, are refused in one line by the library and by the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvexport.errors import BadModel
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model

MAX_POS = 256
FIXED = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}
LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                 "long_factor": [4.0] * 8, "original_max_position_embeddings": 64},
}


def _logits(model, T: int):
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        ours = Decoder.from_hf(model)(ids, torch.arange(T)[None])
        theirs = model(ids).logits
    return ours, theirs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_frequency_rope_matches_hf(family, name):
    model = tiny_model(family, rope_parameters=FIXED[name], max_positions=MAX_POS)
    ours, theirs = _logits(model, 200)  # past original_max_position_embeddings (64): the scaling matters
    assert (ours - theirs).abs().max().item() < 1e-4


def test_frequencies_are_the_loaded_ones_whatever_hf_ran_before():
    """transformers' dynamic-NTK module rescales its inv_freq after a sequence past max_position_embeddings;
    Rotary.from_hf_rotary reads the frequencies as loaded, not that leftover."""
    from kvexport.models.rope import Rotary

    model = tiny_model("llama", rope_parameters=LENGTH_DEPENDENT["dynamic"], max_positions=MAX_POS)
    loaded = model.model.rotary_emb.inv_freq.clone()
    with torch.no_grad():
        model(torch.zeros(1, 2 * MAX_POS, dtype=torch.long))
    assert not torch.equal(model.model.rotary_emb.inv_freq, loaded)  # the module did rescale
    assert torch.equal(Rotary.from_hf_rotary(model.model.rotary_emb).inv_freq, loaded)


@pytest.mark.parametrize("name", sorted(LENGTH_DEPENDENT))
def test_length_dependent_rope_is_refused(name):
    model = tiny_model("llama", rope_parameters=LENGTH_DEPENDENT[name], max_positions=MAX_POS)
    with pytest.raises(BadModel, match=rf"rope_type '{name}' changes its frequencies with the sequence length"):
        Decoder.from_hf(model)
    # why: past the threshold transformers' own logits move away from fixed frequencies
    ids = torch.randint(0, 128, (1, 2 * MAX_POS), generator=torch.Generator().manual_seed(0))  # past both thresholds
    fixed = tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       max_positions=MAX_POS)
    with torch.no_grad():
        a, b = model(ids).logits, fixed(ids).logits
    assert (a - b).abs().max().item() > 1e-2


def test_cli_refuses_length_dependent_rope_in_one_line(tmp_path):
    import shutil

    from kvexport.paths import DEFAULT_MODEL

    model = tiny_model("llama", rope_parameters=LENGTH_DEPENDENT["dynamic"], max_positions=MAX_POS, vocab_size=4096)
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the student's tokenizer (4096 tokens)
        shutil.copy(DEFAULT_MODEL / f, tmp_path / "m" / f)
    r = subprocess.run([sys.executable, "-m", "kvexport", "generate", str(tmp_path / "m"), "-p", "x",
                        "-n", "1"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and "rope_type 'dynamic'" in lines[0] and "accepted: default" in lines[0], r.stderr


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dim,offset,total", [(64, 0, 64), (4, 16, 20), (6, 2, 12), (128, 0, 128)])
def test_rotary_apply_is_hf_rotation_bit_for_bit(dim, offset, total, T):
    """Rotary.apply (a step's form: halves swapped by one index, the sign in the sin table; a chunk's:
    rotate_half) against transformers' ``apply_rotary_pos_emb`` on the same cos / sin: equal bit for bit, padding
    positions (-1) as position 0, and a slice of the channels (MLA's decoupled key) rotated with the rest
    untouched."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvexport.models.rope import Rotary

    g = torch.Generator().manual_seed(dim + offset)
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rot = Rotary(inv, scaling=0.9, offset=offset)
    x = torch.randn(2, 3, T, total, generator=g)
    pos = torch.tensor([[-1, 0, 7, 300, 4095], [5, 6, 7, 8, 9]])[:, :T] if T > 1 else torch.tensor([[-1], [4095]])
    cos, sin = rot.cos_sin(pos)
    part = x[..., offset:offset + dim]
    want, _ = apply_rotary_pos_emb(part, part, cos, sin)  # unsqueezes cos / sin at dim 1
    got = rot.apply(x, pos)
    assert torch.equal(got[..., offset:offset + dim], want)
    assert torch.equal(got[..., :offset], x[..., :offset]) and torch.equal(got[..., offset + dim:], x[..., offset + dim:])
