# SPDX-License-Identifier: Apache-2.0
"""Load a HF causal LM (transformers 5.x) from a local directory or take one in memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvexport.errors import BadModel, BadUsage
from kvexport.models.spec import SUPPORTED_FAMILIES, ModelSpec, supported_families_text

REQUIRED_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
#: the files that make up a model's tokenizer, special tokens, chat template and generation defaults: copied as a
#: whole wherever kvexport writes a model (an MLA directory, an export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def check_model_dir(path: str | Path) -> dict[str, Any]:
    """Fail early, with one line, on what would make ``from_pretrained`` fail later. Returns config.json. A ``.gguf``
    file is checked as the directory kvexport makes of it (:func:`kvexport.models.gguf.model_dir`)."""
    from kvexport.models.gguf import model_dir

    p = Path(model_dir(path))
    if not p.exists():
        raise BadModel(f"model directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise BadModel(f"model path {str(p)!r} is not a directory (expected config.json + *.safetensors)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise BadModel(f"{str(p)!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadModel(f"{cfg_path} is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(cfg, dict):
        raise BadModel(f"{cfg_path} is not a JSON object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_FAMILIES:
        raise BadModel(f"unsupported model family {mt!r} in {cfg_path}; supported: {supported_families_text()}")
    # transformers fills absent fields with its defaults (e.g. 32 layers of 4096), which then fail or,
    # worse, load silently with fresh random weights: require them in the file itself
    missing = [k for k in REQUIRED_CONFIG_FIELDS if cfg.get(k) is None]
    if missing:
        raise BadModel(f"{cfg_path} lacks required field(s) {', '.join(missing)}")
    if not any(p.glob("*.safetensors")):
        raise BadModel(f"{str(p)!r} has no *.safetensors weights")
    for f in p.glob("*.safetensors"):
        _check_safetensors(f)
    return cfg


def _check_safetensors(f: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as sf:
            keys = list(sf.keys())
            if keys:
                sf.get_slice(keys[-1])
        size = f.stat().st_size
        # header says where the last tensor ends; a truncated file ends before it
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if size < 8 + n + end:
            raise ValueError("truncated")
    except Exception as e:  # noqa: BLE001 - any failure here means a damaged file
        raise BadModel(f"weights file {f} is damaged or not safetensors ({e.__class__.__name__}: {e})"[:300]) from None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """"fp32"/"fp16"/"bf16" (or a torch dtype) -> torch dtype; BadUsage naming the accepted ones otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise BadUsage(f"--dtype {dtype!r} unknown; accepted: fp32, fp16, bf16")
    return DTYPES[dtype]


def load_hf_model(model: str | Path | torch.nn.Module, dtype: str | torch.dtype = "fp32"):
    """-> a transformers ``*ForCausalLM`` in eval mode. ``model`` is a directory, a ``.gguf`` file or a loaded model."""
    if isinstance(model, torch.nn.Module):
        ModelSpec.from_hf_config(model.config)
        return model.eval()
    from transformers import AutoModelForCausalLM

    from kvexport.models.gguf import model_dir

    model = model_dir(model)
    td = resolve_dtype(dtype)
    check_model_dir(model)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=td, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001
        raise BadModel(f"transformers could not load {model}: {str(e).splitlines()[0][:200]}") from None
    return hf.eval()


def load_tokenizer(path: str | Path | None):
    """The tokenizer saved beside a model (or kept in a ``.gguf`` file), or None when the directory has none."""
    if path is None:
        return None
    from kvexport.models.gguf import model_dir

    p = Path(model_dir(path))
    if not (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001
        raise BadModel(f"tokenizer in {p} cannot be loaded: {str(e).splitlines()[0][:200]}") from None


#: bytes per element of the safetensors dtypes a checkpoint's weights come in
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}


def checkpoint_size(path: str | Path) -> tuple[int, int]:
    """(parameters, bytes) of an HF directory's ``*.safetensors``, read from their headers (nothing is loaded);
    a tied head stored beside its embedding is counted once, as ``model.parameters()`` counts it."""
    p = Path(path)
    tied = bool(json.loads((p / "config.json").read_text()).get("tie_word_embeddings"))
    n = size = 0
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name == "__metadata__" or (tied and name.endswith("lm_head.weight")):
                continue
            k = 1
            for d in t["shape"]:
                k *= int(d)
            n += k
            size += k * _ST_BYTES.get(t["dtype"], 4)
    return n, size
