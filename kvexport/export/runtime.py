# SPDX-License-Identifier: Apache-2.0
"""Run an export directory with onnxruntime: chunked prefill, greedy decode, host-driven compaction.

Static exports use IO binding with every cache tensor allocated once as an ``OrtValue`` (on the
session's device). A graph's cache outputs have the same shapes as its inputs; the runner keeps two
buffers per cache tensor and swaps them after each call (ping-pong), because onnxruntime does not
promise that a general graph may read and write the same buffer. Memory therefore stays fixed at
2 x the cache, whatever the number of steps. The host keeps the per-layer fill counts (the rules are
in :mod:`kvexport.export.graphs`).

The ``--dynamic-cache`` baseline binds its growing ``present_*`` outputs to fresh buffers each step
(that growth is the point of the comparison).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.export.manifest import ONNX_EXPORT as KIND
from kvexport.export.manifest import verify_manifest

NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}


@dataclass
class OrtGenerationResult:
    tokens: np.ndarray  # (B, n_new) int64
    prompt_logits: np.ndarray  # (B, V) at the last prompt token
    step_logits: list[np.ndarray] = field(default_factory=list)  # per decode step (B, V)
    kept_positions: list[list[np.ndarray]] = field(default_factory=list)  # per compaction, per layer (B, Hc, cap)
    compaction_steps: list[str] = field(default_factory=list)  # "prefill:<chunk>" / "decode:<step>"
    compactions: int = 0
    cache_bytes: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)  # wall time of each decode step (incl. compaction)


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """attention_mask (B, N) 0/1, left padded -> positions (B, N), -1 on padding."""
    m = mask.astype(np.int64)
    return np.where(m.astype(bool), np.cumsum(m, axis=-1) - 1, -1)


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def check_prompt(input_ids, attention_mask, max_new_tokens: int):
    ids = _np(input_ids).astype(np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0 or ids.shape[1] == 0:
        raise BadUsage("the prompt is empty; give at least one token")
    mask = np.ones_like(ids) if attention_mask is None else _np(attention_mask).astype(np.int64).reshape(ids.shape)
    if (mask.sum(-1) == 0).any():
        raise BadUsage("a prompt row is all padding; give at least one token per row")
    if int(max_new_tokens) < 1:
        raise BadUsage(f"max_new_tokens {max_new_tokens} must be >= 1")
    return ids, mask


class OrtGenerator:
    """Greedy generation from an export directory (verified against its manifest first).

    ``OrtGenerator(dir, providers=None)``: providers default to CUDA when onnxruntime offers it, else CPU.
    :meth:`generate` takes input_ids / attention_mask (B, N) with B = the export's batch.

    Step API (what :meth:`generate`, the profiler and long-run drivers use): :meth:`prefill` (resets, feeds the
    prompt, returns the last logits (B, V)), :meth:`decode` (one token per sequence -> logits (B, V)),
    :meth:`kept_positions`, the ``compactions`` counter and the ``on_compaction`` callback. Nothing is kept
    per step, so memory stays flat however long the run.
    """

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                 share_weights: bool = True):
        try:
            import onnxruntime as ort
        except ImportError:  # pragma: no cover - onnxruntime is a dependency
            raise MissingBackend("onnxruntime is not installed; pip install onnxruntime") from None
        self.path = Path(path)
        self.manifest = verify_manifest(self.path, KIND)
        self.settings = s = self.manifest["settings"]
        if providers is None:
            avail = ort.get_available_providers()
            providers = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in avail else []
            providers.append("CPUExecutionProvider")
        self.providers = providers
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = int(threads)
        self._ort = ort
        graphs = {name: g for name, g in s["graphs"].items() if isinstance(g, dict) and "file" in g}
        opts = {name: so for name in graphs}
        self._shared: dict = {}
        if share_weights and self.device == "cpu" and len(graphs) > 1:
            opts = self._share_initializers(graphs, threads)
        self.sessions = {name: ort.InferenceSession(str(self.path / g["file"]), opts[name], providers=providers)
                         for name, g in graphs.items()}
        self.batch = int(s["batch"])
        self.dtype = NP_DTYPES[s["dtype"]]
        self.dynamic = s["mode"] == "dynamic"
        self.press = s["press"]
        self.on_compaction = None  # callable(where: "prefill:<chunk>" | "decode:<step>", generator) per compaction
        self.last_logits = None
        if not self.dynamic:
            self._alloc()
        self.reset()

    def _share_initializers(self, graphs: dict, threads: int | None) -> dict:
        """One copy of every external weight for all graphs of the export (CPU).

        prefill.onnx and decode.onnx each carry the model's weights (under exporter-chosen names); loaded
        as they are, onnxruntime would keep one copy per session. Identical tensors (same bytes, dtype and
        shape) are read once and handed to every session with ``SessionOptions.add_initializer``; weight
        prepacking is disabled for those sessions, since it would make a packed copy per session again.
        """
        import hashlib

        import onnx

        np_types = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
                    onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.DOUBLE: np.float64}
        opts = {}
        for name, g in graphs.items():
            so = self._ort.SessionOptions()
            so.log_severity_level = 3
            if threads:
                so.intra_op_num_threads = int(threads)
            if g.get("external_data"):
                so.add_session_config_entry("session.disable_prepacking", "1")
                model = onnx.load(str(self.path / g["file"]), load_external_data=False)
                for t in model.graph.initializer:
                    if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type not in np_types:
                        continue
                    info = {e.key: e.value for e in t.external_data}
                    raw = np.fromfile(self.path / info["location"], dtype=np.uint8, count=int(info["length"]),
                                      offset=int(info.get("offset", 0)))
                    key = hashlib.sha256(raw.data).hexdigest() + f":{t.data_type}:{list(t.dims)}"
                    if key not in self._shared:
                        arr = raw.view(np_types[t.data_type]).reshape(list(t.dims))
                        self._shared[key] = (arr, self._ort.OrtValue.ortvalue_from_numpy(arr))
                    so.add_initializer(t.name, self._shared[key][1])
            opts[name] = so
        return opts

    # ------------------------------------------------------------------ buffers
    def _ov(self, arr: np.ndarray):
        return self._ort.OrtValue.ortvalue_from_numpy(arr, self.device, 0)

    def _init_cache_layout(self) -> None:
        """Host-side cache layout shared by every backend (this runner and the TensorRT one).

        Sets ``layers``, ``budgets``, ``caps`` (per layer), ``initial`` (name -> empty host array: ``k_i``
        (B, Hc, cap, Dk), ``v_i`` (B, Hc, cap, Dv), ``pos_i`` (B, Hc, cap) int64 -1, and with a press ``qbuf_i``
        (B, Hq, W, Dq) and ``qpos`` (B, W) int64 -1) and ``cache_bytes`` (the K/V bytes)."""
        s = self.settings
        B, W = self.batch, int(s["window"])
        self.layers = s["graphs"]["layers"]
        self.budgets = [int(x["budget"]) for x in self.layers]
        self.caps = [int(x["capacity"]) for x in self.layers]
        self.initial: dict[str, np.ndarray] = {}
        for i, ly in enumerate(self.layers):
            H, cap = ly["heads"], ly["capacity"]
            self.initial[f"k_{i}"] = np.zeros((B, H, cap, ly["key_dim"]), self.dtype)
            self.initial[f"v_{i}"] = np.zeros((B, H, cap, ly["value_dim"]), self.dtype)
            self.initial[f"pos_{i}"] = np.full((B, H, cap), -1, np.int64)
            if self.press is not None:
                self.initial[f"qbuf_{i}"] = np.zeros((B, ly["q_heads"], W, ly["q_dim"]), self.dtype)
        if self.press is not None:
            self.initial["qpos"] = np.full((B, W), -1, np.int64)
        self.cache_bytes = sum(a.nbytes for n, a in self.initial.items() if n[0] in "kv")
        self._io_plans: dict[str, tuple] = {}

    def _io_plan(self, graph: str) -> tuple[list[tuple[str, str]], list[tuple[str, str | None]], frozenset[str]]:
        """What a call of ``graph`` binds, worked out once per graph (not per decode step): cache inputs
        [(``<base>_in``, base)], outputs [(``logits``, None) or (``<base>_out``, base)] in graph order, and the
        names of its host inputs."""
        plan = self._io_plans.get(graph)
        if plan is None:
            g = self.settings["graphs"][graph]
            ins = [(n, n[:-3]) for n in g["inputs"] if n.endswith("_in")]
            outs = [(n, None if n == "logits" else n[:-4]) for n in g["outputs"] if n == "logits" or n.endswith("_out")]
            host = frozenset(n for n in g["inputs"] if not n.endswith("_in"))
            plan = self._io_plans[graph] = (ins, outs, host)
        return plan

    def _alloc(self) -> None:
        """Two OrtValues per cache tensor (ping-pong) and one for the logits, made once."""
        self._init_cache_layout()
        self.buffers = {n: [self._ov(a.copy()), self._ov(a.copy())] for n, a in self.initial.items()}
        self.cur = dict.fromkeys(self.initial, 0)
        self.logits = self._ov(np.zeros((self.batch, int(self.settings["vocab_size"])), self.dtype))

    def _reset_buffers(self) -> None:
        for n, a in self.initial.items():
            self.buffers[n][self.cur[n]].update_inplace(a)

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> None:
        """Bind small host inputs + the current cache buffers, write into the other buffers, then swap."""
        sess = self.sessions[graph]
        io = sess.io_binding()
        ins, outs, _ = self._io_plan(graph)
        for name, arr in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(arr))
        swapped = []
        for name, base in ins:
            io.bind_ortvalue_input(name, self.buffers[base][self.cur[base]])
        for name, base in outs:
            if base is None:
                io.bind_ortvalue_output(name, self.logits)
            else:
                io.bind_ortvalue_output(name, self.buffers[base][1 - self.cur[base]])
                swapped.append(base)
        sess.run_with_iobinding(io)
        for base in swapped:
            self.cur[base] = 1 - self.cur[base]

    def _positions_now(self) -> list[np.ndarray]:
        return [self.buffers[f"pos_{i}"][self.cur[f"pos_{i}"]].numpy().copy() for i in range(len(self.layers))]

    # ------------------------------------------------------------------ step API
    def reset(self) -> None:
        """Start a new sequence: empty every cache buffer and the host bookkeeping (fill counts, positions)."""
        B = self.batch
        self.step = 0  # decode steps since the prefill
        self.compactions = 0
        self.next_pos = np.zeros(B, np.int64)  # (B,) position of the next token
        self.last_logits: np.ndarray | None = None  # (B, V)
        if self.dynamic:
            self._past: dict = {}
            for inp in self.sessions["model"].get_inputs():
                if inp.name.startswith("past_") and inp.name != "past_positions":
                    shp = list(inp.shape)
                    shp[0], shp[2] = B, 0
                    self._past[inp.name] = np.zeros(shp, self.dtype)
            self._past_pos = np.zeros((B, 0), np.int64)
        else:
            self._reset_buffers()
            self.fill = [0] * len(self.layers)

    def kept_positions(self) -> list[np.ndarray]:
        """Positions held in each layer's cache now: per layer (B, Hc, cap) int64, -1 = empty slot (copies).

        For the growing-past baseline: one (B, 1, n) array of the positions fed so far."""
        if self.dynamic:
            return [self._past_pos[:, None].copy()]
        return self._positions_now()

    def _compacted(self, where: str) -> None:
        self.compactions += 1
        if self.on_compaction is not None:
            self.on_compaction(where, self)

    def _check_length(self, ids: np.ndarray, mask: np.ndarray) -> None:
        n = int(mask.sum(-1).max())
        limit = int(self.settings.get("max_positions") or 0)
        if limit and n > limit:
            raise BadUsage(f"prompt of {n} tokens exceeds the export's maximum {limit} (max_positions)")

    def prefill(self, input_ids, attention_mask=None) -> np.ndarray:
        """Reset, then feed the prompt ``input_ids`` (B, N) (``attention_mask`` (B, N) 0/1, left padded).

        Static exports run the prefill graph on chunks of the export's ``chunk`` (the last one padded with
        position -1); a press compacts whenever a chunk overflows a layer's budget. Returns the logits of the
        last prompt token, (B, V) (a copy)."""
        ids, mask = check_prompt(input_ids, attention_mask, 1)
        if ids.shape[0] != self.batch:
            raise BadUsage(f"this export takes batches of {self.batch} prompt(s), got {ids.shape[0]}")
        self._check_length(ids, mask)
        pos = positions_from_mask(mask)
        N, B = ids.shape[1], self.batch
        C = int(self.settings["chunk"])
        n_chunks = math.ceil(N / C)
        if not self.dynamic and self.press is None and n_chunks * C >= min(self.caps):
            raise BadUsage(f"prompt ({N} tokens, {n_chunks * C} with chunk padding) does not fit this full-cache "
                           f"export's capacity {min(self.caps)}")
        self.reset()
        self.next_pos = pos.max(axis=1) + 1
        if self.dynamic:
            for c in range(0, N, C):
                last = self._run_dynamic(ids[:, c:c + C], pos[:, c:c + C])
            self.last_logits = last
            return last.copy()
        pad = n_chunks * C - N
        ids_p = np.concatenate([ids, np.zeros((B, pad), np.int64)], axis=1)
        pos_p = np.concatenate([pos, np.full((B, pad), -1, np.int64)], axis=1)
        for c in range(n_chunks):
            last_index = (N - 1 - c * C) if c == n_chunks - 1 else C - 1
            self._run("prefill", self._feeds("prefill", input_ids=ids_p[:, c * C:(c + 1) * C],
                                             positions=pos_p[:, c * C:(c + 1) * C],
                                             last_index=np.array([last_index], np.int64),
                                             fill=np.array(self.fill, np.int64)))
            if self.press is not None:
                compacted = any(f + C > b for f, b in zip(self.fill, self.budgets, strict=False))
                self.fill = [min(f + C, b) for f, b in zip(self.fill, self.budgets, strict=False)]
                if compacted:
                    self._compacted(f"prefill:{c}")
            else:
                self.fill = [f + C for f in self.fill]
        self.last_logits = self.logits.numpy().copy()
        return self.last_logits.copy()

    def decode(self, token) -> np.ndarray:
        """Feed one token per sequence, ``token`` (B,) int (or an int for batch 1), at the next position; returns
        its logits (B, V). A press export compacts (host-triggered) when any layer's cache is full."""
        if getattr(self, "last_logits", None) is None:
            raise BadUsage("decode() before prefill(); call prefill(input_ids) first")
        tok = np.asarray(token, dtype=np.int64).reshape(self.batch)
        pos = self.next_pos[:, None].astype(np.int64)
        if self.dynamic:
            last = self._run_dynamic(tok[:, None], pos)
        else:
            self._run("decode", self._feeds("decode", input_ids=tok[:, None], positions=pos,
                                            slot=np.array(self.fill, np.int64)))
            last = self.logits.numpy().copy()
            self.fill = [f + 1 for f in self.fill]
            if self.press is not None and any(f >= c for f, c in zip(self.fill, self.caps, strict=False)):
                self._run("compact", self._feeds("compact", fill=np.array(self.fill, np.int64)))
                self.fill = [min(f, b) for f, b in zip(self.fill, self.budgets, strict=False)]
                self._compacted(f"decode:{self.step}")
        self.step += 1
        self.next_pos = self.next_pos + 1
        self.last_logits = last
        return last.copy()

    def _feeds(self, graph: str, **candidates: np.ndarray) -> dict[str, np.ndarray]:
        """The host inputs ``graph`` declares, out of ``candidates`` (cache tensors are bound separately)."""
        names = self._io_plan(graph)[2]
        missing = sorted(n for n in names if n not in candidates)
        if missing:
            raise BadArtifact(f"{self.path}/{graph}.onnx wants inputs {missing} this runtime does not know; "
                              "run it with a matching kvexport version")
        return {k: v for k, v in candidates.items() if k in names}

    def _run_dynamic(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """One call of the growing-past graph; returns the last token's logits (B, V)."""
        sess = self.sessions["model"]
        names = self.settings["graphs"]["model"]["outputs"]
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        io.bind_cpu_input("positions", np.ascontiguousarray(pos))
        io.bind_cpu_input("past_positions", np.ascontiguousarray(self._past_pos))
        for name, v in self._past.items():
            if isinstance(v, np.ndarray):
                io.bind_cpu_input(name, v)
            else:
                io.bind_ortvalue_input(name, v)
        for name in names:
            io.bind_output(name, self.device)
        sess.run_with_iobinding(io)
        outs = dict(zip(names, io.get_outputs(), strict=False))
        self._past = {n.replace("present_", "past_"): outs[n] for n in names
                      if n.startswith("present_k") or n.startswith("present_v")}
        self._past_pos = outs["present_positions"].numpy()
        logits = outs["logits"].numpy()
        return logits[:, -1] if logits.ndim == 3 else logits

    def current_cache_bytes(self) -> int:
        """Bytes of K/V cache held now (fixed for static exports; the growing past for the baseline)."""
        if self.dynamic:
            return sum(v.numpy().nbytes if not isinstance(v, np.ndarray) else v.nbytes for v in self._past.values())
        return self.cache_bytes

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 32, eos_token_id: int | None = None,
                 forced_tokens=None, track_kept: bool = True, keep_logits: bool = False) -> OrtGenerationResult:
        """Greedy decoding on top of :meth:`prefill` / :meth:`decode`.

        ``forced_tokens (B, n)`` feeds those tokens instead of the argmax (teacher forcing, for parity runs).
        ``keep_logits``: keep every decode step's logits (B, V) in ``step_logits`` (memory grows with the
        steps; off by default). ``track_kept``: copy the kept positions after each compaction."""
        ids, mask = check_prompt(input_ids, attention_mask, max_new_tokens)
        if ids.shape[0] != self.batch:
            raise BadUsage(f"this export takes batches of {self.batch} prompt(s), got {ids.shape[0]}")
        if not self.dynamic and self.press is None:
            C, N = int(self.settings["chunk"]), ids.shape[1]
            n_chunks = math.ceil(N / C)
            if n_chunks * C + max_new_tokens > min(self.caps):
                raise BadUsage(f"prompt ({N} tokens, {n_chunks * C} with chunk padding) + {max_new_tokens} new tokens "
                               f"do not fit this full-cache export's capacity {min(self.caps)}")
        B = self.batch
        res = OrtGenerationResult(tokens=np.zeros((B, 0), np.int64), prompt_logits=np.zeros(0))

        previous = self.on_compaction

        def on_compaction(where, gen):
            if track_kept:
                res.kept_positions.append(gen.kept_positions())
                res.compaction_steps.append(where)
            if previous is not None:  # the caller's own callback still sees every compaction
                previous(where, gen)

        self.on_compaction = on_compaction
        try:
            t0 = time.perf_counter()
            last = self.prefill(ids, mask)
            res.prompt_logits = last
            res.prefill_seconds = time.perf_counter() - t0
            done = np.zeros(B, bool)
            out = []
            for step in range(max_new_tokens):
                tok = self._next_token(last, step, forced_tokens, done, eos_token_id)
                out.append(tok)
                if step == max_new_tokens - 1 or (eos_token_id is not None and done.all()):
                    break
                t0 = time.perf_counter()
                last = self.decode(tok)
                res.decode_seconds.append(time.perf_counter() - t0)
                if keep_logits:
                    res.step_logits.append(last)
        finally:
            self.on_compaction = previous
        res.tokens = np.stack(out, axis=1)
        res.compactions = self.compactions
        res.cache_bytes = self.current_cache_bytes()
        return res

    def _next_token(self, last, step, forced, done, eos):
        tok = last.argmax(-1).astype(np.int64) if forced is None else _np(forced)[:, step].astype(np.int64)
        if eos is not None:
            tok = np.where(done, eos, tok)
            done |= tok == eos
        return tok
