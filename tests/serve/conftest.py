# SPDX-License-Identifier: Apache-2.0
"""One export of the bundled student for the serve tests, shared by the xdist workers of a run (a file lock: the
first worker exports, the others wait for it), and a copy of it whose tokenizer has a chat template.

The export is small enough for compactions to happen in short runs: SnapKV budget 32 + window 8, prefill chunks
of 16, ``decode_batch`` 4 (four slots decoded in one graph call), positions limited to 512, and the in-place decode
graph (which the slots leave alone); and, for the tests that need it, the same rewritten to MLA
(``mla_export_dir``, the kind of export ``kvexport convert`` makes).

The reference every served sequence is held to is independent of the slots: ``kvexport generate``'s PyTorch path
(:func:`kvexport.generation.generate`) with the export's source model, press, budget, window, chunk and cache
format, one sequence at a time (:class:`LibraryRun`). It shares no code with the slots but the cache rules.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from kvexport.paths import MODELS_DIR
from tests.conftest import shared_root

STUDENT = MODELS_DIR / "kvx-student"
BUDGET, WINDOW, CHUNK, SLOTS, MAX_POSITIONS = 32, 8, 16, 4, 512
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _make_exports(root: Path) -> dict[str, Path]:
    from kvexport.export import export_model
    from kvexport.manifest import ONNX_EXPORT, read_manifest, write_manifest
    from kvexport.presses import make_press

    plain, chat = root / "kvx-student", root / "kvx-student-chat"
    if not (chat / "manifest.json").is_file():
        shutil.rmtree(plain, ignore_errors=True)
        shutil.rmtree(chat, ignore_errors=True)
        export_model(str(STUDENT), plain, press=make_press("snapkv", budget=BUDGET, window_size=WINDOW),
                     window=WINDOW, chunk=CHUNK, batch=1, decode_batch=SLOTS, max_positions=MAX_POSITIONS,
                     inplace_decode=True)  # the slots run decode(_batch).onnx, never the in-place one
        # the same export with a tokenizer that has a chat template (the bundled one has none)
        shutil.copytree(plain, chat)
        cfg = chat / "tokenizer" / "tokenizer_config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": CHAT_TEMPLATE}, indent=2))
        doc = read_manifest(plain)
        write_manifest(chat, ONNX_EXPORT, doc["settings"], doc["model_hash"], tuple(doc["reports"]))
    return {"plain": plain, "chat": chat}


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = shared_root(tmp_path_factory) / "serve-exports"
    root.mkdir(exist_ok=True)
    with FileLock(str(root) + ".lock"):
        return _make_exports(root)


@pytest.fixture(scope="session")
def mla_export_dir(tmp_path_factory) -> Path:
    """The student rewritten to MLA (what `kvexport convert` serves: its ``v_i`` caches are empty, value_dim 0),
    SnapKV as above, ``decode_batch`` 2."""
    from kvexport.export import export_model
    from kvexport.presses import make_press

    root = shared_root(tmp_path_factory) / "serve-exports"
    root.mkdir(exist_ok=True)
    out = root / "kvx-student-mla"
    with FileLock(str(out) + ".lock"):
        if not (out / "manifest.json").is_file():
            export_model(str(STUDENT), out, press=make_press("snapkv", budget=BUDGET, window_size=WINDOW),
                         window=WINDOW, chunk=CHUNK, batch=1, decode_batch=2, max_positions=MAX_POSITIONS,
                         mla_rank=16, rope_dim=8, force=True)
    return out


@pytest.fixture(scope="session")
def export_dir(exports) -> Path:
    return exports["plain"]


@pytest.fixture(scope="session")
def chat_dir(exports) -> Path:
    return exports["chat"]


class LibraryRun:
    """The PyTorch library path (:func:`kvexport.generation.generate`) with an export's source model and settings
    (:func:`kvexport.export.reference.reference_kwargs`), one sequence at a time; results as NumPy arrays."""

    def __init__(self, export_dir: Path):
        from kvexport.export.reference import load_reference_model
        from kvexport.manifest import ONNX_EXPORT, verify_manifest

        manifest = verify_manifest(export_dir, ONNX_EXPORT)
        self.settings = manifest["settings"]
        self.decoder = load_reference_model(manifest, root=export_dir)

    def generate(self, ids, max_new_tokens: int, eos_token_id=None, forced_tokens=None, track_kept=False,
                 keep_logits=False):
        import numpy as np
        import torch

        from kvexport.export.reference import reference_kwargs
        from kvexport.export.source import press_from_dict
        from kvexport.generation import generate

        kw = reference_kwargs(self.settings, press_from_dict(self.settings["press"]))
        res = generate(self.decoder, torch.as_tensor(np.asarray(ids)), max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, forced_tokens=forced_tokens, track_kept=track_kept,
                       keep_logits=keep_logits, **kw)
        res.tokens = res.tokens.numpy()
        res.prompt_logits = res.prompt_logits.numpy()
        res.step_logits = [x.numpy() for x in res.step_logits]
        res.kept_positions = [[p.numpy() for p in layers] for layers in res.kept_positions]
        return res


@pytest.fixture(scope="session")
def solo(export_dir):
    """The independent reference: ``kvexport generate``'s PyTorch path with the export's model and settings."""
    return LibraryRun(export_dir)


@pytest.fixture(scope="session")
def tokenizer(export_dir):
    from kvexport.models.loading import load_tokenizer

    return load_tokenizer(export_dir / "tokenizer")


def encode(tokenizer, text: str) -> list[int]:
    """How ``kvexport generate`` encodes a prompt (kvexport.cli.common.encode_prompts)."""
    from kvexport.cli.common import encode_prompts

    ids, _ = encode_prompts(tokenizer, [text])
    return ids[0].tolist()


def reference(solo, prompt: list[int], max_tokens: int, eos: int | None = None):
    """Greedy tokens of a solo run of the library path, up to and with the first EOS (as a server returns them)."""
    import numpy as np

    res = solo.generate(np.array([prompt]), max_new_tokens=max_tokens, eos_token_id=eos, track_kept=True)
    toks = res.tokens[0].tolist()
    if eos is not None and eos in toks:
        toks = toks[:toks.index(eos) + 1]
    return toks, res
