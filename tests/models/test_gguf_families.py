# SPDX-License-Identifier: Apache-2.0
"""A GGUF file of every supported family (Llama, Qwen2, Qwen3, Mistral as llama.cpp writes it), written here from a
tiny random HF model with llama.cpp's tensor names and keys (F32, so nothing is lost): kvexport's GGUF path gives
the model it was written from — kvexport's decoder equals that HF model's logits, the tokenizer its ids, the chat
template its rendering — and ``kvexport generate FILE.gguf`` equals the PyTorch library path on the HF model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvexport.cli import main
from tests.hardening.conftest import make_tokenizer

CHAT = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}")
#: HF module -> llama.cpp's tensor name inside blk.N
BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _rope_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter stores a llama-architecture Q/K weight with each head's rotary halves interleaved;
    transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(family: str, tmp_path):
    """(HF model, its tokenizer, the GGUF file written from them)."""
    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    from kvexport.models.tiny import tiny_model

    tok_dir = tmp_path / f"{family}-tokenizer"
    make_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    hf = tiny_model(family, vocab_size=len(tok), seed=3)
    with torch.no_grad():  # norms away from 1, so a norm read into the wrong place shows
        g = torch.Generator().manual_seed(1)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    c = hf.config
    arch = "llama" if family == "mistral" else family  # llama.cpp writes Mistral checkpoints as llama
    path = tmp_path / f"{family}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(theta))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    tokens = [""] * len(tok)
    for t, i in tj["model"]["vocab"].items():
        tokens[i] = t
    special = {a["id"] for a in tj.get("added_tokens", [])}
    for a in tj.get("added_tokens", []):
        tokens[a["id"]] = a["content"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(CHAT)
    for name, t in hf.state_dict().items():
        v = t.detach().numpy().astype(np.float32)
        if name in TOP:
            if not (name == "lm_head.weight" and c.tie_word_embeddings):
                w.add_tensor(TOP[name], v)
            continue
        parts = name.split(".")  # model.layers.I.<module>.<weight|bias>
        module = ".".join(parts[3:-1])
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            v = _rope_order(v, c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads)
        w.add_tensor(f"blk.{parts[2]}.{BLOCK[module]}.{parts[-1]}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok.chat_template = CHAT
    return hf, tok, path


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_gguf_of_each_family_is_the_model_it_was_written_from(family, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from kvexport.mla.io import load_decoder
    from kvexport.models.gguf import model_dir

    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    hf, tok, path = write_gguf(family, tmp_path)
    d = model_dir(path)
    dec, _ = load_decoder(d)
    assert dec.spec.qkv_bias == (family == "qwen2") and dec.spec.qk_norm == (family == "qwen3")
    text = "The quick brown fox jumps over the lazy dog. Static caches keep a fixed number of tokens."
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        want = hf(ids).logits
        got = dec(ids, torch.arange(ids.shape[1])[None])
    got = got.logits if hasattr(got, "logits") else got
    assert (got - want).abs().max().item() < 1e-4
    loaded = AutoTokenizer.from_pretrained(str(d))
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.bos_token, loaded.eos_token) == (tok.bos_token, tok.eos_token)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<s>user: hi</s><s>assistant: hello</s><s>assistant:"


def test_generate_from_a_qwen3_gguf_equals_the_library_path(tmp_path, monkeypatch, capsys):
    from kvexport.generation import generate
    from kvexport.mla.io import load_decoder
    from kvexport.presses import build_press

    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    hf, tok, path = write_gguf("qwen3", tmp_path)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(str(hf_dir))
    tok.save_pretrained(str(hf_dir))
    prompt = "Static caches keep a fixed number of tokens; presses score every cached token."
    capsys.readouterr()
    assert main(["generate", str(path), "--prompt", prompt, "-n", "8", "--press", "knorm", "--budget", "16",
                 "--window", "4", "--chunk", "8"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    dec, _ = load_decoder(hf_dir)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    res = generate(dec, ids, press=build_press("knorm", budget=16, ratio=None), window=4, chunk=8, max_new_tokens=8)
    assert line.endswith(" -> " + repr(tok.decode(res.tokens[0].tolist())))


def test_convert_from_a_gguf_profiles_it(tmp_path, monkeypatch):
    """The profile stage (and ``kvexport profile`` on the PyTorch backend) reads the model a conversion was made from
    through its GGUF file: convert.json names the .gguf, not a directory with a config.json."""
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    _, _, path = write_gguf("qwen2", tmp_path)
    out = tmp_path / "conv"
    fast = ["--contexts", "64", "--decode-steps", "2", "--repeats", "1"]
    assert main(["convert", str(path), "--out", str(out), "--no-validate", "--no-baseline", "--decode-batch", "0",
                 *fast]) == 0
    assert json.loads((out / "convert.json").read_text())["settings"]["model"] == str(path)
    prof = json.loads((out / "profile-onnxruntime.json").read_text())
    assert prof["backend"] == "onnxruntime"
    assert main(["profile", str(out), "--backend", "pytorch", "--no-baseline", *fast]) == 0
    assert json.loads((out / "profile-pytorch.json").read_text())["backend"] == "pytorch"
