# SPDX-License-Identifier: Apache-2.0
"""Jetson ``tegrastats``: parse its one-line reports and sample it while a profile runs.

One report is a single line of space-separated fields (NVIDIA's Jetson Linux developer guide,
"tegrastats Utility"). The fields kvexport reads, in any order, all optional:

    [MM-DD-YYYY HH:MM:SS]              timestamp (newer releases, always printed on JetPack 6/7)
    RAM used/totalMB (lfb NxZMB)       memory in use / total
    SWAP used/totalMB (cached ZMB)
    CPU [L%@F,L%@F,off,...]            per-core load at frequency F MHz
    EMC_FREQ L%@F                      memory controller load (and frequency)
    GR3D_FREQ L%@F | L%@[F,F] | L%     the integrated GPU: load, frequency per GPC
    name@T.TC                          temperatures
    VDD_*/VIN_*/POM_* cur mW/avg mW     power rails (older releases print "cur/avg" without mW)

Orin (JetPack 5/6) rails are e.g. ``VDD_GPU_SOC``, ``VDD_CPU_CV``, ``VIN_SYS_5V0`` (AGX) or
``VDD_IN``, ``VDD_CPU_GPU_CV``, ``VDD_SOC`` (Orin NX/Nano); Thor (JetPack 7) prints ``VDD_GPU``,
``VDD_CPU_SOC_MSS``, ``VIN_SYS_5V0``, ``VIN``. The parser does not list rail names: any token
that looks like a rail is read, so new boards need no change.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TS = re.compile(r"^(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})\s+")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_EMC = re.compile(r"\bEMC_FREQ (\d+)%(?:@(\d+))?")
_GR3D = re.compile(r"\bGR3D_FREQ (\d+)%(?:@\[?([\d,]+)\]?)?")
_RAIL = re.compile(r"\b((?:VDD|VIN|POM)_[A-Z0-9_]+|VIN) (\d+)(?:mW)?/(\d+)(?:mW)?\b")
_TEMP = re.compile(r"\b([A-Za-z][A-Za-z0-9_]*)@(-?\d+(?:\.\d+)?)C\b")


@dataclass
class TegraSample:
    """One parsed tegrastats line. Missing fields stay None / empty."""

    timestamp: str | None = None
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    swap_used_mb: int | None = None
    cpu_load_pct: list[int | None] = field(default_factory=list)  # None = core off
    cpu_freq_mhz: list[int | None] = field(default_factory=list)
    emc_load_pct: int | None = None
    emc_freq_mhz: int | None = None
    gpu_load_pct: int | None = None
    gpu_freq_mhz: list[int] = field(default_factory=list)  # one per GPC
    rails_mw: dict[str, int] = field(default_factory=dict)  # instantaneous
    rails_avg_mw: dict[str, int] = field(default_factory=dict)
    temps_c: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def parse_line(line: str) -> TegraSample | None:
    """One tegrastats line -> :class:`TegraSample`; None for a line that is not a report."""
    line = line.strip()
    if not line:
        return None
    s = TegraSample()
    m = _TS.match(line)
    if m:
        s.timestamp = m.group(1)
    if m := _RAM.search(line):
        s.ram_used_mb, s.ram_total_mb = int(m.group(1)), int(m.group(2))
    if m := _SWAP.search(line):
        s.swap_used_mb = int(m.group(1))
    if m := _CPU.search(line):
        for core in m.group(1).split(","):
            core = core.strip()
            cm = re.match(r"(\d+)%(?:@(\d+))?", core)
            if cm:
                s.cpu_load_pct.append(int(cm.group(1)))
                s.cpu_freq_mhz.append(int(cm.group(2)) if cm.group(2) else None)
            elif core:
                s.cpu_load_pct.append(None)
                s.cpu_freq_mhz.append(None)
    if m := _EMC.search(line):
        s.emc_load_pct = int(m.group(1))
        s.emc_freq_mhz = int(m.group(2)) if m.group(2) else None
    if m := _GR3D.search(line):
        s.gpu_load_pct = int(m.group(1))
        if m.group(2):
            s.gpu_freq_mhz = [int(x) for x in m.group(2).split(",") if x]
    for name, cur, avg in _RAIL.findall(line):
        s.rails_mw[name] = int(cur)
        s.rails_avg_mw[name] = int(avg)
    for name, t in _TEMP.findall(line):
        s.temps_c[name] = float(t)
    if s.ram_used_mb is None and s.gpu_load_pct is None and not s.rails_mw:
        return None
    return s


def summarize(samples: list[TegraSample]) -> dict[str, Any]:
    """Samples -> peak/mean RAM, mean/max GPU load, GPU frequency, mean/peak power per rail (mW)."""
    samples = [s for s in samples if s is not None]
    out: dict[str, Any] = {"samples": len(samples)}
    if not samples:
        return out
    ram = [s.ram_used_mb for s in samples if s.ram_used_mb is not None]
    if ram:
        out["ram_used_mb_peak"] = max(ram)
        out["ram_used_mb_mean"] = sum(ram) / len(ram)
        out["ram_total_mb"] = next(s.ram_total_mb for s in samples if s.ram_total_mb is not None)
    gpu = [s.gpu_load_pct for s in samples if s.gpu_load_pct is not None]
    if gpu:
        out["gpu_load_pct_mean"] = sum(gpu) / len(gpu)
        out["gpu_load_pct_max"] = max(gpu)
    freqs = [max(s.gpu_freq_mhz) for s in samples if s.gpu_freq_mhz]
    if freqs:
        out["gpu_freq_mhz_max"] = max(freqs)
        out["gpu_freq_mhz_mean"] = sum(freqs) / len(freqs)
    rails: dict[str, list[int]] = {}
    for s in samples:
        for k, v in s.rails_mw.items():
            rails.setdefault(k, []).append(v)
    if rails:
        out["power_mw"] = {k: {"mean": sum(v) / len(v), "peak": max(v)} for k, v in sorted(rails.items())}
    return out


def is_jetson() -> bool:
    """True on a Jetson: /etc/nv_tegra_release exists or ``tegrastats`` is on PATH."""
    return Path("/etc/nv_tegra_release").exists() or shutil.which("tegrastats") is not None


class TegraStatsSampler:
    """Runs ``tegrastats --interval MS`` in the background; use as a context manager.

    ``with TegraStatsSampler() as ts: ...`` then ``ts.samples`` / ``ts.summary()``. Does nothing
    (no samples) where tegrastats is not on PATH.
    """

    def __init__(self, interval_ms: int = 100, executable: str | None = None):
        self.interval_ms = int(interval_ms)
        self.executable = executable or shutil.which("tegrastats")
        self.samples: list[TegraSample] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "TegraStatsSampler":
        if self.executable:
            self._proc = subprocess.Popen([self.executable, "--interval", str(self.interval_ms)],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_line(line)
            if s is not None:
                self.samples.append(s)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        return summarize(self.samples)


__all__ = ["TegraSample", "parse_line", "summarize", "is_jetson", "TegraStatsSampler"]
