# SPDX-License-Identifier: Apache-2.0
"""An MLA model on disk: one directory that reloads to the same logits.

Layout::

    kvexport_mla.json    format, version, rewrite settings, per-layer plans, ModelSpec, the original HF config,
                         source_model (absolute path of the HF directory it was rewritten from, or null)
    model.safetensors    the Decoder's state dict (tied embeddings stored once)
    tokenizer*.json ...  copied from the source model directory when it has one
    manifest.json        sha256 of every file above (kvexport.manifest, kind "mla-model")

Writes go to a temporary sibling directory that is renamed into place at the end, so a failure never
leaves a half-written model; the directory and its files get the modes of the user's umask
(:func:`kvexport.atomic.user_mode`), not the 0700 of a temporary directory. :func:`load_mla` checks the files against the manifest first and refuses a
missing, altered or foreign file (BadArtifact); a distill ``--out`` may also hold its working files
(checkpoints/, the log and the summary).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvexport.errors import BadArtifact, BadUsage
from kvexport.mla.attention import MLAAttention
from kvexport.mla.config import MLALayerPlan, MLASettings
from kvexport.models.loading import TOKENIZER_FILES

MLA_CONFIG = "kvexport_mla.json"
FORMAT = "kvexport-mla"
#: 2: the exact-rewrite layout (per-head q_rope, D-wide no-RoPE keys, k_proj/k_norm for q/k-norm models)
VERSION = 2


MANIFEST_KIND = "mla-model"
#: what ``kvexport distill`` keeps beside the model in its --out (a resumable working directory)
WORKING_FILES = ("checkpoints", "distill_log.jsonl", "distill_summary.json")


def verify_mla_files(path: str | Path) -> None:
    """BadArtifact naming the first missing, altered or foreign file of an MLA directory (its manifest.json)."""
    from kvexport.manifest import verify_manifest

    verify_manifest(path, kind=MANIFEST_KIND, working=WORKING_FILES, check_version=False)


def is_mla_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory holding a kvexport MLA config."""
    p = Path(path)
    return p.is_dir() and (p / MLA_CONFIG).is_file()


def _hf_dir(path) -> Path | None:
    """``path`` resolved when it is an HF model directory (config.json, not an MLA directory), else None."""
    if path is None:
        return None
    p = Path(path)
    return p.resolve() if p.is_dir() and (p / "config.json").is_file() and not is_mla_dir(p) else None


def source_model(path: str | Path) -> Path | None:
    """The original HF directory an MLA directory records (``source_model``), when it still exists."""
    try:
        src = read_mla_config(path).get("source_model")
    except BadArtifact:
        return None
    return _hf_dir(src)


def mla_config_dict(dec, hf_config: dict[str, Any] | None = None, source: str | Path | None = None) -> dict[str, Any]:
    settings: MLASettings = dec.mla_settings
    return {
        "format": FORMAT,
        "version": VERSION,
        "settings": settings.to_dict(),
        "layers": [{"kv_rank": p.kv_rank, "rope_pairs": list(p.rope_pairs), "q_rank": p.q_rank} for p in dec.mla_plans],
        "spec": dec.spec.to_dict(),
        "dtype": str(next(dec.parameters()).dtype).removeprefix("torch."),
        "hf_config": hf_config or getattr(dec, "hf_config", None) or {},
        "source_model": str(source) if source is not None else None,
    }


def save_mla(dec, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
             hf_config: dict[str, Any] | None = None, overwrite: bool = False,
             source: str | Path | None = None) -> Path:
    """Write an MLA Decoder (from :func:`~kvexport.mla.rewrite.rewrite_to_mla` or :func:`load_mla`) to ``out_dir``.

    ``source``: the original HF directory, recorded as ``source_model`` (what validate's fidelity check compares
    with); default: the one the decoder carries (``dec.source_model``: set by the rewrite and by load_mla), else
    ``tokenizer_dir`` when that is an HF directory.
    """
    from safetensors.torch import save_model

    from kvexport.atomic import user_mode

    if not hasattr(dec, "mla_plans"):
        raise BadUsage("this decoder is not an MLA model (rewrite it with kvexport.mla.rewrite_to_mla first)")
    out = Path(out_dir)
    if out.exists() and not overwrite and any(out.iterdir()):
        raise BadUsage(f"output directory {out} exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        src_model = _hf_dir(source) or _hf_dir(getattr(dec, "source_model", None)) or _hf_dir(tokenizer_dir)
        cfg = mla_config_dict(dec, hf_config, src_model)
        (tmp / MLA_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_model(dec, str(tmp / "model.safetensors"), metadata={"format": "pt", "kvexport": FORMAT})
        src = Path(tokenizer_dir) if tokenizer_dir is not None else getattr(dec, "source_dir", None)
        if src is not None:
            for name in TOKENIZER_FILES:
                if (Path(src) / name).is_file():
                    shutil.copy2(Path(src) / name, tmp / name)
        from kvexport.manifest import write_manifest

        write_manifest(tmp, MANIFEST_KIND, {"mla": cfg["settings"], "kv_ranks": [lp["kv_rank"] for lp in cfg["layers"]],
                                            "dtype": cfg["dtype"]})
        user_mode(tmp)  # mkdtemp made it 0700
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dec.source_dir = out
    dec.source_model = src_model
    return out


def read_mla_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / MLA_CONFIG
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise BadArtifact(f"{path} is not an MLA model directory (no {MLA_CONFIG})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArtifact(f"{p} is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise BadArtifact(f"{p} is not a kvexport MLA config (format {cfg.get('format') if isinstance(cfg, dict) else None!r})")
    if int(cfg.get("version", 0)) > VERSION:
        raise BadArtifact(f"{p} has MLA format version {cfg.get('version')}; this kvexport reads <= {VERSION}")
    if int(cfg.get("version", 0)) < VERSION:
        raise BadArtifact(f"{p} has MLA format version {cfg.get('version')} (an older weight layout); rewrite the "
                          f"original model again with this kvexport (format {VERSION})")
    return cfg


def build_mla_decoder(cfg: dict[str, Any]):
    """An MLA Decoder with the shapes of ``cfg`` (weights uninitialised)."""
    from kvexport.models.decoder import Decoder
    from kvexport.models.rope import Rotary
    from kvexport.models.spec import ModelSpec

    spec = ModelSpec(**cfg["spec"])
    settings = MLASettings(**cfg["settings"])
    plans = [MLALayerPlan(**lp) for lp in cfg["layers"]]
    if len(plans) != spec.num_layers:
        raise BadArtifact(f"MLA config lists {len(plans)} layers, the model has {spec.num_layers}")
    rotary = Rotary(torch.zeros(spec.head_dim // 2))
    dec = Decoder(spec, rotary, attention_factory=lambda i: MLAAttention(spec, plans[i], rotary, settings.absorb))
    dec.mla_settings, dec.mla_plans, dec.hf_config = settings, plans, cfg.get("hf_config", {})
    return dec


def load_mla(path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Directory -> MLA :class:`~kvexport.models.decoder.Decoder` in eval mode (logits identical to the saved one)."""
    from safetensors.torch import load_file

    from kvexport.models.loading import DTYPES

    p = Path(path)
    cfg = read_mla_config(p)
    verify_mla_files(p)
    with torch.device("meta"):  # shapes only: the saved tensors become the parameters (one copy of the weights)
        dec = build_mla_decoder(cfg)
    weights = p / "model.safetensors"
    if not weights.is_file():
        raise BadArtifact(f"{p} has no model.safetensors")
    try:
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - damaged or foreign weights
        raise BadArtifact(f"{weights} cannot be loaded: {str(e).splitlines()[0][:200]}") from None
    tied = bool(cfg["spec"].get("tie_word_embeddings"))
    if tied:  # saved once (safetensors drops the duplicate name of a shared tensor)
        one = state.get("embed_tokens.weight", state.get("lm_head.weight"))
        if one is not None:
            state.setdefault("embed_tokens.weight", one)
            state.setdefault("lm_head.weight", one)
    try:
        missing, unexpected = dec.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a shape that does not match the config
        raise BadArtifact(f"{weights} does not match its MLA config: {str(e).splitlines()[-1].strip()[:200]}") from None
    left = [n for n, t in list(dec.named_parameters()) + list(dec.named_buffers()) if t.is_meta]
    if missing or unexpected or left:
        raise BadArtifact(f"{weights} does not match its MLA config: missing {list(missing or left)[:3]}, "
                          f"unexpected {list(unexpected)[:3]}")
    if tied:
        dec.lm_head.weight = dec.embed_tokens.weight  # one parameter, as the saved model had it
    td = DTYPES[dtype] if isinstance(dtype, str) else (dtype or getattr(torch, cfg.get("dtype", "float32")))
    dec.to(device=device, dtype=td)
    for m in dec.modules():  # RoPE frequencies stay fp32
        if hasattr(m, "inv_freq"):
            m.inv_freq.data = m.inv_freq.data.float()
    dec.source_dir = p
    dec.source_model = _hf_dir(cfg.get("source_model"))
    return dec.eval()


def load_decoder(model: str | Path | torch.nn.Module, dtype: str | torch.dtype = "fp32"):
    """Any model kvexport reads -> (kvexport Decoder, HF model or None): an HF directory, a ``.gguf`` file or a loaded
    transformers model -> (Decoder sharing its weights, the HF model); a kvexport MLA directory -> (MLA Decoder,
    None)."""
    from kvexport.models.decoder import Decoder
    from kvexport.models.gguf import model_dir
    from kvexport.models.loading import load_hf_model, resolve_dtype

    resolve_dtype(dtype)
    if not isinstance(model, torch.nn.Module):
        model = model_dir(model)
        if is_mla_dir(model):
            return load_mla(model, dtype), None
    hf = load_hf_model(model, dtype)
    return Decoder.from_hf(hf), hf
