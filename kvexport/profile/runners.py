# SPDX-License-Identifier: Apache-2.0
"""What the profiler times: a runner feeds a prompt and then one token at a time to one backend.

A runner has ``start()`` (a fresh sequence, caches emptied), ``prefill(ids (1, N) int64) -> next token``
and ``decode(token) -> next token`` (greedy), ``files()`` (the model/engine files it loaded) and
``cache_shape`` (:class:`~kvexport.profile.kv_bytes.CacheShape`). Backends:

- ``pytorch``: kvexport's Decoder with the static cache (or a full cache for the baseline).
- ``onnxruntime``: the exported graphs through :class:`kvexport.export.OrtGenerator` (lazy import).
- ``tensorrt``: the engines through kvexport.tensorrt (lazy import; MissingBackend without it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, MissingBackend
from kvexport.profile.kv_bytes import CacheShape


class PyTorchRunner:
    """kvexport's reference path: ``Decoder`` + ``StaticCache`` (press) or a growing full cache.

    decoder: a kvexport Decoder (GQA or MLA attention); press None = full cache sized for
    ``max_tokens``; chunk: prefill chunk length (None = one shot).
    """

    backend = "pytorch"

    def __init__(self, decoder, press=None, budget: int | None = None, window: int = 32, chunk: int | None = 512,
                 max_tokens: int = 8192, files: list[Path] | None = None, cache_shape: CacheShape | None = None):
        self.decoder, self.press, self.budget, self.window, self.chunk = decoder, press, budget, window, chunk
        self.max_tokens = int(max_tokens)
        self._files = list(files or [])
        self.cache_shape = cache_shape
        self.cache = None
        self.next_pos = 0

    def files(self) -> list[Path]:
        return self._files

    def start(self, total_tokens: int | None = None) -> None:
        L = self.decoder.spec.num_layers
        if self.press is None:
            budgets = [int(total_tokens or self.max_tokens)] * L
            window = 1
        else:
            budgets = self.press.layer_budgets(L, int(self.budget or 0) or int(total_tokens or self.max_tokens))
            window = self.window
        self.cache = self.decoder.new_cache(1, self.press, budgets, window)
        self.next_pos = 0

    def prefill(self, ids: np.ndarray) -> int:
        import torch

        from kvexport.generation import prefill

        t = torch.as_tensor(ids, dtype=torch.long)
        pos = torch.arange(t.shape[1], dtype=torch.long)[None]
        with torch.no_grad():
            logits = prefill(self.decoder, self.cache, t, pos, self.chunk)
        self.next_pos = t.shape[1]
        return int(logits[0, -1].argmax())

    def decode(self, token: int) -> int:
        import torch

        with torch.no_grad():
            logits = self.decoder(torch.tensor([[token]]), torch.tensor([[self.next_pos]]), self.cache, mode="decode")
        self.next_pos += 1
        return int(logits[0, -1].argmax())


class OrtRunner:
    """Exported graphs on onnxruntime, one step at a time, through :class:`kvexport.export.OrtGenerator`.

    The generator's ``generate()`` runs a whole request; the profiler needs each step on its own, so this
    runner drives the generator's sessions and cache buffers with the same host rules as
    ``OrtGenerator._generate_static`` / ``_generate_dynamic`` (chunked prefill with the last chunk padded,
    decode at slot ``fill``, host-triggered compaction; the baseline feeds its growing past back, and takes
    the prompt in chunks of the export's ``chunk`` too, so both variants prefill the same way).
    """

    backend = "onnxruntime"

    def __init__(self, export_dir: Path, cache_shape: CacheShape | None = None, providers: list[str] | None = None):
        try:
            from kvexport.export import OrtGenerator
        except ImportError as e:  # the export package is missing from this install
            raise MissingBackend(f"the onnxruntime runner needs kvexport.export ({e})") from None
        self.dir = Path(export_dir)
        self.gen = OrtGenerator(self.dir, providers=providers)
        self.cache_shape = cache_shape
        self.s = self.gen.settings
        if int(self.s["batch"]) != 1:
            raise BadArtifact(f"{self.dir} was exported for batch {self.s['batch']}; the profiler runs batch 1")

    def files(self) -> list[Path]:
        return sorted(p for p in self.dir.rglob("*") if p.is_file() and (p.suffix == ".onnx" or p.name.endswith(".data")))

    # ------------------------------------------------------------------ static cache graphs
    def start(self, total_tokens: int | None = None) -> None:
        g = self.gen
        self.next_pos = 0
        if g.dynamic:
            sess = g.sessions["model"]
            self.past = {}
            for inp in sess.get_inputs():
                if inp.name.startswith("past_") and inp.name != "past_positions":
                    shp = list(inp.shape)
                    shp[0], shp[2] = 1, 0
                    self.past[inp.name] = np.zeros(shp, g.dtype)
            self.past_pos = np.zeros((1, 0), np.int64)
        else:
            g.reset()
            self.fill = [0] * len(g.layers)

    def _feeds(self, graph: str, **candidates: np.ndarray) -> dict[str, np.ndarray]:
        """The host inputs ``graph`` declares, out of ``candidates`` (the cache tensors are bound by the generator)."""
        names = set(self.s["graphs"][graph]["inputs"])
        missing = [n for n in names if not n.endswith("_in") and n not in candidates]
        if missing:
            raise BadArtifact(f"{self.dir}/{graph}.onnx wants inputs {missing} this profiler does not know; "
                              "profile with a matching kvexport version")
        return {k: v for k, v in candidates.items() if k in names}

    def _logits(self) -> np.ndarray:
        return self.gen.logits.numpy()

    def prefill(self, ids: np.ndarray) -> int:
        ids = np.asarray(ids, dtype=np.int64)
        N = ids.shape[1]
        pos = np.arange(N, dtype=np.int64)[None]
        self.next_pos = N
        g = self.gen
        C = int(self.s["chunk"])
        if g.dynamic:
            # the growing-past graph takes any number of new tokens: feed the prompt in the same chunks as the
            # static export (one shot would need a (heads, N, N) score tensor: 1 GiB per layer at 8k tokens)
            logits = None
            for c in range(0, N, C):
                logits = self._run_dynamic(ids[:, c:c + C], pos[:, c:c + C])
            return int(logits[:, -1].argmax(-1)[0]) if logits.ndim == 3 else int(logits.argmax(-1)[0])
        n_chunks = -(-N // C)
        pad = n_chunks * C - N
        if g.press is None and n_chunks * C >= min(g.caps):
            raise BadArtifact(f"a {N}-token prompt does not fit this full-cache export's capacity {min(g.caps)}")
        ids_p = np.concatenate([ids, np.zeros((1, pad), np.int64)], axis=1)
        pos_p = np.concatenate([pos, np.full((1, pad), -1, np.int64)], axis=1)
        for c in range(n_chunks):
            last_index = (N - 1 - c * C) if c == n_chunks - 1 else C - 1
            g._run("prefill", self._feeds("prefill", input_ids=ids_p[:, c * C:(c + 1) * C],
                                          positions=pos_p[:, c * C:(c + 1) * C],
                                          last_index=np.array([last_index], np.int64),
                                          fill=np.array(self.fill, np.int64)))
            if g.press is not None:
                self.fill = [min(f + C, b) for f, b in zip(self.fill, g.budgets, strict=False)]
            else:
                self.fill = [f + C for f in self.fill]
        return int(self._logits().argmax(-1)[0])

    def decode(self, token: int) -> int:
        g = self.gen
        tok = np.array([[int(token)]], np.int64)
        pos = np.array([[self.next_pos]], np.int64)
        self.next_pos += 1
        if g.dynamic:
            logits = self._run_dynamic(tok, pos)
            return int(logits[:, -1].argmax(-1)[0]) if logits.ndim == 3 else int(logits.argmax(-1)[0])
        g._run("decode", self._feeds("decode", input_ids=tok, positions=pos, slot=np.array(self.fill, np.int64)))
        out = int(self._logits().argmax(-1)[0])
        self.fill = [f + 1 for f in self.fill]
        if g.press is not None and any(f >= c for f, c in zip(self.fill, g.caps, strict=False)):
            g._run("compact", self._feeds("compact", fill=np.array(self.fill, np.int64)))
            self.fill = [min(f, b) for f, b in zip(self.fill, g.budgets, strict=False)]
        return out

    # ------------------------------------------------------------------ the growing-past baseline
    def _run_dynamic(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        g = self.gen
        sess = g.sessions["model"]
        outs_names = self.s["graphs"]["model"]["outputs"]
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        io.bind_cpu_input("positions", np.ascontiguousarray(pos))
        io.bind_cpu_input("past_positions", np.ascontiguousarray(self.past_pos))
        for name, v in self.past.items():
            if isinstance(v, np.ndarray):
                io.bind_cpu_input(name, v)
            else:
                io.bind_ortvalue_input(name, v)
        for name in outs_names:
            io.bind_output(name, g.device)
        sess.run_with_iobinding(io)
        outs = dict(zip(outs_names, io.get_outputs(), strict=False))
        self.past = {n.replace("present_", "past_"): outs[n] for n in outs_names
                     if n.startswith("present_k") or n.startswith("present_v")}
        self.past_pos = outs["present_positions"].numpy()
        return outs["logits"].numpy()


class TensorRTRunner(OrtRunner):
    """Engines built by ``kvexport build-engine`` (lazy import of kvexport.tensorrt)."""

    backend = "tensorrt"

    def __init__(self, export_dir: Path, cache_shape: CacheShape | None = None):
        try:
            from kvexport.tensorrt import TrtGenerator  # type: ignore[attr-defined]
        except ImportError:
            raise MissingBackend("the tensorrt backend needs TensorRT and kvexport.tensorrt's runtime; "
                                 "install TensorRT >= 10.3 (pip install 'kvexport[tensorrt]' on an NVIDIA GPU or "
                                 "JetPack) and build engines with `kvexport build-engine DIR`") from None
        self.dir = Path(export_dir)
        self.gen = TrtGenerator(self.dir)
        self.cache_shape = cache_shape

    def files(self) -> list[Path]:
        return sorted(p for p in self.dir.rglob("*") if p.is_file() and p.suffix in (".onnx", ".data", ".engine",
                                                                                      ".plan", ".so"))


__all__ = ["PyTorchRunner", "OrtRunner", "TensorRTRunner"]
