# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert`` on real-size checkpoints: per-stage wall time and peak RSS against the weight bytes.

    python -m benchmarks.bench_realsize                          # student, qwen3-385m, llama-1b (default settings)
    python -m benchmarks.bench_realsize --shapes qwen3-385m --press snapkv --budget 256   # eviction only, no MLA
    python -m benchmarks.bench_realsize --shapes student --out /tmp/rs --cprofile export

Shapes (random weights of the real layer shapes, saved once as fp32 safetensors under ``--cache``):

    student      models/kvx-student (4 layers, hidden 128, vocabulary 4096, tied): 1.3M parameters
    qwen3-385m   Qwen3-0.6B's layers (28 × hidden 1024, 16/8 heads of 128, MLP 2048), vocabulary 32k, tied: 385M
    llama-1b     Llama-3.2-1B's layers (16 × hidden 2048, 32/8 heads of 64, MLP 8192), vocabulary 32k, tied: 1.04B
    smollm2      SmolLM2-135M-Instruct, the real pretrained weights (kvexport get smollm2; 30 × hidden 576, 9/3 heads
                 of 64, MLP 1536, vocabulary 49,152, tied): 135M

Each shape converts in its own process (``kvexport.convert.run_convert``, as ``kvexport convert`` runs it). Before
every stage the process's RSS high-water mark is reset (``/proc/self/clear_refs``), so each stage's peak is its own;
the table gives it in GB and as a multiple of the fp32 weight bytes, with the RSS left when the stage ends, its wall
time, the bytes each artifact directory holds, the decode p50 of the profile at each context and the weight-read
bound of that step (weight bytes / this machine's copy bandwidth, measured in the same process). Writes
``realsize.json`` and ``realsize.md`` into ``--out``; ``--cprofile STAGE`` also writes ``<shape>-<stage>.pstats``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("load", "choose", "rewrite", "distill", "export", "engine", "validate", "profile", "report")


@dataclass(frozen=True)
class RealShape:
    name: str
    family: str  # transformers config family
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool = True
    max_positions: int = 32768
    source: str | None = None  # a bundled checkpoint instead of random weights


SHAPES = {
    "student": RealShape("student", "llama", 4, 128, 4, 2, 32, 384, 4096, source="models/kvx-student"),
    "qwen3-385m": RealShape("qwen3-385m", "qwen3", 28, 1024, 16, 8, 128, 2048, 32000),
    "llama-1b": RealShape("llama-1b", "llama", 16, 2048, 32, 8, 64, 8192, 32000),
    # the real pretrained model (kvexport get smollm2: GGUF Q4_1 from the registry, dequantized to fp32)
    "smollm2": RealShape("smollm2", "llama", 30, 576, 9, 3, 64, 1536, 49152, max_positions=8192,
                         source="registry:smollm2"),
}


def parameters(s: RealShape) -> int:
    """Parameter count of the shape (embeddings once when tied; Qwen3's q/k norms included)."""
    H, D, F = s.hidden, s.head_dim, s.intermediate
    attn = H * s.heads * D * 2 + H * s.kv_heads * D * 2 + (2 * D if s.family == "qwen3" else 0)
    layer = attn + 3 * H * F + 2 * H
    return s.layers * layer + s.vocab * H * (1 if s.tie else 2) + H


def checkpoint(s: RealShape, cache: Path) -> Path:
    """The HF directory of ``s``: the bundled one, or random weights saved once (fp32 safetensors)."""
    if s.source is not None and s.source.startswith("registry:"):
        from kvexport.models import fetch

        return fetch.hf_dir(s.source.split(":", 1)[1])
    if s.source is not None:
        return REPO / s.source
    out = cache / "models" / s.name
    if (out / "config.json").is_file():
        return out
    import torch

    from kvexport.models.tiny import tiny_config

    cfg = tiny_config(s.family, vocab_size=s.vocab, hidden_size=s.hidden, layers=s.layers, heads=s.heads,
                      kv_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                      max_positions=s.max_positions, tie_word_embeddings=s.tie, bos_token_id=0, eos_token_id=1,
                      pad_token_id=2)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.dim() == 2:  # scaled like kvexport.models.tiny so that attention is not uniform
            state[name] = torch.randn(p.shape, generator=g) * (p.shape[1] ** -0.5)
        else:
            state[name] = torch.ones(p.shape)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(tmp)
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------- the measured child
def _status_kb(key: str, pid: int | str = "self") -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # a child that has just ended
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _descendants(pid: int | str = "self") -> list[int]:
    """Every live process below ``pid`` (a stage may run part of its work in a child: convert's export)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children") if Path(f"/proc/{p}/task").is_dir() else ():
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Split:
    """Samples RssAnon and RssFile every 20 ms (VmHWM does not split them), summed over this process and every
    process below it (a child's memory is the conversion's too; the file pages of the libraries both map count
    twice): the peak of each and their split at the sampled peak of their sum, so a stage's peak says how much of it
    is file pages the kernel may drop."""

    def __init__(self):
        import threading
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[int, int]:
        pids = ["self", *_descendants()]
        return (sum(_status_kb("RssAnon", p) for p in pids) * 1024, sum(_status_kb("RssFile", p) for p in pids) * 1024)

    def _run(self) -> None:
        best = -1
        while not self._stop.wait(0.02):
            anon, file = self._sample()
            self.peak["anon"] = max(self.peak.get("anon", 0), anon)
            self.peak["file"] = max(self.peak.get("file", 0), file)
            if anon + file > best:
                best = anon + file
                self.peak["anon_at_peak"], self.peak["file_at_peak"] = anon, file

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _decode_p50s(p: dict) -> dict:
    """A profile-onnxruntime.json -> {variant: [{context, decode_ms_p50}, ...]}."""
    return {v: [{"context": r["context"], "decode_ms_p50": r.get("decode_ms_p50")} for r in d.get("contexts") or []]
            for v, d in p["variants"].items()}


def _child(a: argparse.Namespace) -> int:
    """Run one conversion with every stage measured; writes the shape's JSON to ``a.result``."""
    import cProfile

    from benchmarks.bandwidth import copy_bandwidth
    from kvexport.convert import stages as st_mod
    from kvexport.convert.config import ConvertConfig

    bw = copy_bandwidth(mib=256)
    measured: dict[str, dict] = {}
    for name in STAGES:
        fn = getattr(st_mod, f"stage_{name}", None)
        if fn is None:
            continue

        def wrapped(st, _fn=fn, _name=name):
            _reset_peak()
            t0, c0 = time.perf_counter(), time.process_time()
            prof = cProfile.Profile() if _name in a.cprofile else None
            split = _Split()
            try:
                if prof is not None:
                    prof.enable()
                with split:
                    return _fn(st)
            finally:
                if prof is not None:
                    prof.disable()
                    prof.dump_stats(str(Path(a.out) / f"{a.shape}-{_name}.pstats"))
                measured[_name] = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                                   # the sampled sum when a child ran (VmHWM is this process's alone)
                                   "peak_rss": max(_status_kb("VmHWM") * 1024, split.peak.get("anon_at_peak", 0)
                                                   + split.peak.get("file_at_peak", 0)),
                                   "end_rss": _status_kb("VmRSS") * 1024,
                                   **{f"sampled_{k}": v for k, v in split.peak.items()}}
                if a.stage_log:  # each stage as it ends: a run cut short still tells its finished stages' peaks
                    with open(a.stage_log, "a") as fh:
                        fh.write(json.dumps({"shape": a.shape, "stage": _name, **measured[_name]}) + "\n")

        setattr(st_mod, f"stage_{name}", wrapped)
    flags = dict(model=a.model, contexts=a.contexts, seed=0)
    for k in ("press", "budget", "mla_rank", "fp16", "baseline"):
        v = getattr(a, k)
        if v is not None:
            flags[k] = v
    if a.no_fidelity:
        flags["fidelity"] = False
    cfg = ConvertConfig.from_mapping(flags)
    out = Path(a.work)
    start_rss = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    st_mod.run_convert(cfg, out, force=True)
    total = time.perf_counter() - t0
    res = {"stages": measured, "seconds": total, "start_rss": start_rss, "bandwidth": bw,
           "artifacts": {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                         for d in sorted(out.iterdir()) if d.is_dir()},
           "files": {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*"))
                     if f.is_file() and f.stat().st_size > 1 << 20}}
    prof = out / "profile-onnxruntime.json"
    if prof.is_file():
        p = json.loads(prof.read_text())
        res["profile"] = _decode_p50s(p)
        res["machine_load"] = p.get("machine_load")
    conv = json.loads((out / "convert.json").read_text())
    res["convert_stages"] = conv["stages"]
    Path(a.result).write_text(json.dumps(res, indent=1))
    return 0


# ----------------------------------------------------------------------------- the driver
def run_shape(s: RealShape, a: argparse.Namespace, log) -> dict:
    model = checkpoint(s, Path(a.cache))
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    work = Path(a.cache) / "runs" / s.name
    result = Path(a.out) / f"{s.name}.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_realsize", "--child", "--shape", s.name, "--model", str(model),
           "--work", str(work), "--result", str(result), "--out", str(a.out), "--contexts", a.contexts]
    for k in ("press", "budget", "mla_rank"):
        if getattr(a, k) is not None:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.fp16:
        cmd.append("--fp16")
    if a.no_baseline:
        cmd.append("--no-baseline")
    if a.no_fidelity:
        cmd.append("--no-fidelity")
    for c in a.cprofile:
        cmd += ["--cprofile", c]
    if a.stage_log:
        cmd += ["--stage-log", str(Path(a.stage_log).resolve())]
    log(f"{s.name}: converting {model} ({weights / 1e9:.2f} GB of weights)")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    env = dict(os.environ)
    if a.threads:  # torch's intra-op pool (OpenMP/MKL); onnxruntime keeps its own default
        env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    row = {"shape": asdict(s), "parameters": parameters(s), "weight_bytes": weights, "fp32_weight_bytes":
           4 * parameters(s), "wall_seconds": wall, "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
           "returncode": proc.returncode}
    if proc.returncode != 0:
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        log(f"{s.name}: FAILED (rc {proc.returncode})\n{row['error']}")
        return row
    row.update(json.loads(result.read_text()))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return row


def decode_only(s: RealShape, a: argparse.Namespace, log) -> dict:
    """Re-time decode on a conversion kept by an earlier ``--keep`` run (``kvexport profile``), with the copy
    bandwidth measured just before in this process: the decode figures of a quiet machine, without converting
    again. -> the row's ``decode_remeasured``."""
    from benchmarks.bandwidth import copy_bandwidth

    work = Path(a.cache) / "runs" / s.name
    if not (work / "convert.json").is_file():
        raise SystemExit(f"--decode-only: no kept conversion at {work}; run the shape with --keep first")
    out = Path(a.out) / f"{s.name}-decode.json"
    load0 = os.getloadavg()
    bw = copy_bandwidth(mib=256)
    cmd = [sys.executable, "-m", "kvexport", "profile", str(work), "--contexts", a.contexts, "--no-report",
           "--decode-steps", "32", "--repeats", "3", "-o", str(out)]
    if a.no_baseline:
        cmd.append("--no-baseline")
    log(f"{s.name}: timing decode of {work} at {a.contexts}")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{s.name}: kvexport profile failed (rc {proc.returncode}): {(proc.stderr or '')[-400:]}")
    p = json.loads(out.read_text())
    return {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "bandwidth": bw,
            "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
            "profile": _decode_p50s(p),
            "machine_load": p.get("machine_load")}


def _gb(b) -> str:
    return f"{b / 1e9:.2f}"


def _split(m: dict) -> str:
    if "sampled_anon_at_peak" not in m:
        return ""
    return f"{_gb(m['sampled_anon_at_peak'])} / {_gb(m['sampled_file_at_peak'])}"


def markdown(res: dict) -> str:
    lines = [f"# kvexport convert on real-size shapes ({res['date_utc']})", "",
             f"`{res['command']}`; settings {json.dumps(res['settings'])}", ""]
    for r in res["rows"]:  # --merge: each shape's own run
        if "date_utc" in r:
            lines.append(f"- {r['shape']['name']}: {r['date_utc']}, settings {json.dumps(r['settings'])}, load average "
                         f"{r['loadavg_start'][0]:.1f} → {r['loadavg_end'][0]:.1f}, {r['wall_seconds']:.0f} s")
    lines += ["",
             "Peak RSS counts file pages (a memory-mapped checkpoint or weights.data: the kernel's to drop) with "
             "anonymous memory; `anon / file at peak` splits the sampled peak (every 20 ms) where it was sampled.", "",
             "| shape | parameters | fp32 weights GB | stage | wall s | cpu s | peak RSS GB | × weights | "
             "anon / file at peak GB | end RSS GB |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "stages" not in r:
            lines.append(f"| {r['shape']['name']} | {r['parameters'] / 1e6:.1f}M | {_gb(r['fp32_weight_bytes'])} | "
                         f"FAILED | | | | | | |")
            continue
        w = r["fp32_weight_bytes"]
        peak = max(m["peak_rss"] for m in r["stages"].values())
        for name, m in r["stages"].items():
            lines.append(f"| {r['shape']['name']} | {r['parameters'] / 1e6:.1f}M | {_gb(w)} | {name} | "
                         f"{m['seconds']:.1f} | {m['cpu_seconds']:.1f} | {_gb(m['peak_rss'])} | {m['peak_rss'] / w:.2f} | "
                         f"{_split(m)} | {_gb(m['end_rss'])} |")
        lines.append(f"| {r['shape']['name']} | | | **all** | **{r['seconds']:.1f}** | | **{_gb(peak)}** | "
                     f"**{peak / w:.2f}** | | |")
    lines += ["", "The MLA model's own weights differ from the original's (at a low cache compression its latent "
              "factors are larger than the GQA projections they replace): `× its model` compares the export with the "
              "checkpoint it was made from (onnx/ with mla/, baseline/ and mla/ with the original).", "",
              "| shape | artifact | GB | × original weights (chosen dtype) | × its model |", "|---|---|---:|---:|---:|"]
    for r in res["rows"]:
        wb = r["fp32_weight_bytes"] // (2 if r.get("settings", res["settings"]).get("fp16") else 1)
        arts = r.get("artifacts") or {}
        for d, b in arts.items():
            own = arts["mla"] if d == "onnx" and "mla" in arts else wb
            lines.append(f"| {r['shape']['name']} | {d}/ | {_gb(b)} | {b / wb:.2f} | "
                         f"{b / own:.2f} |" if d != "plots" else f"| {r['shape']['name']} | {d}/ | {_gb(b)} | | |")
    lines += ["", "Weight-read bound: the bytes of the variant's own weights file read once at the copy bandwidth "
              "measured in the same process.", "",
              "| shape | variant | context | decode p50 ms | weight-read bound ms | × bound | load avg |",
              "|---|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        if "bandwidth" in r:
            lines += _decode_rows(r, r, [])
    again = [r for r in res["rows"] if "decode_remeasured" in r]
    if again:
        lines += ["", "Decode re-timed on the kept conversion (`--decode-only`), nothing else running but what the load "
                  "average shows; bound as above, bandwidth measured just before.", "",
                  "| shape | variant | context | decode p50 ms | weight-read bound ms | × bound | copy GB/s | load avg | date |",
                  "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in again:
            d = r["decode_remeasured"]
            lines += _decode_rows(r, d, [f"{d['bandwidth']['copy_gbps']:.1f}"], d["date_utc"])
    return "\n".join(lines) + "\n"


def _decode_rows(r: dict, d: dict, extra: list[str], after: str | None = None) -> list[str]:
    """Table rows of decode p50 against the weight-read bound: r the shape's row, d where the timings and the
    bandwidth are (the row itself, or its ``decode_remeasured``)."""
    files, out = r.get("files") or {}, []
    for v, rows in (d.get("profile") or {}).items():
        wfile = files.get("onnx/weights.data" if v == "converted" else "baseline/weights.data", r["fp32_weight_bytes"])
        bound = wfile / (d["bandwidth"]["copy_gbps"] * 1e9) * 1e3
        for c in rows:
            p50 = c["decode_ms_p50"]
            cells = [r["shape"]["name"], v, str(c["context"]), f"{p50:.2f}", f"{bound:.2f}", f"{p50 / bound:.2f}",
                     *extra, f"{d['loadavg_start'][0]:.1f} → {d['loadavg_end'][0]:.1f}", *([after] if after else [])]
            out.append("| " + " | ".join(cells) + " |")
    return out


def _earlier_rows(path: Path, names: list[str]) -> list[dict]:
    """The rows of an earlier ``realsize.json`` for shapes not run now (``--merge``: one shape per invocation)."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text()).get("rows") or []
    return [r for r in rows if r.get("shape", {}).get("name") not in names]


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_realsize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="/tmp/kvx-realsize/out", help="where realsize.json / realsize.md go")
    ap.add_argument("--cache", default="/tmp/kvx-realsize", help="checkpoints and conversion directories")
    ap.add_argument("--contexts", default="512,2048", help="profile contexts")
    ap.add_argument("--press", help="convert's --press (with --budget: eviction only, no MLA)")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--mla-rank", type=int)
    ap.add_argument("--fp16", action="store_true", default=None)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-fidelity", action="store_true", help="validate without the fidelity check against the "
                    "original (which holds the original in fp32 beside the sessions)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the conversion (OMP/MKL); default 1: "
                    "on a shared CPU, OpenMP's barriers stall whenever another job holds a core (a 2048² eigh "
                    "took 26 s on one thread, 118 s on two, at load 10); 0 = torch's default")
    ap.add_argument("--merge", action="store_true", help="keep the rows of other shapes already in --out's "
                    "realsize.json (run the shapes one at a time into one table)")
    ap.add_argument("--keep", action="store_true", help="keep each conversion directory under --cache/runs")
    ap.add_argument("--cprofile", action="append", default=[], choices=STAGES, help="cProfile this stage")
    ap.add_argument("--stage-log", help="append one JSON line per finished stage to this file (as it ends)")
    ap.add_argument("--decode-only", action="store_true", help="only re-time decode on the conversion an earlier "
                    "--keep run left under --cache/runs (kvexport profile; needs --merge's realsize.json in --out)")
    ap.add_argument("--render", metavar="REALSIZE_JSON", help="only re-render realsize.md from this realsize.json "
                    "into --out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    # absolute: each shape's child runs in the repository, not in the caller's directory
    a.out, a.cache = str(Path(a.out).resolve()), str(Path(a.cache).resolve())
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.child:
        a.baseline = False if a.no_baseline else None
        return _child(a)
    if a.render:
        (Path(a.out) / "realsize.md").write_text(markdown(json.loads(Path(a.render).read_text())))
        return 0
    t_run = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_run:6.0f}s] {msg}", flush=True)

    names = [n.strip() for n in a.shapes.split(",") if n.strip()]
    for n in names:
        if n not in SHAPES:
            raise SystemExit(f"unknown shape {n!r}; accepted: {', '.join(SHAPES)}")
    res = {"command": "python -m benchmarks.bench_realsize " + " ".join(sys.argv[1:] if argv is None else argv),
           "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "settings": {"contexts": a.contexts, "threads": a.threads, "press": a.press, "budget": a.budget,
                        "mla_rank": a.mla_rank, "fp16": bool(a.fp16), "baseline": not a.no_baseline,
                        "fidelity": not a.no_fidelity},
           "machine": {"cpus": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
                                                                   os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
           "rows": []}
    if a.decode_only:
        path = Path(a.out) / "realsize.json"
        if not path.is_file():
            raise SystemExit(f"--decode-only: {path} not found (the realsize.json of the run that kept the conversions)")
        res = json.loads(path.read_text())
        for n in names:
            row = next((r for r in res["rows"] if r["shape"]["name"] == n), None)
            if row is None:
                raise SystemExit(f"--decode-only: {path} has no row for {n}")
            row["decode_remeasured"] = decode_only(SHAPES[n], a, log)
            path.write_text(json.dumps(res, indent=1))
            (Path(a.out) / "realsize.md").write_text(markdown(res))
        print(markdown(res))
        return 0
    kept = _earlier_rows(Path(a.out) / "realsize.json", names) if a.merge else []
    done: list[dict] = []
    for n in names:
        row = run_shape(SHAPES[n], a, log)
        row.update(date_utc=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), settings=res["settings"])
        done.append(row)
        order = list(SHAPES)
        res["rows"] = sorted(kept + done, key=lambda r: order.index(r["shape"]["name"]))
        (Path(a.out) / "realsize.json").write_text(json.dumps(res, indent=1))
        (Path(a.out) / "realsize.md").write_text(markdown(res))
        log(f"{n}: done")
    print(markdown(res))
    return 0 if all(r["returncode"] == 0 for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
