# SPDX-License-Identifier: Apache-2.0
"""Weight formats on a real export, by hand (docs/quantized.md): parity with PyTorch on the same weights, fidelity to
the original model, decode time at one thread.

    python benchmarks/weights_real.py EXPORT_DIR [--out results.json] [--formats int4,int4-a4,int4-qdq,fp16]

EXPORT_DIR: an fp32 export (e.g. ``kvexport export SMOLLM2_DIR --out X --press snapkv --budget 1024 --window 32
--chunk 512 --inplace-decode``). Each format is written beside it (``X-<format>``) with
:func:`kvexport.quant.quantize_export`, then:

1. parity: onnxruntime against :func:`kvexport.quant.quantized_decoder` (the library path on the same weights) on a
   prompt of held-out English prose longer than the cache (compaction at prefill) and ``--steps`` greedy steps, the
   reference forced along onnxruntime's tokens: max |logit difference| / max |logit|, argmax agreement;
2. weights alone, in PyTorch (no press, full sequences of held-out prose, teacher forced): perplexity and next-token
   agreement of the quantized weights against the fp32 model;
3. fidelity as every compression reports it (:func:`kvexport.export.fidelity.measure_fidelity` on held-out prose:
   the export, press included, against the original model with a full cache), for the fp32 export and each format;
4. decode ms/token at one thread: at each of ``--contexts`` (prompt lengths), ``--rounds`` interleaved rounds over
   the exports, median of ``--decode-steps`` steps after the prompt's prefill, with the 1-minute load average around
   each run. Every export runs as OrtGenerator opens it by default (one memory-mapped copy of the weights for all
   sessions; prepacking off, except for int4 weights, which MatMulNBits packs at load); the fp32 export also runs
   with a prepacked copy of its weights per session.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

#: ``--weights int4`` (MatMulNBits, float32 activations), the same blocks with int8 activations (accuracy level 4,
#: quantize_export's option), int4-qdq, fp16
FORMATS = {"int4": dict(weights="int4"), "int4-a4": dict(weights="int4", accuracy_level=4),
           "int4-qdq": dict(weights="int4-qdq"), "fp16": dict(weights="fp16")}


def _prose(tokenizer, n: int, offset: int = 0) -> np.ndarray:
    from kvexport.eval.data import prose_stream

    s = prose_stream(tokenizer).numpy()
    return s[offset : offset + n]


def parity(d: Path, tokenizer, prompt: int, steps: int) -> dict:
    from kvexport.export import OrtGenerator, verify_manifest
    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.export.source import press_from_dict

    man = verify_manifest(d)
    s = man["settings"]
    dec = load_reference_model(man, None, root=d)  # the export's weights (quantized_decoder, by sha256)
    gen = OrtGenerator(d, share_weights=False, threads=1)
    ids = _prose(tokenizer, prompt)[None]
    mask = np.ones_like(ids)
    free = gen.generate(ids, mask, steps + 1, keep_logits=True)
    r = reference_generate(dec, s, press_from_dict(s["press"]), ids, mask, steps + 1,
                           forced=torch.as_tensor(np.asarray(free.tokens)))
    a = np.stack([free.prompt_logits, *free.step_logits]).astype(np.float64)
    b = np.stack([r.prompt_logits.numpy(), *[x.numpy() for x in r.step_logits]]).astype(np.float64)
    return {"prompt": prompt, "steps": steps, "compactions": int(free.compactions),
            "max_abs_diff_over_max_logit": float(np.abs(a - b).max() / np.abs(b).max()),
            "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean())}


def weights_alone(d: Path, fp32_dir: Path, tokenizer, windows: int, length: int) -> dict:
    """Perplexity on held-out prose windows (teacher forced, full sequence, no press) of the fp32 model and of the
    same model with the export's weights."""
    from kvexport.eval.data import prose_windows
    from kvexport.export import verify_manifest
    from kvexport.export.reference import load_reference_model
    from kvexport.quant import quantized_decoder

    man = verify_manifest(d)
    dec0 = load_reference_model(verify_manifest(fp32_dir), None, root=fp32_dir)
    dec = quantized_decoder(dec0, man["settings"]["weights"])
    w = prose_windows(tokenizer, windows, length + 1)
    out = {"windows": int(w.shape[0]), "length": length}
    nll = {"fp32": 0.0, "quantized": 0.0}
    agree = n = 0
    with torch.no_grad():
        for row in w:
            ids = row[None, :-1]
            pos = torch.arange(length)[None]
            la = dec0(ids, pos).float().log_softmax(-1)[0]
            lb = dec(ids, pos).float().log_softmax(-1)[0]
            tgt = row[1:]
            nll["fp32"] -= float(la.gather(-1, tgt[:, None]).sum())
            nll["quantized"] -= float(lb.gather(-1, tgt[:, None]).sum())
            agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
            n += length
    out["ppl_fp32"] = float(np.exp(nll["fp32"] / n))
    out["ppl_quantized"] = float(np.exp(nll["quantized"] / n))
    out["ppl_increase"] = out["ppl_quantized"] / out["ppl_fp32"] - 1
    out["next_token_agreement"] = agree / n
    return out


def fidelity(d: Path, tokenizer, text: Path, sequences: int, scored: int) -> dict:
    from kvexport.export import OrtGenerator
    from kvexport.export.fidelity import FidelitySettings, measure_fidelity

    gen = OrtGenerator(d, share_weights=False, threads=1)
    f = measure_fidelity(d, gen, tokenizer, eval_data=text, settings=FidelitySettings(sequences, scored, recall=0))
    return {k: f[k] for k in f if k not in ("settings", "original", "reference")}


def _load() -> float:
    return os.getloadavg()[0]


def decode_ms(d: Path, tokenizer, prompt: int, steps: int, share: bool) -> dict:
    from kvexport.export import OrtGenerator

    gen = OrtGenerator(d, share_weights=share, threads=1)
    ids = _prose(tokenizer, prompt, offset=5000)[None]
    assert ids.shape[1] == prompt, f"the held-out prose has fewer than {prompt} tokens past offset 5000"
    load0 = _load()
    res = gen.generate(ids, np.ones_like(ids), steps + 1)
    gen.close()
    return {"ms": 1000 * float(np.median(res.decode_seconds)), "prefill_s": float(res.prefill_seconds),
            "load": [round(load0, 2), round(_load(), 2)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export")
    ap.add_argument("--out", default=None)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--prompt", type=int, default=1200)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--fidelity-sequences", type=int, default=4)
    ap.add_argument("--skip", default="", help="parts to skip: parity,alone,fidelity,timing")
    ap.add_argument("--contexts", default="512,2048,8192", help="prompt lengths of the timed runs")
    ap.add_argument("--decode-steps", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from kvexport.eval.data import prose_pages
    from kvexport.quant import quantize_export

    base = Path(a.export)
    tok = AutoTokenizer.from_pretrained(base / "tokenizer")
    skip = set(a.skip.split(","))
    res: dict = {"export": str(base), "started_load": os.getloadavg(), "cpus": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d %H:%M"), "formats": {}}
    dirs = {"fp32": base}
    for name in a.formats.split(","):
        d = base.parent / f"{base.name}-{name}"
        if not (d / "manifest.json").is_file():
            t = time.time()
            quantize_export(base, out=d, force=True, **FORMATS[name])
            res["formats"].setdefault(name, {})["quantize_s"] = round(time.time() - t, 1)
        dirs[name] = d
        e = json.loads((d / "manifest.json").read_text())["settings"]["weights"]
        res["formats"].setdefault(name, {})["weights"] = {k: v for k, v in e.items() if k not in ("tensors", "skipped")}
        print(name, res["formats"][name], flush=True)
    for name in dirs:
        if name == "fp32":
            continue
        r = res["formats"][name]
        if "parity" not in skip:
            r["parity"] = parity(dirs[name], tok, a.prompt, a.steps)
            print(name, "parity", r["parity"], flush=True)
        if "alone" not in skip:
            r["weights_alone"] = weights_alone(dirs[name], base, tok, a.windows, 512)
            print(name, "weights alone", r["weights_alone"], flush=True)
    if "fidelity" not in skip:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n\n".join(prose_pages("heldout")))
        for name, d in dirs.items():
            res.setdefault("fidelity", {})[name] = fidelity(d, tok, Path(f.name), a.fidelity_sequences, 64)
            print(name, "fidelity", res["fidelity"][name], flush=True)
        os.unlink(f.name)
    if "timing" not in skip:
        runs: dict = {}
        for ctx in (int(c) for c in a.contexts.split(",")):
            for rnd in range(a.rounds):
                order = list(dirs) if rnd % 2 == 0 else list(dirs)[::-1]
                for name in order:
                    for share in ((True, False) if name == "fp32" else (True,)):  # True: OrtGenerator's default
                        key = name + ("" if share else " (own prepacked copy per session)")
                        runs.setdefault(str(ctx), {}).setdefault(key, []).append(
                            decode_ms(dirs[name], tok, ctx, a.decode_steps, share))
                        print(ctx, key, runs[str(ctx)][key][-1], flush=True)
            res["timing"] = runs
            if a.out:  # what is measured so far survives a later context's timeout
                Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    res["ended_load"] = os.getloadavg()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
