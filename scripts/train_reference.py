# SPDX-License-Identifier: Apache-2.0
"""Train kvexport's reference models (student, teacher-2x, teacher-4x) on the Python standard library.

Data: every ``*.py`` file under the interpreter's stdlib directory (``sysconfig.get_paths()["stdlib"]``),
skipping ``site-packages``, test folders (``test``, ``tests``, ``idle_test``) and ``pydoc_data`` (prose),
in sorted order. A file is held out when the first byte of ``sha256(relative_path)`` is < 13 (≈5 %).
Tokenizer: byte-level BPE (``tokenizers``), vocab 4096, trained on the train split only.
Models: ``LlamaForCausalLM`` with GQA and RoPE (theta 1e5, 32768 positions), tied embeddings.
Training: AdamW, linear warm-up + cosine decay, random windows of 256 tokens from the concatenated
train stream (each file wrapped in <|bos|> ... <|eos|>), fixed seeds, ``torch.set_num_threads(--threads)``.
The three sizes are independent processes; on a busy machine run them side by side with ``--threads 1``
(``OMP_WAIT_POLICY=PASSIVE``) rather than one after the other with more threads.

Usage::

    python scripts/train_reference.py --size student      # ~6 CPU-minutes (wall time: see the model card)
    python scripts/train_reference.py --all               # tokenizer + all three models, one after the other
    python scripts/train_reference.py --docs              # redraw the plot and tables from the logs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the split lives in the package so that evaluations score exactly the held-out files
from kvexport.eval.data import HELDOUT_BYTE, corpus_files, read_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
TOKENIZER_DIR = MODELS / "tokenizer"
DOCS = ROOT / "docs"
CACHE = Path("/tmp/kvx_train_cache")
VOCAB = 4096
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
SEQ = 256
SEED = 1234


@dataclass
class Size:
    """Architecture and training budget of one reference model."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    batch: int = 8
    lr: float = 3e-3
    warmup: int = 100
    storage_dtype: str = "float32"  # dtype of the tensors in model.safetensors
    #: later phases, each started from the saved checkpoint: more steps with a fresh AdamW and a new cosine
    extend_steps: tuple[int, ...] = ()
    extend_lr: float = 1e-3
    #: how many of the last extend_steps phases are copy phases (add_copies on every window, peak lr copy_lr)
    copy_phases: int = 0
    copy_lr: float = 2e-3
    head_dim: int = 32


SIZES = {
    "student": Size(
        "kvx-student",
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        intermediate=384,
        steps=1000,
        extend_steps=(600, 1500),
        copy_phases=1,
    ),
    "teacher-2x": Size(
        "kvx-teacher-2x",
        hidden=192,
        layers=4,
        heads=6,
        kv_heads=2,
        intermediate=640,
        steps=1000,
        lr=2.5e-3,
        extend_steps=(1200, 1200),
        copy_phases=1,
    ),
    # fp32 would be 21 MB; weights are stored in float16 to stay under 15 MB (they load as float32).
    "teacher-4x": Size(
        "kvx-teacher-4x",
        hidden=256,
        layers=6,
        heads=8,
        kv_heads=2,
        intermediate=704,
        steps=350,
        warmup=50,
        extend_steps=(300, 400, 600, 1000, 600, 1200),
        copy_phases=1,
        lr=2e-3,
        storage_dtype="float16",
    ),
}


# ----------------------------------------------------------------------------------------------- data
def train_tokenizer(out: Path = TOKENIZER_DIR) -> None:
    """Byte-level BPE on the train split; writes tokenizer.json + tokenizer_config.json (+ special map)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    train, _ = corpus_files()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [t for t in (read_text(r) for r in train) if t is not None]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # add_special_tokens=True prepends <|bos|>, as every training document starts with it
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))


def load_tokenizer(path: Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_split(files: list[str], tok) -> np.ndarray:
    """Concatenate <|bos|> file <|eos|> for every file -> uint16 token stream."""
    out: list[int] = []
    for r in files:
        text = read_text(r)
        if text is None:
            continue
        out += [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    return np.asarray(out, dtype=np.uint16)


def token_streams(tok) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams, cached under /tmp by tokenizer hash."""
    h = hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()[:12]
    CACHE.mkdir(parents=True, exist_ok=True)
    f = CACHE / f"streams_{h}_{platform.python_version()}.npz"
    if f.exists():
        z = np.load(f)
        return z["train"], z["held"]
    train, held = corpus_files()
    a, b = encode_split(train, tok), encode_split(held, tok)
    np.savez(f, train=a, held=b)
    return a, b


def heldout_windows(held: np.ndarray, n: int = 48) -> torch.Tensor:
    """n non-overlapping windows of SEQ+1 tokens spread evenly over the held-out stream -> (n, SEQ+1)."""
    total = len(held) // (SEQ + 1)
    idx = np.linspace(0, total - 1, min(n, total)).astype(int)
    return torch.from_numpy(np.stack([held[i * (SEQ + 1) : (i + 1) * (SEQ + 1)] for i in idx]).astype(np.int64))


# ---------------------------------------------------------------------------------------------- model
def make_config(size: Size, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        intermediate_size=size.intermediate,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.02,
        dtype="float32",
    )


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, bs: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over all positions of the held-out windows."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), bs):
        w = windows[i : i + bs]
        logits = model(w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
        )
        tot, n = tot + loss.item(), n + w[:, 1:].numel()
    model.train()
    return tot / n


def lr_at(step: int, size: Size) -> float:
    if step < size.warmup:
        return size.lr * (step + 1) / size.warmup
    p = (step - size.warmup) / max(1, size.steps - size.warmup)
    return size.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def add_copies(x: torch.Tensor, g: torch.Generator, shortest: int = 48, longest: int = 120, gap: int = 8) -> None:
    """Copy augmentation, in place, for every row of ``x`` (batch, SEQ+1): a span of ``shortest``..``longest``
    tokens from the first half of the window is written again further on (its copy starts at least ``gap``
    tokens after the span ends), over the text that was there. Predicting the copy needs an induction head
    (find the earlier occurrence, continue from it). Plain next-token training on a few million tokens of
    code gave these small models none: they copied nothing, not even a repeated run of random tokens."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        length = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        src = int(torch.randint(1, n // 2 - length, (1,), generator=g))
        dst = int(torch.randint(src + length + gap, n - length + 1, (1,), generator=g))
        x[r, dst : dst + length] = x[r, src : src + length]


def copy_probe(windows: torch.Tensor, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` held-out windows with :func:`add_copies` (fixed seed) and the mask of the target positions that
    an induction head can predict: inside a copied span, after its first token, where the copy changed the
    text. -> (ids (n, SEQ+1), mask (n, SEQ))."""
    x = windows[:n].clone()
    add_copies(x, torch.Generator().manual_seed(SEED))
    changed = (x != windows[:n])[:, 1:]
    prev = torch.cat([torch.zeros(n, 1, dtype=torch.bool), changed[:, :-1]], 1)
    return x, changed & prev


@torch.no_grad()
def copy_accuracy(model, probe: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Top-1 accuracy on the copied positions of :func:`copy_probe` (about the text's own next-token
    accuracy, ~0.5 here, without an induction head; near 1 with one)."""
    x, mask = probe
    was = model.training
    model.eval()
    hit = model(x[:, :-1]).logits.argmax(-1) == x[:, 1:]
    model.train(was)
    return hit[mask].float().mean().item()


def train_step(
    model, opt, train_t: torch.Tensor, g: torch.Generator, batch: int, lr: float, copies: bool = False
) -> float:
    """One AdamW step on ``batch`` random windows of SEQ+1 tokens of the train stream -> the loss; with
    ``copies`` every window gets :func:`add_copies`."""
    starts = torch.randint(0, len(train_t) - SEQ - 1, (batch,), generator=g)
    x = torch.stack([train_t[s : s + SEQ + 1] for s in starts.tolist()])  # (batch, SEQ+1)
    if copies:
        add_copies(x, g)
    for grp in opt.param_groups:
        grp["lr"] = lr
    logits = model(x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def train(key: str, eval_every: int = 100, log=print, threads: int = 2) -> dict:
    from transformers import LlamaForCausalLM

    size = SIZES[key]
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    tok = load_tokenizer()
    train_s, held_s = token_streams(tok)
    windows = heldout_windows(held_s)
    cfg = make_config(size, tok)
    model = LlamaForCausalLM(cfg)  # weights from torch.manual_seed(SEED)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=size.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    g = torch.Generator().manual_seed(SEED)
    train_t = torch.from_numpy(train_s.astype(np.int64))
    hist: dict = {"train": [], "heldout": []}
    log(f"[{key}] params={n_params} train_tokens={len(train_s)} heldout_tokens={len(held_s)} steps={size.steps}")
    t0, run = time.time(), []
    for step in range(size.steps):
        if step % eval_every == 0:
            hist["heldout"].append(
                {
                    "step": step,
                    "tokens": step * size.batch * SEQ,
                    "loss": evaluate(model, windows),
                    "elapsed_s": time.time() - t0,
                }
            )
            log(f"[{key}] step {step} heldout {hist['heldout'][-1]['loss']:.4f} ({time.time() - t0:.0f}s)")
        run.append(train_step(model, opt, train_t, g, size.batch, lr_at(step, size)))
        if (step + 1) % 20 == 0:
            hist["train"].append(
                {
                    "step": step + 1,
                    "tokens": (step + 1) * size.batch * SEQ,
                    "loss": float(np.mean(run)),
                    "elapsed_s": time.time() - t0,
                }
            )
            run = []
    final = evaluate(model, windows)
    wall = time.time() - t0
    hist["heldout"].append(
        {"step": size.steps, "tokens": size.steps * size.batch * SEQ, "loss": final, "elapsed_s": wall}
    )
    log(f"[{key}] done heldout {final:.4f} ppl {math.exp(final):.2f} wall {wall:.0f}s")
    summary = {
        "name": size.name,
        "size": key,
        "params": n_params,
        "steps": size.steps,
        "tokens_seen": size.steps * size.batch * SEQ,
        "train_tokens": int(len(train_s)),
        "heldout_tokens_eval": int(windows[:, 1:].numel()),
        "heldout_loss": final,
        "heldout_ppl": math.exp(final),
        "wall_s": wall,
        "hyper": asdict(size),
        "seed": SEED,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "history": hist,
    }
    save(model, tok, size, summary)
    return summary


def extend(
    key: str, phase_steps: int, eval_every: int = 100, log=print, threads: int = 2, copies: bool = False
) -> dict:
    """One more phase: reload models/<name> as saved (float16 rounding included), train ``phase_steps`` more
    steps (fresh AdamW, 20 warm-up steps, cosine from ``extend_lr`` to 10 %, data seed SEED + phase), save.
    ``copies``: a copy phase (every window gets :func:`add_copies`, peak rate ``copy_lr``)."""
    from transformers import LlamaForCausalLM

    size = SIZES[key]
    out = MODELS / size.name
    prev = json.loads((out / "training_log.json").read_text())
    exts = list(prev.get("extensions", []))
    seed = SEED + 1 + len(exts)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = load_tokenizer()
    train_s, held_s = token_streams(tok)
    windows = heldout_windows(held_s)
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    peak = size.copy_lr if copies else size.extend_lr
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = Size(size.name, 0, 0, 0, 0, 0, steps=phase_steps, lr=peak, warmup=20)
    g = torch.Generator().manual_seed(seed)
    train_t = torch.from_numpy(train_s.astype(np.int64))
    hist = {k: list(v) for k, v in prev["history"].items()}
    s0, w0 = prev["steps"], prev["wall_s"]
    log(f"[{key}] phase {len(exts) + 2}: from step {s0}, {phase_steps} more steps")
    probe = copy_probe(windows)
    hist.setdefault("copy", [])
    t0, run = time.time(), []
    for i in range(phase_steps):
        step = s0 + i
        if i % eval_every == 0:
            if i > 0:
                loss = evaluate(model, windows)
                hist["heldout"].append(
                    {"step": step, "tokens": step * size.batch * SEQ, "loss": loss, "elapsed_s": w0 + time.time() - t0}
                )
                log(f"[{key}] step {step} heldout {loss:.4f} ({time.time() - t0:.0f}s)")
            hist["copy"].append({"step": step, "tokens": step * size.batch * SEQ, "acc": copy_accuracy(model, probe)})
            log(f"[{key}] step {step} copy accuracy {hist['copy'][-1]['acc']:.3f}")
        run.append(train_step(model, opt, train_t, g, size.batch, lr_at(i, sched), copies))
        if (i + 1) % 20 == 0:
            hist["train"].append(
                {
                    "step": step + 1,
                    "tokens": (step + 1) * size.batch * SEQ,
                    "loss": float(np.mean(run)),
                    "elapsed_s": w0 + time.time() - t0,
                }
            )
            run = []
    final = evaluate(model, windows)
    wall = time.time() - t0
    steps = s0 + phase_steps
    hist["heldout"].append({"step": steps, "tokens": steps * size.batch * SEQ, "loss": final, "elapsed_s": w0 + wall})
    copy_acc = copy_accuracy(model, probe)
    hist["copy"].append({"step": steps, "tokens": steps * size.batch * SEQ, "acc": copy_acc})
    log(
        f"[{key}] phase done heldout {final:.4f} ppl {math.exp(final):.2f} copy accuracy {copy_acc:.3f} wall {wall:.0f}s"
    )
    exts.append(
        {
            "from_step": s0,
            "from_loss": prev["heldout_loss"],
            "steps": phase_steps,
            "lr": peak,
            "warmup": 20,
            "seed": seed,
            "wall_s": wall,
            "threads": threads,
            "copies": copies,
        }
    )
    summary = dict(
        prev,
        steps=steps,
        tokens_seen=steps * size.batch * SEQ,
        heldout_loss=final,
        heldout_ppl=math.exp(final),
        copy_accuracy=copy_acc,
        wall_s=w0 + wall,
        history=hist,
        extensions=exts,
    )
    summary["hyper"] = asdict(size)
    save(model, tok, size, summary)
    return summary


# ----------------------------------------------------------------------------------------------- save
def save(model, tok, size: Size, summary: dict) -> None:
    out = MODELS / size.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.eval()
    if size.storage_dtype == "float16":
        from safetensors.torch import save_file

        model.config.save_pretrained(str(out))
        sd = {
            k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
        }  # tied to model.embed_tokens.weight
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(str(out))
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)
    (out / "training_log.json").write_text(json.dumps(summary, indent=1))
    (out / "README.md").write_text(model_card(summary))


def _extension_row(s: dict) -> str:
    rows = ""
    for i, e in enumerate(s.get("extensions", [])):
        rows += (
            f"| training, phase {i + 2} | reloaded the checkpoint saved at step {e['from_step']} (held-out loss "
            f"{e['from_loss']:.4f}) and trained {e['steps']} more steps: fresh AdamW, {e['warmup']} warm-up steps, "
            f"cosine from lr {e['lr']} to 10 %, data seed {e['seed']}"
            + (", **copy phase**: every window gets a repeated span (`add_copies`)" if e.get("copies") else "")
            + f" ({e['wall_s'] / 60:.1f} min, {e['threads']} thread{'s' * (e['threads'] > 1)}) |\n"
        )
    return rows


def _copy_row(s: dict) -> str:
    if "copy_accuracy" not in s:
        return ""
    first = s["history"]["copy"][0]
    return (
        f"| in-context copying | top-1 accuracy **{s['copy_accuracy']:.3f}** on the copied tokens of 16 held-out "
        f"windows with a repeated 48-120-token span (`copy_probe`); {first['acc']:.3f} before the copy phase, "
        f"the text's own predictability: no induction head |\n"
    )


def model_card(s: dict) -> str:
    h = s["hyper"]
    train, held = corpus_files()
    store = (
        "float32"
        if h["storage_dtype"] == "float32"
        else "float16 (to stay under 15 MB; `from_pretrained` loads them as float32, the config's dtype)"
    )
    return f"""# {s["name"]}

A tiny Llama-architecture causal LM trained from scratch on Python source, shipped with kvexport as a
reference model for KV-cache compression experiments (eviction presses, MLA upcycling, distillation).
It writes Python-looking code; it is not a useful assistant.

| | |
|---|---|
| architecture | `LlamaForCausalLM`, {h["layers"]} layers, hidden {h["hidden"]}, {h["heads"]} query heads, {h["kv_heads"]} KV heads (GQA), head_dim {h["head_dim"]}, SwiGLU intermediate {h["intermediate"]}, RMSNorm |
| position encoding | RoPE, theta 100000, max_position_embeddings 32768 (trained on 256-token windows) |
| embeddings | tied (lm_head = embed_tokens) |
| parameters | {s["params"]:,} |
| weights | `model.safetensors`, {store} |
| tokenizer | byte-level BPE, vocab {VOCAB} incl. `<\\|bos\\|>` `<\\|eos\\|>` `<\\|pad\\|>` (shared by all kvexport reference models) |
| data | Python {s["python"]} standard library `*.py` (CPython's `Lib/`), without `site-packages`, `test`, `tests`, `idle_test`, `pydoc_data` |
| split | by file: held out iff `sha256(relative_path)[0] < {HELDOUT_BYTE}`; {len(train)} train files ({s["train_tokens"]:,} tokens), {len(held)} held-out files |
| training | {s["steps"]} steps × batch {h["batch"]} × {SEQ} tokens = {s["tokens_seen"]:,} tokens seen (random windows of the train stream); AdamW (β 0.9/0.95, wd 0.1), lr {h["lr"]} with {h["warmup"]} warm-up steps and cosine decay to 10 %, grad clip 1.0, seed {s["seed"]} |
{_extension_row(s)}| compute | {s["wall_s"] / 60:.1f} min wall on 2 CPU cores shared with other jobs (`torch.set_num_threads({s.get("threads", 2)})`, torch {s["torch"]}) |
| held-out loss | **{s["heldout_loss"]:.4f}** nats/token, perplexity **{s["heldout_ppl"]:.2f}** ({s["heldout_tokens_eval"]:,} tokens: 48 evenly spaced 257-token windows of the held-out stream) |
{_copy_row(s)}
Loss curves: `training_log.json` here, plotted in `docs/reference_models.md`.

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/{s["name"]}")
model = AutoModelForCausalLM.from_pretrained("models/{s["name"]}")
```

```bash
kvexport generate models/{s["name"]} --prompt "def " --press knorm --budget 64 --window 16
```

## Reproduce

```bash
python scripts/train_reference.py --tokenizer        # models/tokenizer (seconds)
python scripts/train_reference.py --size {s["size"]}
```

Same interpreter version (the data is its stdlib) and torch version give the same tokenizer and the
same data order; weights match up to floating-point nondeterminism of CPU kernels.
"""


# ----------------------------------------------------------------------------------------------- plot
def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    rows = []
    for i, size in enumerate(SIZES.values()):
        f = MODELS / size.name / "training_log.json"
        if not f.exists():
            continue
        s = json.loads(f.read_text())
        c = f"C{i}"
        tr, he = s["history"]["train"], s["history"]["heldout"]
        ax.plot(
            [r["tokens"] / 1e6 for r in tr],
            [r["loss"] for r in tr],
            color=c,
            alpha=0.45,
            lw=1,
            label=f"{size.name} train",
        )
        ax.plot(
            [r["tokens"] / 1e6 for r in he],
            [r["loss"] for r in he],
            color=c,
            marker="o",
            ms=3,
            lw=1.8,
            label=f"{size.name} held-out",
        )
        if s["history"].get("copy"):
            cp = s["history"]["copy"]
            cx.plot([r["tokens"] / 1e6 for r in cp], [r["acc"] for r in cp], color=c, marker="o", ms=3, label=size.name)
        rows.append(s)
    cx.set_xlabel("tokens seen (M)")
    cx.set_ylabel("top-1 accuracy on copied tokens")
    cx.set_ylim(0, 1)
    cx.grid(alpha=0.3)
    cx.legend(fontsize=8)
    cx.set_title("in-context copying (copy phase)")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=6.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("kvexport reference models (Python stdlib, 2 CPU cores)")
    fig.tight_layout()
    DOCS.mkdir(exist_ok=True)
    fig.savefig(DOCS / "reference_models_loss.png", dpi=110)
    print("wrote", DOCS / "reference_models_loss.png")


def summaries() -> list[dict]:
    out = []
    for size in SIZES.values():
        f = MODELS / size.name / "training_log.json"
        if f.exists():
            out.append(json.loads(f.read_text()))
    return out


def write_docs() -> None:
    """docs/reference_models.md and models/README.md: one table row per trained model."""
    rows = []
    base = None
    for s in summaries():
        h = s["hyper"]
        base = base or s["params"]
        rows.append(
            f"| [{s['name']}](../models/{s['name']}) | {s['params']:,} ({s['params'] / base:.2f}×) | "
            f"{h['layers']} × {h['hidden']}, {h['heads']} q / {h['kv_heads']} kv heads, ffn {h['intermediate']} | "
            f"{h['storage_dtype']} | {s['steps']} | {s['tokens_seen'] / 1e6:.2f} M | {s['wall_s'] / 60:.1f} min | "
            f"{s['heldout_loss']:.3f} | {s['heldout_ppl']:.1f} |"
        )
    head = (
        "| model | parameters | shape | weights | steps | tokens seen | wall (2 shared cores) | held-out loss | "
        "held-out ppl |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    table = head + "\n".join(rows) + "\n"
    train, held = corpus_files()
    slopes = []
    for s in summaries():
        he = s["history"]["heldout"]
        a, b = he[-2], he[-1]
        slopes.append(f"{s['name']} {a['loss']:.3f} → {b['loss']:.3f} over its last {b['step'] - a['step']} steps")
    trend = "; ".join(slopes)
    by = {s["size"]: s["heldout_loss"] for s in summaries()}
    ordered = by.get("teacher-4x", 99) < by.get("teacher-2x", 99) < by.get("student", 0)
    verdict = (
        "Held-out loss falls with size: student > 2× teacher > 4× teacher."
        if ordered
        else "Held-out loss does not yet fall with size; give the larger models more steps (`SIZES` in "
        "`scripts/train_reference.py`)."
    )
    pace = []
    for s in summaries():
        e = (s.get("extensions") or [None])[-1]
        if e:
            pace.append(
                f"{s['name']} {e['wall_s'] / e['steps']:.2f} s ({e['threads']} thread{'s' * (e['threads'] > 1)})"
            )
    total = sum(s["wall_s"] for s in summaries()) / 60
    copies = "; ".join(
        f"{s['name']} {s['history']['copy'][0]['acc']:.2f} → {s['copy_accuracy']:.2f}"
        for s in summaries()
        if "copy_accuracy" in s
    )
    idle = (
        sum(
            s["steps"] * s["extensions"][-1]["wall_s"] / s["extensions"][-1]["steps"]
            for s in summaries()
            if s.get("extensions")
        )
        / 60
    )
    doc = f"""# Reference models

kvexport ships three small Llama-architecture models trained from scratch on this machine, so that
eviction presses and MLA upcycling can be measured on models whose attention is trained rather than
random. They write plausible Python; they are research fixtures, not assistants.

![loss curves](reference_models_loss.png)

{table}
Held-out loss: mean next-token cross-entropy (nats/token) over 48 evenly spaced 257-token windows of
the held-out stream; perplexity = exp(loss). Train curves are means over 20 steps of the training loss
on random train windows. Until the copy phases (whose windows are about one third repeated text, so easier)
they lie above the held-out curves because the 41 held-out files happen to be easier text than the train
stream on average: scored the same way on 48 evenly spaced windows of the
train stream, the first student checkpoint (step 1000) gave 3.655 nats against 3.136 held out (the split is
by file and disjoint; tests check it), so the gap is the text, not overfitting.

## Where the time went

Held-out loss at the last two evaluations: {trend}. {verdict}

The first schedules (1000 steps for the student and the 2× teacher, 350 for the 4× teacher) ran while
the machine's two cores were shared with about ten other jobs, each training process getting 10–15 % of
a core; the 4× model costs ≈3.5× the student per token, so its first schedule was cut short. Every curve
was still falling, so each model was continued in phases from its saved checkpoint (fresh AdamW, 20
warm-up steps and a new cosine; each phase is listed on the model's card) once the machine was quieter.
Seconds per step in the last phase: {"; ".join(pace)}. Wall time of all phases of all three models:
{total:.0f} min, most of it under contention; at the last phases' pace all of those steps would take
{idle:.0f} min.

## In-context copying

Trained on plain text alone, the models copied nothing from their context: given 40 random tokens twice,
the student and the 2× teacher predicted none of the repeated tokens (measured before their copy phases),
and on held-out windows with a repeated span their accuracy on the copy is that of the text itself (the
first point of each curve on the right). Without copying there is no long-range recall, and the quality
studies ([studies.md](studies.md)) would have nothing to measure but next-token accuracy. Each model's last
phase is therefore a **copy phase**: the same training, except that every 257-token window has a span of
48–120 of its tokens from its first half written again further on (`add_copies`), at a higher peak rate
(`copy_lr`). An induction head forms during it, after a plateau of several hundred steps (right panel:
top-1 accuracy on the copied tokens of 16 held-out windows, `copy_probe`): {copies}.

## Data and split

The `*.py` files of the interpreter's own standard library (`sysconfig.get_paths()["stdlib"]`, here
CPython {platform.python_version()}), found on every machine with Python and needing no download. Excluded folders:
`site-packages`, `test`, `tests`, `idle_test`, `pydoc_data` (prose). Paths are sorted; a file is held
out iff the first byte of `sha256(relative POSIX path)` is below {HELDOUT_BYTE} (≈5 %): {len(train)} train files,
{len(held)} held-out files. Each file is wrapped as `<|bos|> text <|eos|>` and the files are concatenated.

## Tokenizer

`models/tokenizer/` (copied into every model): byte-level BPE trained with `tokenizers` on the train
split, vocab {VOCAB} including `<|bos|>` (0), `<|eos|>` (1), `<|pad|>` (2); `add_special_tokens=True`
prepends `<|bos|>`. Loads with `AutoTokenizer.from_pretrained`, offline.

## Architecture and training

`LlamaForCausalLM`, GQA, RoPE theta 1e5, `max_position_embeddings` 32768, head_dim 32, tied
embeddings. AdamW (β 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to
10 % of the peak rate, gradient clipping 1.0, batches of 256-token windows drawn uniformly from the train
stream with `torch.Generator().manual_seed({SEED})`, weights initialised under `torch.manual_seed({SEED})`.
The 4× teacher's weights are stored in float16 to stay under 15 MB and load as float32.

The machine's two cores were shared with several other jobs during training, so the wall times are
upper bounds for an idle machine; see each card.

## Reproduce

```bash
python scripts/train_reference.py --all          # tokenizer, three models, this page, the plot
python scripts/train_reference.py --size student # one model
python scripts/train_reference.py --docs         # redraw plot + tables from models/*/training_log.json
```
"""
    (DOCS / "reference_models.md").write_text(doc)
    readme = f"""# Bundled reference models

Trained from scratch by `scripts/train_reference.py` on the Python standard library; details, loss
curves and the split in [docs/reference_models.md](../docs/reference_models.md), per-model cards in
each folder. `kvexport generate` uses `kvx-student` when no model is given.

{table.replace("](../models/", "](")}
`tokenizer/` is the shared byte-level BPE tokenizer (each model folder carries a copy).
"""
    (MODELS / "README.md").write_text(readme)
    print("wrote", DOCS / "reference_models.md", MODELS / "README.md")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), action="append", help="model(s) to train")
    ap.add_argument("--all", action="store_true", help="tokenizer + all three models + plot")
    ap.add_argument("--tokenizer", action="store_true", help="(re)train models/tokenizer")
    ap.add_argument(
        "--docs",
        "--plot",
        dest="docs",
        action="store_true",
        help="redraw docs/reference_models_loss.png, docs/reference_models.md, models/README.md",
    )
    ap.add_argument("--steps", type=int, help="override the step count (smoke runs)")
    ap.add_argument(
        "--extend-only",
        action="store_true",
        help="only run the phases in extend_steps not yet in the saved training_log.json",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    a = ap.parse_args(argv)
    if a.tokenizer or a.all or not (TOKENIZER_DIR / "tokenizer.json").exists():
        t = time.time()
        train_tokenizer()
        print(f"tokenizer trained in {time.time() - t:.1f}s -> {TOKENIZER_DIR}")
    keys = list(SIZES) if a.all else (a.size or [])
    for k in keys:
        if a.steps:
            SIZES[k].steps = a.steps
        if not a.extend_only:
            train(k, log=lambda m: print(m, flush=True), threads=a.threads)
        done = len(json.loads((MODELS / SIZES[k].name / "training_log.json").read_text()).get("extensions", []))
        size = SIZES[k]
        for i in range(done, len(size.extend_steps)):
            copies = i >= len(size.extend_steps) - size.copy_phases
            extend(k, size.extend_steps[i], log=lambda m: print(m, flush=True), threads=a.threads, copies=copies)
    if a.docs or a.all or keys:
        plot()
        write_docs()
        for s in summaries():
            (MODELS / s["name"] / "README.md").write_text(model_card(s))


if __name__ == "__main__":
    sys.exit(main())
