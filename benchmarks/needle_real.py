# SPDX-License-Identifier: Apache-2.0
"""Does chunked prefill keep the needle? A default export's press on passkey prompts, chunked as the export feeds
them and in one piece at the same budget, on PyTorch and on the export (issue 31 item 2).

    python -m benchmarks.needle_real --export DIR/onnx --lengths 4096,8184 --out docs/sweep/needle.json

For each prompt (the sweep's passkey prompts: :func:`kvexport.eval.longctx.passkey_example`, the key ending at
depths 0.1 / 0.5 / 0.9) it runs, greedy, 8 new tokens:

- ``original``: kvexport's decoder of the export's source model with a full fp32 cache (equal to transformers'
  logits within 1e-4, tests/real), the prompt in chunks of 512;
- ``chunked``: the PyTorch library path with the export's own press, window, chunk, lookahead and cache format
  (read from its manifest), kept positions tracked at every compaction;
- ``single``: the same press, window and cache format with the prompt in one piece (no chunks, so no lookahead);
  the cache's capacity is the same budget + window;
- ``export``: the export on onnxruntime (:class:`~kvexport.runtime.onnxruntime.OrtGenerator`), kept positions
  tracked, compared with ``chunked``'s at each compaction: how many (layer, head) sets are equal, and the share
  of kept positions the two have in common (the raw sets: an int8 cache's near-tied scores may rank differently
  in the two runtimes), and ``validate`` on the same prompt: kvexport's parity check, which follows the export's
  choice among candidates tied within the cache format's score tolerance and then requires equal kept sets.

A hit is the key's five digits in the decoded answer. The JSON holds every answer and the per-compaction counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def kept_agreement(a: list, b: list) -> dict:
    """(layer, head) kept sets of two runs, compaction by compaction: equal sets and shared positions."""
    if len(a) != len(b):
        return {"compactions": [len(a), len(b)], "equal_sets": 0, "sets": 0, "shared": 0.0}
    equal = sets = 0
    shared = total = 0
    for ca, cb in zip(a, b, strict=True):
        for la, lb in zip(ca, cb, strict=True):
            la, lb = np.asarray(la), np.asarray(lb)
            for row_a, row_b in zip(la.reshape(-1, la.shape[-1]), lb.reshape(-1, lb.shape[-1]), strict=True):
                sa, sb = set(row_a[row_a >= 0].tolist()), set(row_b[row_b >= 0].tolist())
                sets += 1
                equal += sa == sb
                shared += len(sa & sb)
                total += max(len(sa), len(sb))
    return {"compactions": len(a), "equal_sets": equal, "sets": sets, "shared": shared / total if total else 1.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="an ONNX export directory (DIR/onnx of a conversion)")
    ap.add_argument("--lengths", default="4096,8184")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", default="", help="rows not to run, e.g. original,single (comma-separated)")
    ap.add_argument("--out", default=None, help="a JSON file for every answer")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from kvexport.eval.longctx import passkey_example
    from kvexport.export import validation
    from kvexport.export.source import press_from_dict
    from kvexport.generation import generate as torch_generate
    from kvexport.manifest import read_manifest
    from kvexport.mla.io import load_decoder
    from kvexport.models.attention import fused_eager_attention
    from kvexport.models.loading import load_tokenizer
    from kvexport.runtime import OrtGenerator
    from kvexport.runtime import generate as ort_generate

    s = read_manifest(a.export)["settings"]
    source = s["source"]
    dec, _ = load_decoder(source)
    dec.eval()
    tok = load_tokenizer(source)
    press = press_from_dict(s["press"])
    kv = s.get("kv_dtype") or None
    gen = OrtGenerator(a.export, threads=a.threads)
    setting = {k: s.get(k) for k in ("press", "window", "chunk", "lookahead", "kv_dtype", "max_positions")}
    print(f"export {a.export}: {setting}; load {os.getloadavg()[0]:.2f}", flush=True)
    rows, skip = [], set(filter(None, a.skip.split(",")))
    names = [n for n in ("original", "chunked", "single", "export") if n not in skip]
    for n in (int(x) for x in a.lengths.split(",")):
        for depth in (float(x) for x in a.depths.split(",")):
            ex = passkey_example(tok, n, depth)
            ids = torch.tensor([ex.prompt])
            row = {"length": n, "depth": depth, "answer": ex.answer}
            runs = {}
            with torch.no_grad(), fused_eager_attention():
                for name, kw in (("original", {"press": None, "chunk": 512}),
                                 ("chunked", {"press": press, "chunk": s["chunk"], "lookahead": s.get("lookahead") or 0,
                                              "kv_dtype": kv, "window": s["window"], "track_kept": True}),
                                 ("single", {"press": press, "chunk": None, "kv_dtype": kv, "window": s["window"]})):
                    if name in skip:
                        continue
                    t = time.time()
                    runs[name] = torch_generate(dec, ids, max_new_tokens=a.new, **kw)
                    row[name] = {"text": tok.decode(runs[name].tokens[0].tolist()),
                                 "seconds": round(time.time() - t, 1)}
            t = time.time()
            got = ort_generate(gen, ids.numpy(), None, a.new, track_kept=True)
            row["export"] = {"text": tok.decode(got.tokens[0].tolist()), "seconds": round(time.time() - t, 1),
                             "tokens_equal_chunked": got.tokens[0].tolist() == runs["chunked"].tokens[0].tolist(),
                             "kept": kept_agreement([[k.numpy() if hasattr(k, "numpy") else k for k in c]
                                                     for c in runs["chunked"].kept_positions], got.kept_positions)}
            t = time.time()
            rep = validation.validate(a.export, prompts=[ex.prompt], steps=a.new, fidelity=False, write=False)
            pair = rep["pairs"]["pytorch~onnxruntime"]
            row["parity"] = {k: pair[k] for k in ("passed", "token_agreement", "index_agreement", "compared_kept_sets",
                                                  "ties_followed", "max_abs_logit_error")}
            row["parity"]["seconds"] = round(time.time() - t, 1)
            for name in names:
                row[name]["hit"] = ex.answer in row[name]["text"]
            rows.append(row)
            k = row["export"]["kept"]
            print(f"{n:>5} @ {depth:.1f} key {ex.answer}: " + "  ".join(
                f"{name} {'HIT ' if row[name]['hit'] else 'miss'} {row[name]['text']!r}"
                for name in names)
                + f"  | export~chunked tokens {'equal' if row['export']['tokens_equal_chunked'] else 'DIFFER'},"
                f" kept sets {k['equal_sets']}/{k['sets']} equal over {k['compactions']} compactions"
                f" (shared {k['shared']:.4f}); validate: kept sets {row['parity']['index_agreement']:.3f}, tokens"
                f" {row['parity']['token_agreement']:.3f}, {'passed' if row['parity']['passed'] else 'FAILED'}",
                flush=True)
    print("\n| length | original | chunked (PyTorch) | single-shot (PyTorch) | export (onnxruntime) | export kept sets "
          "= PyTorch chunked (validate, ties followed) | validate |\n|---:|---|---|---|---|---|---|")
    for n in sorted({r["length"] for r in rows}):
        rs = [r for r in rows if r["length"] == n]
        cnt = {name: sum(r[name]["hit"] for r in rs) if name in names else "-" for name in
               ("original", "chunked", "single", "export")}
        idx = min(r["parity"]["index_agreement"] for r in rs)
        ok = sum(r["parity"]["passed"] for r in rs)
        print(f"| {n} | {cnt['original']}/{len(rs)} | {cnt['chunked']}/{len(rs)} | {cnt['single']}/{len(rs)} | "
              f"{cnt['export']}/{len(rs)} | {idx:.3f} (lowest) | {ok}/{len(rs)} passed |")
    if a.out:
        from kvexport.atomic import atomic_write_bytes

        meta = {"export": str(a.export), "settings": setting, "threads": a.threads,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_end": os.getloadavg()[0]}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(a.out), (json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
