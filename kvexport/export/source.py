# SPDX-License-Identifier: Apache-2.0
"""What an export is made of: the model (an HF directory, a loaded model, a Decoder or an MLA directory, rewritten to
MLA when asked, in the export's dtype, with the hash ``validate`` recomputes) and the press (a static export needs a
budget; how a press is written into and read back from the manifest)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from kvexport.errors import BadUsage

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


NOT_EXPORTABLE = {
    "random": "its scores are fresh random draws of the candidates' shape, which a static graph cannot reproduce",
    "optimal": "it is an oracle that needs future queries",
}


def _hash_model(decoder, path: Path | None) -> str:
    h = hashlib.sha256()
    if path is not None:
        for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
            if f.name.startswith("tokenizer"):
                continue
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for b in iter(lambda: fh.read(1 << 20), b""):
                    h.update(b)
        return "sha256:" + h.hexdigest()
    h.update(json.dumps(decoder.spec.to_dict(), sort_keys=True).encode())
    for name, t in sorted(decoder.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _is_mla(decoder) -> bool:
    return any(getattr(layer.self_attn, "cache_heads", None) == 1 and getattr(layer.self_attn, "value_dim", 1) == 0
               for layer in decoder.layers)


def resolve_decoder(model, dtype: str, mla_rank: int | None, rope_dim: int | None, equalize_latent: bool = False):
    """model (HF dir, HF model or kvexport Decoder) -> (Decoder in dtype, source dir or None, model hash, mla dict);
    with ``mla_rank`` rewritten to MLA (``equalize_latent``: :attr:`MLASettings.equalize_latent`)."""
    from kvexport.models.decoder import Decoder
    from kvexport.models.loading import load_hf_model

    path = None
    rewritten = False
    if isinstance(model, Decoder):
        dec = model
    elif isinstance(model, torch.nn.Module):
        dec = Decoder.from_hf(load_hf_model(model))
    else:
        from kvexport.mla.io import is_mla_dir, load_mla

        path = Path(model)
        if is_mla_dir(path):  # a saved MLA model (kvexport mla / convert)
            dec = load_mla(path, dtype=torch.float32)
        else:  # memory-mapped; straight in the export's dtype unless the MLA rewrite needs fp32 first
            dec = Decoder.from_hf(load_hf_model(path, "fp32" if mla_rank is not None else dtype))
    model_hash = _hash_model(dec, path)
    mla = None
    if mla_rank is not None:
        if _is_mla(dec):
            raise BadUsage("--mla-rank given but the model is already MLA; drop --mla-rank/--rope-dim")
        from kvexport.mla.config import MLASettings
        from kvexport.mla.rewrite import rewrite_to_mla

        kw = {"kv_rank": int(mla_rank), "equalize_latent": bool(equalize_latent)}
        if rope_dim is not None:
            kw["rope_dim"] = int(rope_dim)
        settings = MLASettings(**kw)
        dec = rewrite_to_mla(dec, settings, inplace=path is not None)  # a Decoder we loaded: nobody else holds it
        rewritten = True
    elif rope_dim is not None:
        raise BadUsage("--rope-dim needs --mla-rank")
    if _is_mla(dec):
        from kvexport.mla.rewrite import set_absorb

        set_absorb(dec, True)
        s = getattr(dec, "mla_settings", None)
        mla = {"settings": s.to_dict() if s is not None else None,
               "kv_ranks": [int(layer.self_attn.kv_rank) for layer in dec.layers],
               "rope_dim": int(dec.layers[0].self_attn.rope_dim), "rewritten_by_export": rewritten}
    dec = dec.to(DTYPES[dtype]).eval()
    return dec, path, model_hash, mla


def resolve_press(press, budget: int | None, ratio: float | None):
    """press name / object / None -> press object or None, with the checks a static export needs."""
    from kvexport.presses import make_press
    from kvexport.presses.base import ScorerPress

    if ratio is not None:
        raise BadUsage("a static export needs --budget N (tokens kept); --ratio depends on the prompt length")
    if press is None or press == "none":
        if budget is not None:
            raise BadUsage("--budget needs a --press (accepted: a press name, not 'none')")
        return None
    if isinstance(press, str):
        if budget is None:
            raise BadUsage(f"--press {press} needs --budget N (tokens kept per layer and head)")
        press = make_press(press, budget=budget)
    elif not isinstance(press, ScorerPress):
        raise BadUsage(f"press must be a press name or a ScorerPress, not {type(press).__name__}")
    elif budget is not None:
        press = dataclasses.replace(press, budget=int(budget), compression_ratio=None)
    if press.budget is None:
        raise BadUsage(f"press {press.name} has no budget; a static export needs --budget N")
    if press.name in NOT_EXPORTABLE:
        raise BadUsage(f"press {press.name!r} cannot be exported: {NOT_EXPORTABLE[press.name]}")
    return press


def press_to_dict(press) -> dict[str, Any] | None:
    if press is None:
        return None
    return {"name": press.name, "params": dataclasses.asdict(press)}


def press_from_dict(d: dict[str, Any] | None):
    if d is None:
        return None
    from kvexport.presses import PRESSES

    return PRESSES[d["name"]](**d["params"])
