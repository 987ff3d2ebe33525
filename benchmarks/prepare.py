# SPDX-License-Identifier: Apache-2.0
"""Build what the timed rows load: HF checkpoints of each shape, kvexport exports, Optimum's export.

Everything is cached under ``<cache>/`` (default ``~/.cache/kvexport/bench``) and keyed by its settings, so a
second run times the same files without re-exporting (exporting is a one-time build step, timed apart).
Random-weight shapes are generated from a fixed seed, so every row of a run loads the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.rows import Row, Shape

REPO = Path(__file__).resolve().parents[1]


def default_cache() -> Path:
    return Path(os.environ.get("KVEXPORT_BENCH_CACHE", Path.home() / ".cache" / "kvexport" / "bench"))


RUN_ONLY_FIELDS = ("max_context",)  # Shape fields that change what is timed, not what is built
#: part of every kvexport export's cache key: bumped when the same settings export different graphs
#: (2: full caches take their capacity axis as a dynamic dimension, held in buckets; 3: large and bucketed caches
#: read in two parts by MLA too: the cache buffer goes to LatentAttention as it is, with new_latent)
EXPORT_LAYOUT = 3


def _key(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def model_dir(shape: Shape, cache: Path) -> Path:
    """The HF checkpoint directory of ``shape`` (the local source, the registry model's fp32 directory, or random
    weights saved once)."""
    if shape.gguf is not None:
        from kvexport.models import fetch

        return fetch.hf_dir(shape.gguf)
    if shape.source is not None:
        p = Path(shape.source)
        return p if p.is_absolute() else REPO / p
    out = cache / "models" / f"{shape.name}-{_key({k: v for k, v in shape.to_dict().items() if k not in RUN_ONLY_FIELDS})}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      intermediate_size=shape.intermediate, max_position_embeddings=shape.max_positions,
                      tie_word_embeddings=shape.tie, rope_theta=500000.0, bos_token_id=0, eos_token_id=1,
                      pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # scaled so that attention is not uniform and logits are not flat
        g = torch.Generator().manual_seed(0)
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[1] ** -0.5))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def gguf_path(shape: Shape) -> Path:
    """The GGUF file a registry shape comes from (what llama.cpp runs). Raises ValueError for other shapes."""
    if shape.gguf is None:
        raise ValueError(f"shape {shape.name} has no GGUF (llama.cpp runs the registry models only)")
    from kvexport.models import fetch

    return fetch.get(shape.gguf, quiet=True)


def legacy_model_dir(shape: Shape, cache: Path) -> Path:
    """A copy of the checkpoint that transformers < 4.58 (Optimum's venv) reads the same way: the v5 config's
    ``rope_parameters`` spelled as ``rope_theta``/``rope_scaling``, ``dtype`` as ``torch_dtype``."""
    src = model_dir(shape, cache)
    cfg = json.loads((src / "config.json").read_text())
    out = cache / "legacy" / f"{shape.name}-{_key(cfg)}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            os.symlink(f.resolve(), tmp / f.name)
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rp.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.57.0"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out


def kvx_export(row: Row, shape: Shape, cache: Path, log=print, rebuild: bool = False,
               capacity: int | None = None) -> tuple[Path, float | None]:
    """Export ``row`` for ``shape`` once (kvexport.export.export_model); returns (dir, seconds spent or None
    when cached). A cached export whose manifest no longer verifies is rebuilt. ``capacity``: the slots of a
    static full-cache row."""
    kw = row.export_kwargs(shape, capacity)
    src = model_dir(shape, cache)
    sd = {k: v for k, v in shape.to_dict().items() if k not in RUN_ONLY_FIELDS}
    out = cache / "exports" / f"{shape.name}-{row.name}-{_key({'kw': kw, 'src': str(src), 'shape': sd, 'layout': EXPORT_LAYOUT})}"
    if not rebuild and (out / "manifest.json").is_file():
        try:
            from kvexport.export.exporter import KIND
            from kvexport.manifest import verify_manifest

            verify_manifest(out, KIND)
            return out, None
        except Exception as e:  # stale format: rebuild
            log(f"  cached export {out.name} does not verify ({e}); rebuilding")
    t0 = time.time()
    log(f"  exporting {row.name} for {shape.name} ({kw}) ...")
    from kvexport.export import export_model

    out.parent.mkdir(parents=True, exist_ok=True)
    export_model(str(src), out, force=True, **kw)
    dt = time.time() - t0
    log(f"  exported {row.name}/{shape.name} in {dt:.0f} s")
    return out, dt


def optimum_export(shape: Shape, cache: Path, venv_python: Path, log=print, timeout_s: float = 900.0,
                   rebuild: bool = False) -> tuple[Path, float | None]:
    """``optimum-cli export onnx --task text-generation-with-past`` of the shape's checkpoint, in the Optimum
    venv, once. Returns (dir, seconds or None when cached). Raises RuntimeError with the CLI's tail."""
    src = legacy_model_dir(shape, cache)
    out = cache / "optimum" / src.name
    if not rebuild and (out / "model.onnx").is_file() and (out / "config.json").is_file():
        return out, None
    cli = Path(venv_python).parent / "optimum-cli"
    log(f"  optimum-cli export onnx {shape.name} ...")
    dt = _build_into(out, lambda tmp: [str(cli), "export", "onnx", "--model", str(src), "--task",
                                       "text-generation-with-past", "--framework", "pt", str(tmp)],
                     "model.onnx", "optimum-cli export", timeout_s)
    log(f"  optimum export of {shape.name} in {dt:.0f} s")
    return out, dt


def _build_into(out: Path, command, marker: str, what: str, timeout_s: float) -> float:
    """Run ``command(tmp)`` (a build writing into ``tmp``), then move ``tmp`` to ``out`` when it wrote ``marker``
    (nothing half-built is left at ``out``); -> seconds. Raises RuntimeError with the build's output tail."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    r = subprocess.run(command(tmp), capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not (tmp / marker).is_file():
        raise RuntimeError(f"{what} failed:\n" + (r.stdout + r.stderr)[-2000:])
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return time.time() - t0


def ortgenai_build(shape: Shape, cache: Path, venv_python: Path, log=print, timeout_s: float = 1800.0,
                   rebuild: bool = False, precision: str = "fp32") -> tuple[Path, float | None]:
    """onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p PRECISION
    -e cpu``) on the shape's checkpoint, in its venv, once. Returns (dir, seconds or None when cached)."""
    src = legacy_model_dir(shape, cache)
    out = cache / "ortgenai" / (src.name if precision == "fp32" else f"{src.name}-{precision}")
    if not rebuild and (out / "genai_config.json").is_file() and (out / "model.onnx").is_file():
        return out, None
    log(f"  onnxruntime-genai builder ({precision}) on {shape.name} ...")
    dt = _build_into(out, lambda tmp: [str(venv_python), "-m", "onnxruntime_genai.models.builder", "-i", str(src),
                                       "-o", str(tmp), "-p", precision, "-e", "cpu"],
                     "genai_config.json", "onnxruntime-genai builder", timeout_s)
    log(f"  onnxruntime-genai build ({precision}) of {shape.name} in {dt:.0f} s")
    return out, dt


def weight_bytes(path: Path) -> int:
    """Bytes of the weights a decode step reads: the checkpoint's safetensors (a tied embedding counted once, as
    the LM head), or an ONNX graph's initializers (``decode.onnx`` / ``model.onnx``) for kvexport exports, whose
    MLA weights differ from the source's; a table only read through ``Gather`` (the embedding) is not counted."""
    path = Path(path)
    if (path / "decode.onnx").is_file() or (path / "model.onnx").is_file():
        name = "decode.onnx" if (path / "decode.onnx").is_file() else "model.onnx"
        import onnx

        m = onnx.load(str(path / name), load_external_data=False)
        gathered, other = set(), set()  # an embedding table only read through Gather costs one row per step
        for node in m.graph.node:
            for j, x in enumerate(node.input):
                (gathered if node.op_type == "Gather" and j == 0 else other).add(x)
        total = 0
        for t in m.graph.initializer:
            if t.name in gathered and t.name not in other:
                continue
            n = 1
            for d in t.dims:
                n *= d
            total += n * {1: 4, 10: 2, 11: 8, 7: 8, 6: 4, 9: 1, 2: 1, 3: 1}.get(t.data_type, 4)  # 2, 3: (u)int8
        return total
    from safetensors import safe_open

    total, seen = 0, set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "np") as fh:
            for k in fh.keys():
                if k in seen:
                    continue
                seen.add(k)
                sl = fh.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}.get(sl.get_dtype(), 4)
    return total
