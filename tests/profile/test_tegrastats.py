# SPDX-License-Identifier: Apache-2.0
"""tegrastats parsing on Orin, Thor and older Nano lines, and sampling through a stand-in binary."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from kvexport.profile.tegrastats import TegraStatsSampler, is_jetson, parse_line, summarize

FIX = Path(__file__).parent / "fixtures"


def lines(name: str) -> list[str]:
    return [ln for ln in (FIX / name).read_text().splitlines() if ln.strip()]


def test_orin_agx_fields():
    s = parse_line(lines("tegrastats_orin_agx.txt")[0])
    assert s.timestamp == "11-29-2026 17:40:01"
    assert (s.ram_used_mb, s.ram_total_mb, s.swap_used_mb) == (5432, 62841, 0)
    assert len(s.cpu_load_pct) == 12 and s.cpu_load_pct[:2] == [12, 8] and s.cpu_load_pct[-1] is None
    assert s.cpu_freq_mhz[0] == 2201 and s.cpu_freq_mhz[4] == 729
    assert (s.emc_load_pct, s.emc_freq_mhz) == (7, 3199)
    assert s.gpu_load_pct == 87 and s.gpu_freq_mhz == [1300, 1300]
    assert s.rails_mw == {"VDD_GPU_SOC": 9234, "VDD_CPU_CV": 2011, "VIN_SYS_5V0": 5120}
    assert s.rails_avg_mw["VDD_GPU_SOC"] == 8120
    assert s.temps_c["gpu"] == pytest.approx(55.812) and s.temps_c["tj"] == pytest.approx(55.812)
    assert "APE" not in s.temps_c


def test_orin_nano_without_frequencies():
    s = parse_line(lines("tegrastats_orin_nano.txt")[1])
    assert s.timestamp is None
    assert (s.ram_used_mb, s.ram_total_mb, s.swap_used_mb) == (3044, 7620, 12)
    assert s.gpu_load_pct == 64 and s.gpu_freq_mhz == []
    assert s.emc_load_pct == 0 and s.emc_freq_mhz is None
    assert s.cpu_load_pct == [38, 22, 11, 9, None, None]
    assert s.rails_mw == {"VDD_IN": 7210, "VDD_CPU_GPU_CV": 2502, "VDD_SOC": 1702}


def test_thor_fields():
    s = parse_line(lines("tegrastats_thor.txt")[1])
    assert (s.ram_used_mb, s.ram_total_mb) == (21988, 125772)
    assert len(s.cpu_load_pct) == 14
    assert s.gpu_load_pct == 95 and s.gpu_freq_mhz == [1575, 1575, 1575]
    assert s.emc_load_pct is None
    assert s.rails_mw == {"VDD_GPU": 30210, "VDD_CPU_SOC_MSS": 11520, "VIN_SYS_5V0": 6180, "VIN": 54800}
    assert s.temps_c["soc345"] == pytest.approx(51.2)


def test_old_rails_without_mw():
    s = parse_line(lines("tegrastats_nano_jp4.txt")[0])
    assert s.ram_used_mb == 1843  # not confused by IRAM
    assert s.gpu_load_pct == 45 and s.gpu_freq_mhz == [921]
    assert s.rails_mw == {"POM_5V_IN": 3462, "POM_5V_GPU": 912, "POM_5V_CPU": 503}
    assert s.rails_avg_mw["POM_5V_IN"] == 3325


@pytest.mark.parametrize("text", ["", "   ", "tegrastats: permission denied", "usage: tegrastats [-h]"])
def test_not_a_report(text):
    assert parse_line(text) is None


def test_summary_orin():
    ss = [parse_line(x) for x in lines("tegrastats_orin_agx.txt")]
    out = summarize(ss)
    assert out["samples"] == 3
    assert out["ram_used_mb_peak"] == 5518 and out["ram_total_mb"] == 62841
    assert out["ram_used_mb_mean"] == pytest.approx((5432 + 5518 + 5490) / 3)
    assert out["gpu_load_pct_mean"] == pytest.approx((87 + 99 + 75) / 3) and out["gpu_load_pct_max"] == 99
    assert out["gpu_freq_mhz_max"] == 1300
    assert out["power_mw"]["VDD_GPU_SOC"] == {"mean": pytest.approx((9234 + 11020 + 8410) / 3), "peak": 11020}
    assert summarize([]) == {"samples": 0}


@pytest.fixture
def fake_tegrastats(tmp_path, monkeypatch):
    """A ``tegrastats`` on PATH that prints the Thor fixture lines every --interval ms until killed."""
    fix = FIX / "tegrastats_thor.txt"
    script = tmp_path / "bin" / "tegrastats"
    script.parent.mkdir()
    script.write_text(f"""#!/bin/sh
[ "$1" = "--interval" ] || exit 2
while true; do
  while IFS= read -r line; do echo "$line"; sleep 0.02; done < "{fix}"
done
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return script


def test_sampler_reads_the_binary(fake_tegrastats):
    assert is_jetson()
    with TegraStatsSampler(interval_ms=20) as ts:
        deadline = time.monotonic() + 10
        while len(ts.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(ts.samples) >= 3
    summ = ts.summary()
    assert summ["ram_total_mb"] == 125772
    assert set(summ["power_mw"]) == {"VDD_GPU", "VDD_CPU_SOC_MSS", "VIN_SYS_5V0", "VIN"}
    assert summ["gpu_freq_mhz_max"] == 1575


def test_sampler_without_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with TegraStatsSampler() as ts:
        pass
    assert ts.samples == [] and ts.summary() == {"samples": 0}
