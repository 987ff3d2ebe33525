# SPDX-License-Identifier: Apache-2.0
"""`kvexport export / generate DIR / validate` end to end, determinism, and the bad-input contract."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kvexport.cli import main
from kvexport.paths import MODELS_DIR
from kvexport.runtime import Stream

TOKENIZER = MODELS_DIR / "tokenizer"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved as a HF directory with the bundled tokenizer."""
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("bundled tokenizer missing")
    from kvexport.models.tiny import tiny_model

    d = tmp_path_factory.mktemp("m") / "tiny"
    tiny_model("llama", vocab_size=4096, max_positions=256).save_pretrained(d)
    for f in TOKENIZER.iterdir():
        shutil.copyfile(f, d / f.name)
    return d


ARGS = ["--press", "streaming_llm", "--budget", "16", "--window", "4", "--chunk", "8"]


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("e") / "x"
    assert main(["export", str(model_dir), "--out", str(out), *ARGS]) == 0
    return out


def test_cli_generate_and_validate(exported, capsys, model_dir):
    from kvexport.export import OrtGenerator
    from kvexport.export.source import press_from_dict
    from kvexport.generation import generate
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import load_tokenizer

    assert main(["generate", str(exported), "--prompt", "Once upon a time there was", "-n", "12"]) == 0
    printed = capsys.readouterr().out
    # the printed continuation is PyTorch's greedy continuation
    tok = load_tokenizer(model_dir)
    ids = np.array([tok("Once upon a time there was")["input_ids"]])
    gen = OrtGenerator(exported)
    dec, _ = load_decoder(model_dir)
    s = gen.settings  # the library path as a user calls it, with the export's settings
    ref = generate(dec, torch.from_numpy(ids), press=press_from_dict(s["press"]), window=s["window"],
                   chunk=s["chunk"], max_new_tokens=12, eos_token_id=tok.eos_token_id)
    assert repr(tok.decode(ref.tokens[0].tolist()))[:20] in printed.replace("\n", "")
    assert main(["validate", str(exported), "--steps", "16"]) == 0
    pair = json.loads((exported / "parity.json").read_text())["pairs"]["pytorch~onnxruntime"]
    assert pair["passed"] and pair["max_abs_logit_error"] <= 1e-4 and pair["token_agreement"] == 1.0
    assert main(["validate", str(exported), "--steps", "4", "--atol", "0", "--rtol", "0"]) == 6  # ParityFailure


def test_export_is_deterministic(exported, model_dir, tmp_path):
    again = tmp_path / "again"
    assert main(["export", str(model_dir), "--out", str(again), *ARGS]) == 0
    names = sorted(p.relative_to(again).as_posix() for p in again.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(exported).as_posix() for p in exported.rglob("*")
                           if p.is_file() and p.name != "parity.json")
    for n in names:
        assert (again / n).read_bytes() == (exported / n).read_bytes(), n


def test_graphs_pass_the_checker_and_carry_plugin_attributes(exported):
    """Every graph passes the full checker; compactions go through TopKGather with the plugin attributes; the
    prefill and decode graphs need no custom op (GQA) and return only new rows: a decode step's outputs do not
    depend on the cache's capacity."""
    import onnx

    from kvexport import ops

    ops.register_schemas()
    for g in ("prefill", "decode", "compact_prefill", "compact"):
        m = onnx.load(str(exported / f"{g}.onnx"))
        onnx.checker.check_model(m, full_check=True)
        nodes = [n for n in m.graph.node if n.domain == "kvexport"]
        compacts = g.startswith("compact")
        want = {("", 18), ("kvexport", 2)} if compacts else {("", 18)}
        assert {(o.domain, o.version) for o in m.opset_import} == want
        if not compacts:
            assert not nodes and not m.functions
            continue
        assert nodes and all(n.op_type == "TopKGather" for n in nodes)
        for n in nodes:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["plugin_namespace"] == b"kvexport" and attrs["plugin_version"] == b"1"
        assert {f.name for f in m.functions} == {"TopKGather"}
    decode = onnx.load(str(exported / "decode.onnx"), load_external_data=False)
    caps = {d.dim_value for i in decode.graph.input if i.name.startswith("k_") for d in i.type.tensor_type.shape.dim[2:3]}
    for o in decode.graph.output:
        dims = [d.dim_value for d in o.type.tensor_type.shape.dim]
        assert not caps & set(dims[2:3]) and (o.name == "logits" or dims[2] == 1), (o.name, dims)



def _code(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def test_bad_inputs(exported, model_dir, tmp_path, capsys):
    # non-empty --out without --force
    rc, err = _code(["export", str(model_dir), "--out", str(exported), *ARGS], capsys)
    assert rc == 2 and len(err) == 1 and "not empty" in err[0]
    # chunk / budget beyond the model's positions (max_position_embeddings = 256)
    out = tmp_path / "o"
    rc, err = _code(["export", str(model_dir), "--out", str(out), "--chunk", "512"], capsys)
    assert rc == 2 and "position range" in err[-1] and not out.exists()
    rc, err = _code(["export", str(model_dir), "--out", str(out), "--press", "knorm", "--budget", "999"], capsys)
    assert rc == 2 and "position range" in err[-1] and not out.exists()
    rc, err = _code(["export", str(model_dir), "--out", str(out), "--press", "random", "--budget", "8"], capsys)
    assert rc == 2 and "cannot be exported" in err[-1] and not out.exists()
    assert [p for p in tmp_path.iterdir()] == []  # no temporary directory left behind
    # empty prompt
    rc, err = _code(["generate", str(exported), "--prompt", "  "], capsys)
    assert rc == 2 and "empty" in err[-1]
    # altered, missing, foreign, other version
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    with open(bad / "decode.onnx", "ab") as f:
        f.write(b"\0")
    rc, err = _code(["generate", str(bad), "--prompt", "hi"], capsys)
    assert rc == 4 and "altered" in err[-1]
    shutil.rmtree(bad)
    shutil.copytree(exported, bad)
    (bad / "compact.onnx").unlink()
    rc, err = _code(["validate", str(bad)], capsys)
    assert rc == 4 and "missing compact.onnx" in err[-1]
    shutil.rmtree(bad)
    shutil.copytree(exported, bad)
    doc = json.loads((bad / "manifest.json").read_text())
    doc["kvexport_version"] = "9.9.9"
    (bad / "manifest.json").write_text(json.dumps(doc))
    rc, err = _code(["generate", str(bad), "--prompt", "hi"], capsys)
    assert rc == 4 and "9.9.9" in err[-1]


def test_runtime_buffers_are_allocated_once(exported):
    """IO binding reuses the same cache buffers for every call: no per-step allocation of the cache."""
    from kvexport.export import OrtGenerator

    gen = OrtGenerator(exported)
    buffers = {**gen.cache, **gen.step_out}
    ptrs = {n: b.ctypes.data for n, b in buffers.items()}
    ids = np.random.default_rng(0).integers(3, 4096, (1, 37))
    res = gen.generate(ids, None, 40, keep_logits=True)
    assert res.compactions > 3  # prefill and decode compactions happened
    assert {n: b.ctypes.data for n, b in {**gen.cache, **gen.step_out}.items()} == ptrs
    assert all(gen.cache[n] is b for n, b in buffers.items() if n in gen.cache) and not gen.staging
    again = gen.generate(ids, None, 40, keep_logits=True)  # buffers are reset between generations
    np.testing.assert_array_equal(again.tokens, res.tokens)


def test_press_export_refuses_a_prompt_past_max_positions(exported):
    """A press export still has a position range (here the model's 256): a longer prompt is BadUsage."""
    from kvexport.errors import BadUsage
    from kvexport.export import OrtGenerator

    gen = OrtGenerator(exported)
    assert gen.settings["max_positions"] == 256 and gen.press is not None
    ids = np.random.default_rng(0).integers(3, 4096, (1, 400))
    with pytest.raises(BadUsage, match="prompt of 400 tokens exceeds the export's maximum 256"):
        gen.generate(ids, None, 2)
    with pytest.raises(BadUsage, match="exceeds the export's maximum 256"):
        Stream(gen, ids).prefill()


def test_every_runtime_refuses_a_prompt_past_the_position_range(exported, model_dir):
    """The PyTorch library path holds a prompt to the model's position range as the export does (one rule, in the
    loop): 256 tokens run on both, 257 are refused by both, before any work."""
    from kvexport.errors import BadUsage
    from kvexport.export import OrtGenerator
    from kvexport.export.source import press_from_dict
    from kvexport.generation import generate
    from kvexport.mla.io import load_decoder

    gen = OrtGenerator(exported)
    s = gen.settings
    dec, _ = load_decoder(model_dir)
    press = press_from_dict(s["press"])
    rng = np.random.default_rng(1)
    ok, long = rng.integers(3, 4096, (1, 256)), rng.integers(3, 4096, (1, 257))
    lib = generate(dec, torch.from_numpy(ok), press=press, window=s["window"], chunk=s["chunk"], max_new_tokens=3)
    np.testing.assert_array_equal(gen.generate(ok, None, 3).tokens, lib.tokens.numpy())
    with pytest.raises(BadUsage, match="prompt of 257 tokens exceeds the model's 256 positions"):
        generate(dec, torch.from_numpy(long), press=press, window=s["window"], chunk=s["chunk"], max_new_tokens=3)
    with pytest.raises(BadUsage, match="prompt of 257 tokens exceeds the export's maximum 256"):
        gen.generate(long, None, 3)


def test_step_api_matches_generate(exported):
    """A stream stepped by hand (prefill, then decode) == generate (tokens, logits, compaction count and kept
    positions)."""
    from kvexport.export import OrtGenerator

    gen = OrtGenerator(exported)
    ids = np.random.default_rng(4).integers(3, 4096, (1, 21))
    res = gen.generate(ids, None, 15, keep_logits=True)
    seen = []
    stream = Stream(gen, ids, on_compaction=lambda where: seen.append((where, gen.kept_positions())))
    last = stream.prefill()
    np.testing.assert_array_equal(last, res.prompt_logits)
    toks, logits = [int(last.argmax(-1)[0])], []
    for _ in range(14):
        last = stream.decode(toks[-1])
        logits.append(last)
        toks.append(int(last.argmax(-1)[0]))
    np.testing.assert_array_equal(np.array([toks]), res.tokens)
    np.testing.assert_array_equal(np.stack(logits), np.stack(res.step_logits))
    assert stream.compactions == res.compactions == len(seen) > 0
    assert [w for w, _ in seen] == res.compaction_steps
    for (_, a), b in zip(seen, res.kept_positions, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert not gen.generate(ids, None, 15).step_logits  # nothing kept per step unless asked


def test_inplace_decode_flag(model_dir, tmp_path, capsys):
    """`kvexport export --inplace-decode` writes decode_inplace.ort.onnx and `kvexport generate` runs it to the
    tokens of the standard graph; with an MLA rewrite it is refused in one line, nothing written."""
    from kvexport.export import OrtGenerator

    out = tmp_path / "ip"
    assert main(["export", str(model_dir), "--out", str(out), *ARGS, "--inplace-decode"]) == 0
    assert (out / "decode_inplace.ort.onnx").is_file()
    ids = np.random.default_rng(0).integers(3, 4000, (1, 30))
    a = OrtGenerator(out).generate(ids, None, 12)
    b = OrtGenerator(out, inplace=False).generate(ids, None, 12)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    bad = tmp_path / "mla"
    rc, err = _code(["export", str(model_dir), "--out", str(bad), *ARGS, "--mla-rank", "16", "--inplace-decode"],
                    capsys)
    assert rc == 2 and len(err) == 1 and "grouped-query attention" in err[0] and not bad.exists()
