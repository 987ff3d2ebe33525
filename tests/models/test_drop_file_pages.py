# SPDX-License-Identifier: Apache-2.0
"""drop_file_pages: the resident pages of dropped checkpoint tensors leave the RSS, nothing else changes (issue 20).

The in-place MLA rewrite calls it on each layer's GQA projections before dropping them: the checkpoint is one
memory mapping, so without it the pages those projections were read from stay resident for as long as the
embeddings and MLPs (the same file) live.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.models.decoder import Decoder
from kvexport.models.loading import load_hf_model
from kvexport.models.release import drop_file_pages
from kvexport.models.tiny import tiny_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_file_pages_of_a_dropped_tensor_leave_the_rss(tmp_path):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 1024, 1024, generator=g), torch.randn(2, 1024, 1024, generator=g)  # 32 MiB, 8 MiB
    want_a, want_b = a.sum().item(), b.clone()
    save_file({"a": a, "b": b}, str(tmp_path / "w.safetensors"))
    del a, b
    t = load_file(str(tmp_path / "w.safetensors"))  # memory-mapped in place
    assert t["a"].sum().item() == pytest.approx(want_a)  # every page of both read, so resident
    assert torch.equal(t["b"], want_b)
    before = _rss_file()
    done = drop_file_pages([t["a"]])
    after = _rss_file()
    assert done >= t["a"].nbytes - 2 * 4096  # whole pages inside the tensor's own bytes
    assert before - after >= 0.9 * t["a"].nbytes, (before, after)
    assert torch.equal(t["b"], want_b)  # the neighbour is untouched
    assert t["a"].sum().item() == pytest.approx(want_a)  # read again: faulted back in from the file


def test_anonymous_tensors_are_left_alone():
    x = torch.randn(1024, 1024)
    want = x.clone()
    assert drop_file_pages([x]) == 0
    assert torch.equal(x, want)


def test_inplace_rewrite_of_a_mapped_checkpoint(tmp_path, monkeypatch):
    """Loaded from disk (memory-mapped), rewritten in place: the GQA projections' pages are dropped (bytes advised
    > 0), and the logits are the copying rewrite's bit for bit (no page of a tensor still in use was dropped)."""
    import kvexport.mla.rewrite as rw

    advised = []
    monkeypatch.setattr(rw, "drop_file_pages", lambda ts: advised.append(drop_file_pages(ts)) or advised[-1])
    hf = tiny_model("llama", layers=3, heads=4, kv_heads=2, hidden_size=256, intermediate_size=512, seed=4)
    hf.save_pretrained(tmp_path)
    del hf
    settings = MLASettings(kv_rank=16, rope_dim=8)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20)[None]
    want = rewrite_to_mla(Decoder.from_hf(load_hf_model(tmp_path, "fp32")), settings)
    dec = Decoder.from_hf(load_hf_model(tmp_path, "fp32"))
    got = rewrite_to_mla(dec, settings, inplace=True)
    assert len(advised) == 3 and min(advised) > 0, advised
    with torch.no_grad():
        assert torch.equal(got(ids, pos), want(ids, pos))
