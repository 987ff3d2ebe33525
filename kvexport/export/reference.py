# SPDX-License-Identifier: Apache-2.0
"""The reference every export is compared with: kvexport's PyTorch library path as a user calls it
(:func:`kvexport.generation.generate`) with the export's model (rebuilt from the manifest's source and checked
against its hash), press, budget, window, chunk, cache format and weight format, on unpadded prompts. The graphs
share no code with it but the cache rules (kvexport.cache) and the block rule that gives it a weight-quantized
export's int4 / fp16 weights (kvexport.quant.blocks, applied to the model's own weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage


def reference_kwargs(settings: dict, press) -> dict:
    """The :func:`kvexport.generation.generate` settings that match an export (press, window, chunk, capacity,
    the cache format ``kv_dtype``)."""
    if settings["mode"] == "dynamic":
        return {"press": None, "chunk": int(settings["chunk"])}
    # a quantized export is compared with the PyTorch cache in the same format (it writes the same codes)
    kvd = {"kv_dtype": settings["kv_dtype"]} if settings.get("kv_dtype") else {}
    if press is None:
        return {"press": None, "chunk": int(settings["chunk"]), "capacity": int(min(settings["capacities"])), **kvd}
    look = {"lookahead": int(settings["lookahead"])} if settings.get("lookahead") else {}
    return {"press": press, "window": int(settings["window"]), "chunk": int(settings["chunk"]), **kvd, **look}


def reference_generate(decoder, settings: dict, press, ids, mask, n_new: int, forced=None, tie_break=None):
    """The library path on unpadded prompts: :func:`kvexport.generation.generate` with the export's settings."""
    import torch

    from kvexport.generation import generate

    dev = next(decoder.parameters()).device
    t_ids = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=dev)
    t_mask = torch.as_tensor(np.asarray(mask), dtype=torch.long, device=dev)
    kw = reference_kwargs(settings, press)
    if kw["press"] is not None:
        L = decoder.spec.num_layers
        got = [int(b) for b in kw["press"].layer_budgets(L, int(t_mask.sum(-1).max()))]
        if got != [int(b) for b in settings["budgets"]]:
            raise BadArtifact(f"the press gives per-layer budgets {got}, the export was made with "
                              f"{settings['budgets']}; re-export with this kvexport version")
    return generate(decoder, t_ids, t_mask, max_new_tokens=n_new, forced_tokens=forced, keep_logits=True,
                    track_kept=True, tie_break=tie_break, **kw)


def check_reference_source(manifest: dict, root=None) -> str:
    """The export's source model as the manifest records it (relative to the export ``root`` first, then the
    absolute path); one line when it is unknown or gone. Cheap: nothing is loaded."""
    s = manifest["settings"]
    src = s.get("source")
    rel = s.get("source_relative")
    if rel and root is not None and (Path(root) / rel).is_dir():
        src = str((Path(root) / rel).resolve())
    if src is None:
        raise BadUsage("this export was made from an in-memory model; pass the model to validate")
    if not Path(src).exists():
        raise BadArtifact(f"the export's source model {src} no longer exists; pass the model explicitly")
    return src


def load_reference_model(manifest: dict, model=None, root=None, weights: bool = True):
    """The PyTorch model of an export: ``model`` (HF dir / model / Decoder) or the manifest's source (its path
    relative to the export ``root`` first, then the absolute one), rewritten to MLA with the same settings, in
    the export's dtype, and, for a weight-quantized export (the manifest's ``weights`` entry), with the weights the
    export holds (:func:`kvexport.quant.quantized_decoder`: each of the model's own weights that the entry names by
    sha256 replaced by its int4 / fp16 value, computed by the block rule, not read from the graphs). ``weights``
    False: the model as it is, before that."""
    from kvexport.export.source import resolve_decoder

    s = manifest["settings"]
    src = model if model is not None else check_reference_source(manifest, root)
    mla = s.get("mla")
    rank = rope = None
    equalize = False
    if mla is not None and mla.get("rewritten_by_export") and not _is_decoder_mla(src):
        rank, rope = mla["settings"].get("kv_rank"), mla["settings"].get("rope_dim")
        equalize = bool(mla["settings"].get("equalize_latent", False))
    dec, _, model_hash, _ = resolve_decoder(src, s["dtype"], rank, rope, equalize)
    if model is None and model_hash != manifest.get("model_hash"):
        raise BadArtifact(f"the source model {src} changed since the export (hash differs); re-export it")
    if weights and s.get("weights"):
        from kvexport.quant.reference import quantized_decoder

        dec = quantized_decoder(dec, s["weights"], inplace=dec is not model)  # a caller's Decoder is copied
    return dec


def _is_decoder_mla(src) -> bool:
    from kvexport.export.source import _is_mla
    from kvexport.models.decoder import Decoder

    return isinstance(src, Decoder) and _is_mla(src)
