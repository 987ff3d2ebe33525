# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels on the CPU: a build of the unmodified ``plugins/**/*.cu`` and a runner for their C entry points.

:func:`build` rewrites each ``.cu`` mechanically (``__shared__`` declarations become per-block storage of the shim,
``kernel<<<grid, block, smem, stream>>>(args)`` becomes ``::kvxshim::launch(kernel, grid, block, smem,
stream)(args)``; nothing else changes and ``#line`` keeps the original file and line numbers), compiles it with g++
against ``tests/plugins/cpu_shim`` (which stands in for the CUDA runtime and intrinsics, see kvx_cpu_shim.h), links
the shim runtime and the case driver, and caches the executable in a folder keyed by the hash of every input and
flag. :class:`Jobs` writes the inputs of a list of cases, runs the driver once and reads the outputs back.

Variants: ``fast`` (-O2), ``asan`` (AddressSanitizer + UndefinedBehaviorSanitizer), ``tsan`` (ThreadSanitizer; one
OS thread per CUDA thread instead of fibers).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
SHIM = Path(__file__).resolve().parent / "cpu_shim"
KERNEL_SOURCES = sorted(PLUGINS.rglob("*.cu"))
VARIANTS = {
    "fast": ["-O2"],
    "asan": ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
    "tsan": ["-O1", "-fsanitize=thread", "-DKVX_SHIM_OS_THREADS=1"],
}
COMMON_FLAGS = ["-std=c++17", "-g", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Wno-unknown-pragmas",
                "-Wno-unused-parameter", "-pthread"]
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}


class CpuKernelError(RuntimeError):
    """The driver failed: a shim check, a sanitizer report or a crash (the message holds its stderr)."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


# ----------------------------------------------------------------------------------------------- the rewrite
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)"
    r"\s*\[\s*\]\s*;")
_STATIC_SHARED = re.compile(
    r"__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)"
    r"(?P<dims>(?:\s*\[[^\]\n]+\])*)\s*;")


def _launch_callee_start(src: str, end: int) -> int:
    """Start of the kernel expression (``name``, ``ns::name`` or ``name<T, N>``) ending at ``end``."""
    s = end
    if src[s - 1] == ">":
        depth = 0
        while True:
            s -= 1
            depth += {">": 1, "<": -1}.get(src[s], 0)
            if depth == 0:
                break
    while s > 0 and (src[s - 1].isalnum() or src[s - 1] in "_:"):
        s -= 1
    return s


def rewrite(src: str) -> tuple[str, int, int]:
    """The two mechanical rewrites of a ``.cu`` file -> (text, shared declarations rewritten, launches rewritten)."""
    text, n_extern = _EXTERN_SHARED.subn(lambda m: f"{m['type']}* {m['name']} = ::kvxshim::dynamicShared<{m['type']}>();",
                                         src)
    text, n_static = _STATIC_SHARED.subn(
        lambda m: f"auto& {m['name']} = ::kvxshim::staticShared<{m['type']}{''.join(m['dims'].split())}>(__COUNTER__);",
        text)
    out, pos, n_launch = [], 0, 0
    while (i := text.find("<<<", pos)) >= 0:
        j = text.index(">>>", i)
        k = j + 3
        while text[k].isspace():
            k += 1
        if text[k] != "(":
            raise ValueError(f"a launch without arguments at offset {i}")
        end = i
        while text[end - 1].isspace():
            end -= 1
        start = _launch_callee_start(text, end)
        out += [text[pos:start], f"::kvxshim::launch({text[start:end]}, {text[i + 3:j]})("]
        pos = k + 1
        n_launch += 1
    out.append(text[pos:])
    return "".join(out), n_extern + n_static, n_launch


# ----------------------------------------------------------------------------------------------- the build
def _build_root() -> Path:
    env = os.environ.get("KVX_CPU_BUILD_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "kvexport-cpu-kernels"


def _headers() -> list[Path]:
    return sorted({*PLUGINS.rglob("*.h"), *PLUGINS.rglob("*.cuh"), *(p for p in SHIM.iterdir() if p.suffix == ".h")})


def _units(plant: tuple[str, str, str] | None, driver: bool = True) -> list[tuple[str, str, list[Path]]]:
    """(name, C++ text, extra quote-include dirs) of every translation unit: shim runtime, driver, rewritten kernels."""
    units = [(p.name, p.read_text(), []) for p in (SHIM / "kvx_cpu_shim.cpp", *([SHIM / "driver.cpp"] if driver else []))]
    for src in KERNEL_SOURCES:
        text = src.read_text()
        if plant is not None and src == ROOT / plant[0]:
            if text.count(plant[1]) != 1:
                raise ValueError(f"planted change must match once in {plant[0]}: {plant[1]!r}")
            text = text.replace(plant[1], plant[2])
        body, _, _ = rewrite(text)
        units.append((src.stem + ".cpu.cpp", f'#include "kvx_cpu_shim.h"\n#line 1 "{src}"\n{body}', [src.parent]))
    return units


def build(variant: str = "fast", plant: tuple[str, str, str] | None = None, jobs: int = 2,
          shared: bool = False) -> Path:
    """Build (or reuse) the driver executable of ``variant``; objects and executables are cached by content hash.

    plant: ``(path relative to the repository, old, new)``: replaces the one occurrence of ``old`` in that kernel
    source before the rewrite (a deliberately broken copy for the tests that show a bug is caught).
    shared: build ``libkvexport_kernels_cpu.so`` instead (shim + kernels, the kvx_* C interface, no driver), which
    tests/plugins/kernels_lib.py loads like the CUDA library.
    """
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX)")
    flags = [*COMMON_FLAGS, *VARIANTS[variant], *(["-fPIC"] if shared else [])]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    base = hashlib.sha256("\0".join([cxx, version, *flags]).encode())
    for p in _headers():
        base.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    root = _build_root()
    (root / "objs").mkdir(parents=True, exist_ok=True)
    units = _units(plant, driver=not shared)
    keys = []
    for name, text, _ in units:
        h = base.copy()
        h.update(name.encode() + b"\0" + text.encode())
        keys.append(h.hexdigest()[:20])
    exe_key = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
    out = root / f"{variant}{'-lib' if shared else ''}-{exe_key}"
    exe = out / ("libkvexport_kernels_cpu.so" if shared else "kvx_cpu_driver")
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        tmp = Path(tempfile.mkdtemp(prefix="kvx_cpu_build.", dir=root))

        def compile_one(i: int) -> Path:
            name, text, dirs = units[i]
            obj = root / "objs" / f"{keys[i]}.o"
            if obj.exists():
                return obj
            unit = tmp / name
            unit.write_text(text)
            cmd = [cxx, *flags, "-I", str(SHIM), "-iquote", str(SHIM)]
            for d in dirs:
                cmd += ["-iquote", str(d)]
            r = subprocess.run([*cmd, "-c", str(unit), "-o", str(tmp / f"{keys[i]}.o")], capture_output=True,
                               text=True)
            if r.returncode != 0:
                raise CpuKernelError(f"g++ failed on {name}:\n{r.stderr[-6000:]}")
            (tmp / f"{keys[i]}.o").rename(obj)
            return obj

        try:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                objs = list(pool.map(compile_one, range(len(units))))
            link = [cxx, *flags, *(["-shared"] if shared else []), *map(str, objs), "-o", str(tmp / exe.name)]
            r = subprocess.run(link, capture_output=True, text=True)
            if r.returncode != 0:
                raise CpuKernelError(f"link failed:\n{r.stderr[-6000:]}")
            out.mkdir(exist_ok=True)
            (tmp / exe.name).rename(exe)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return exe


# ----------------------------------------------------------------------------------------------- running cases
def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous().cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _tensor(path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    data = bytearray(path.read_bytes())
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    raw_dtype = torch.int16 if dtype in (torch.float16, torch.bfloat16) else dtype
    t = torch.frombuffer(data, dtype=raw_dtype).reshape(shape).clone()
    return t.view(dtype) if raw_dtype is not dtype else t


@dataclass
class _Job:
    kind: str
    args: dict
    outputs: dict = field(default_factory=dict)
    status: int | None = None
    plan: dict = field(default_factory=dict)


class Jobs:
    """Cases for one driver run: add them, ``run(exe)``, then read each job's ``outputs`` / ``status``."""

    def __init__(self):
        self.lines: list[str | _Job] = []

    def device(self, sms: int | None = None, optin: int | None = None, cc: str | None = None) -> None:
        opts = [f"sms={sms}" if sms else "", f"optin={optin}" if optin else "", f"cc={cc}" if cc else ""]
        self.lines.append("device " + " ".join(o for o in opts if o))

    def topk_gather(self, scores, keys, values, positions, k: int) -> _Job:
        job = _Job("topk", dict(scores=scores, keys=keys, values=values, positions=positions, k=k))
        self.lines.append(job)
        return job

    def latent_attention(self, q, latent, q_positions, latent_positions, rank: int, scale: float) -> _Job:
        job = _Job("latent", dict(q=q, latent=latent, q_positions=q_positions, latent_positions=latent_positions,
                                  rank=rank, scale=scale))
        self.lines.append(job)
        return job

    def latent_attention_v2(self, q, latent, q_positions, latent_positions, rank: int, scale: float,
                            new_latent=None, latent_scale=None, latent_format: int = 0) -> _Job:
        """Op version 2 (``kvx_latent_attention_v2``): uint8 ``latent`` codes with ``latent_scale`` (B, S) float16 when
        ``latent_format`` is 1 (int8) or 2 (fp8); ``new_latent`` (B, T, D) in q's dtype attended after the cache."""
        job = _Job("latent2", dict(q=q, latent=latent, q_positions=q_positions, latent_positions=latent_positions,
                                   rank=rank, scale=scale, new_latent=new_latent, latent_scale=latent_scale,
                                   latent_format=latent_format))
        self.lines.append(job)
        return job

    def latent_plan(self, dtype: torch.dtype, B: int, H: int, T: int, S: int, D: int, R: int) -> _Job:
        """The launch plan of a LatentAttention call (no kernel runs): ``job.plan`` after ``run``."""
        job = _Job("plan", dict(dtype=dtype, shape=(B, H, T, S, D, R)))
        self.lines.append(job)
        return job

    def _write(self, job: _Job, d: Path) -> str:
        a = job.args
        if job.kind == "plan":
            return f"plan {d} {DTYPE_CODES[a['dtype']]} {' '.join(map(str, a['shape']))}"
        if job.kind == "topk":
            B, H, S = a["scores"].shape
            Dk, Dv = a["keys"].shape[-1], a["values"].shape[-1]
            for name in ("scores", "keys", "values", "positions"):
                (d / f"{name}.bin").write_bytes(_raw(a[name]))
            return f"topk {d} {DTYPE_CODES[a['keys'].dtype]} {B} {H} {S} {Dk} {Dv} {a['k']}"
        B, H, T, D = a["q"].shape
        S = a["latent"].shape[1]
        for name in ("q", "latent", "q_positions", "latent_positions"):
            (d / f"{name}.bin").write_bytes(_raw(a[name]))
        if job.kind == "latent2":
            for name in ("new_latent", "latent_scale"):
                if a[name] is not None:
                    (d / f"{name}.bin").write_bytes(_raw(a[name]))
            return (f"latent2 {d} {DTYPE_CODES[a['q'].dtype]} {int(a['latent_format'])} {int(a['new_latent'] is not None)}"
                    f" {B} {H} {T} {S} {D} {a['rank']} {float(a['scale']):.9g}")
        return f"latent {d} {DTYPE_CODES[a['q'].dtype]} {B} {H} {T} {S} {D} {a['rank']} {float(a['scale']):.9g}"

    def _read(self, job: _Job, d: Path) -> None:
        job.status = int((d / "status").read_text())
        a = job.args
        if job.kind == "topk":
            B, H, _ = a["scores"].shape
            k, dt = a["k"], a["keys"].dtype
            job.outputs = dict(
                kept_keys=_tensor(d / "kept_keys.bin", dt, (B, H, k, a["keys"].shape[-1])),
                kept_values=_tensor(d / "kept_values.bin", dt, (B, H, k, a["values"].shape[-1])),
                kept_positions=_tensor(d / "kept_positions.bin", torch.int64, (B, H, k)),
                kept_indices=_tensor(d / "kept_indices.bin", torch.int64, (B, H, k)))
        else:
            if job.kind in ("latent", "latent2"):
                B, H, T, _ = a["q"].shape
                job.outputs = dict(out=_tensor(d / "out.bin", a["q"].dtype, (B, H, T, a["rank"])))
            if (d / "plan").exists():
                f = (d / "plan").read_text().split()
                job.plan = dict(path=("simt", "mma")[int(f[0])], rows_per_block=int(f[1]), tile_slots=int(f[2]),
                                threads=int(f[3]), splits=int(f[4]), smem=int(f[5]), latent_bytes=float(f[6]),
                                partial_bytes=float(f[7]))

    def run(self, exe: Path, timeout: float = 600) -> str:
        """Runs every case in one driver process; raises CpuKernelError when the driver fails. Returns stdout."""
        with tempfile.TemporaryDirectory(prefix="kvx_cpu_jobs.") as tmp:
            lines = []
            for i, item in enumerate(self.lines):
                if isinstance(item, str):
                    lines.append(item)
                    continue
                d = Path(tmp) / f"case{i}"
                d.mkdir()
                lines.append(self._write(item, d))
            jobfile = Path(tmp) / "jobs.txt"
            jobfile.write_text("\n".join(lines) + "\n")
            env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=23",
                   "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=24",
                   "TSAN_OPTIONS": "halt_on_error=1:exitcode=25:report_signal_unsafe=0"}
            r = subprocess.run([str(exe), str(jobfile)], capture_output=True, text=True, timeout=timeout, env=env)
            if r.returncode != 0:
                raise CpuKernelError(f"{exe.parent.name} exited {r.returncode}:\n{r.stderr[-8000:]}")
            for i, item in enumerate(self.lines):
                if not isinstance(item, str):
                    self._read(item, Path(tmp) / f"case{i}")
            return r.stdout
