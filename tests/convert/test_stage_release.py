# SPDX-License-Identifier: Apache-2.0
"""After the export stage nothing of the models it exported is left for validate to hold beside its own (issue 20).

The baseline export loads the original as an HF model, whose modules form reference cycles: without a collection
at the end of the stage it stayed alive (with its memory-mapped checkpoint pages, 1 x the weights on the 385M
shape) until Python's cyclic collector happened to run, well into validate.
"""

from __future__ import annotations

import gc

import torch

from kvexport.convert import stages as st_mod
from kvexport.convert.config import ConvertConfig
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model


class _Stop(Exception):
    pass


def test_no_model_survives_the_export_stage(tmp_path, monkeypatch):
    src = tmp_path / "hf"
    tiny_model("qwen3", head_dim=32, vocab_size=512, max_positions=512, tie_word_embeddings=True).save_pretrained(src)
    seen = {}

    def models():
        return [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)
                and (issubclass(type(o), Decoder) or type(o).__name__.endswith("ForCausalLM"))]

    gc.collect()  # what earlier tests in this process left is not the stage's
    before = {id(o) for o in models()}

    def at_validate(st):
        # no gc.collect() here: what is alive now is what validate would start with
        seen["models"] = [type(o).__name__ for o in models() if id(o) not in before]
        raise _Stop

    monkeypatch.setattr(st_mod, "stage_validate", at_validate)
    cfg = ConvertConfig.from_mapping(dict(model=str(src), contexts="64", seed=0, baseline=True, mla_rank=16,
                                          rope_dim=8))
    gc.disable()  # only the stages' own collections run: on a large model the automatic ones come too late
    try:
        st_mod.run_convert(cfg, tmp_path / "out", force=True)
    except Exception:  # the pipeline wraps _Stop as a failed stage
        pass
    finally:
        gc.enable()
    assert seen == {"models": []}
