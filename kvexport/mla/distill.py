# SPDX-License-Identifier: Apache-2.0
"""Distil an MLA student from a teacher's logits (X-EcoMLA's recovery step: forward KL, optional CE mix).

Data parallelism is Hugging Face accelerate's, not ours: the student goes through ``Accelerator.prepare``
(DDP across processes; FSDP if the user's accelerate config says so), the data loader is prepared with
``split_batches=True``: every step consumes one *global* batch of ``batch_size`` sequences, split evenly
over the processes. Each process's loss is the mean over its (equal) share of tokens and DDP averages
gradients, so one process and N processes take the same steps on the same data (to float rounding).

Loss per token t: ``KL(p_teacher,t || p_student,t) = Σ_v p_T log(p_T / p_S)`` averaged over all tokens,
plus ``ce_weight ×`` next-token cross-entropy when ``ce_weight > 0``. Learning rate: linear warm-up over the
first ``warmup`` of the steps, then cosine decay to ``min_lr`` × the peak (``warmup=0, min_lr=1``: constant).
Data: ``copy_fraction`` of every global batch's sequences get a span repeated later
(:func:`kvexport.mla.recall_data.copy_augment`), seeded by the step, so the student keeps in-context copying.

On disk (``out``): ``checkpoints/step-NNNNNN/`` (accelerate state + ``trainer_state.json``), ``distill_log.jsonl``
(one JSON object per step), ``distill_summary.json`` and, at the end, the MLA model files (``kvexport_mla.json``,
``model.safetensors``, tokenizer), so ``out`` loads with :func:`kvexport.mla.io.load_mla`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvexport.errors import BadModel, BadUsage

CHECKPOINTS = "checkpoints"
LOG = "distill_log.jsonl"
SUMMARY = "distill_summary.json"


@dataclass
class DistillConfig:
    tokens: int
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-4
    ce_weight: float = 0.0
    save_every: int = 100
    seed: int = 0
    grad_clip: float = 1.0
    warmup: float = 0.05
    min_lr: float = 0.1
    copy_fraction: float = 0.5

    def __post_init__(self):
        for name in ("tokens", "seq_len", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise BadUsage(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise BadUsage(f"--lr {self.lr} must be > 0")
        if self.ce_weight < 0:
            raise BadUsage(f"--ce-weight {self.ce_weight} must be >= 0")
        if self.save_every < 1:
            raise BadUsage(f"--save-every {self.save_every} must be >= 1")
        if not 0.0 <= self.warmup < 1.0:
            raise BadUsage(f"--warmup {self.warmup} must be a fraction of the steps in [0, 1)")
        if not 0.0 <= self.min_lr <= 1.0:
            raise BadUsage(f"--min-lr {self.min_lr} must be a fraction of --lr in [0, 1]")
        if not 0.0 <= self.copy_fraction <= 1.0:
            raise BadUsage(f"--copy-fraction {self.copy_fraction} must be in [0, 1]")

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based): linear warm-up, then cosine from lr to min_lr · lr."""
        w = int(math.ceil(self.warmup * self.steps))
        if step < w:
            return self.lr * (step + 1) / w
        p = (step - w) / max(1, self.steps - w)
        return self.lr * (self.min_lr + (1.0 - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p)))

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / (self.batch_size * self.seq_len))


# ---------------------------------------------------------------------------------------------- data
def read_tokens(path: str | Path, tokenizer=None, vocab_size: int | None = None) -> torch.Tensor:
    """A data file -> token ids (N,) int64.

    ``.txt`` (or any other suffix): UTF-8 text, tokenized with ``tokenizer``; ``.jsonl``: one object per line with
    ``"text"`` (tokenized) or ``"input_ids"``; ``.npy``: an integer array of token ids.
    """
    p = Path(path)
    if not p.is_file():
        raise BadUsage(f"data file {p} does not exist")
    if p.stat().st_size == 0:
        raise BadUsage(f"data file {p} is empty")

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise BadUsage(f"{p} holds text but the student has no tokenizer; give token ids (.jsonl with "
                           "input_ids, or .npy) or a model directory with tokenizer.json")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    if p.suffix == ".npy":
        import numpy as np

        try:
            ids = torch.from_numpy(np.load(p).astype("int64").reshape(-1))
        except Exception as e:  # noqa: BLE001
            raise BadUsage(f"data file {p} is not a NumPy integer array ({e.__class__.__name__})") from None
    elif p.suffix == ".jsonl":
        out: list[int] = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise BadUsage(f"{p} line {n} is not JSON") from None
            if isinstance(obj, dict) and "input_ids" in obj:
                out.extend(int(t) for t in obj["input_ids"])
            elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
                out.extend(encode(obj["text"]))
            else:
                raise BadUsage(f"{p} line {n} has neither 'text' nor 'input_ids'")
        ids = torch.tensor(out, dtype=torch.long)
    else:
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise BadUsage(f"data file {p} is not UTF-8 text (or use .jsonl / .npy token files)") from None
        if not text.strip():
            raise BadUsage(f"data file {p} holds no text")
        ids = torch.tensor(encode(text), dtype=torch.long)
    if ids.numel() == 0:
        raise BadUsage(f"data file {p} yields no tokens")
    if vocab_size is not None and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise BadUsage(f"data file {p} has token ids outside the model's vocabulary [0, {vocab_size})")
    return ids


def global_batches(ids: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """ids (N,) -> (steps · batch_size, seq_len): sequences in step order, reshuffled (seeded) each pass, with
    ``cfg.copy_fraction`` of every global batch copy-augmented (seeded by seed and step)."""
    from kvexport.mla.recall_data import copy_augment

    n_seq = ids.numel() // cfg.seq_len
    if n_seq < 1:
        raise BadUsage(f"the data has {ids.numel()} tokens, fewer than one --seq-len {cfg.seq_len} sequence")
    seqs = ids[: n_seq * cfg.seq_len].view(n_seq, cfg.seq_len)
    need = cfg.steps * cfg.batch_size
    order, epoch = [], 0
    while sum(len(o) for o in order) < need:
        order.append(torch.randperm(n_seq, generator=torch.Generator().manual_seed(cfg.seed + epoch)))
        epoch += 1
    out = seqs[torch.cat(order)[:need]]
    if cfg.copy_fraction > 0:
        B = cfg.batch_size
        for step in range(cfg.steps):
            out[step * B : (step + 1) * B] = copy_augment(out[step * B : (step + 1) * B], cfg.copy_fraction,
                                                          seed=cfg.seed * 1_000_003 + step)
    return out


# ---------------------------------------------------------------------------------------------- losses
def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits -> mean over tokens of KL(p_T || p_S), nats (float32)."""
    lt = teacher_logits.float().log_softmax(-1)
    ls = student_logits.float().log_softmax(-1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


@torch.no_grad()
def evaluate_kl(student, teacher, ids: torch.Tensor, seq_len: int, max_seqs: int = 64) -> float:
    """Mean forward KL of student to teacher over up to ``max_seqs`` consecutive ``seq_len`` windows of ``ids``."""
    n = min(ids.numel() // seq_len, max_seqs)
    if n < 1:
        raise BadUsage(f"held-out data has fewer than {seq_len} tokens")
    x = ids[: n * seq_len].view(n, seq_len)
    dev = next(student.parameters()).device
    pos = torch.arange(seq_len, device=dev).expand(n, seq_len)
    return forward_kl(teacher(x.to(dev), pos), student(x.to(dev), pos)).item()


def params_fingerprint(model) -> str:
    """sha256 of all parameters' bytes, in name order (equal iff the weights are bit-identical)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- checkpoints
def latest_checkpoint(out: Path) -> Path | None:
    cks = sorted((out / CHECKPOINTS).glob("step-*")) if (out / CHECKPOINTS).is_dir() else []
    cks = [c for c in cks if (c / "trainer_state.json").is_file()]
    return cks[-1] if cks else None


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse to clobber a directory, or to resume from nothing (before anything is written)."""
    if out.exists() and not out.is_dir():
        raise BadUsage(f"--out {out} is a file; give a directory path")
    if resume:
        if latest_checkpoint(out) is None:
            raise BadUsage(f"--resume: {out} has no checkpoint to resume from")
    elif out.exists() and any(out.iterdir()):
        raise BadUsage(f"output directory {out} exists and is not empty; pass --resume to continue it or choose "
                       "another --out")


def check_teacher(student, teacher, student_tok=None, teacher_tok=None) -> None:
    """Same vocabulary: the same vocab size and, when both have tokenizers, the same token -> id map."""
    vs, vt = student.spec.vocab_size, teacher.spec.vocab_size
    if vs != vt:
        raise BadModel(f"teacher vocabulary ({vt} tokens) differs from the student's ({vs}); distillation needs "
                       "the same tokenizer")
    if student_tok is not None and teacher_tok is not None and student_tok.get_vocab() != teacher_tok.get_vocab():
        raise BadModel("teacher tokenizer differs from the student's (same size, other tokens); distillation "
                       "needs the same tokenizer")


# ---------------------------------------------------------------------------------------------- loop
def distill(student, teacher, ids: torch.Tensor, out: str | Path, cfg: DistillConfig, *, resume: bool = False,
            tokenizer_dir: str | Path | None = None, cpu: bool = False, progress: bool = True) -> dict:
    """Fine-tune the MLA ``student`` (a Decoder) against ``teacher`` on token ids (N,); returns the summary dict.

    Runs on every process of an ``accelerate launch``; only the main process writes logs and the model.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from kvexport.mla.io import save_mla

    out = Path(out)
    check_out_dir(out, resume)
    acc = Accelerator(cpu=cpu, dataloader_config=DataLoaderConfiguration(split_batches=True))
    if cfg.batch_size % acc.num_processes:
        raise BadUsage(f"--batch-size {cfg.batch_size} must be a multiple of the {acc.num_processes} processes "
                       "(each process takes an equal share of every global batch)")
    set_seed(cfg.seed)
    data = global_batches(ids, cfg)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, shuffle=False)
    student.train()
    teacher.eval().requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model, opt, loader = acc.prepare(student, opt, loader)
    teacher.to(acc.device)
    start, tokens_seen = 0, 0
    if resume:
        ck = latest_checkpoint(out)
        acc.load_state(str(ck))
        st = json.loads((ck / "trainer_state.json").read_text())
        start, tokens_seen = int(st["step"]), int(st["tokens"])
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    acc.wait_for_everyone()
    batches = acc.skip_first_batches(loader, start) if start else loader
    log_f = open(out / LOG, "a") if acc.is_main_process else None
    bar = _progress(cfg.steps * cfg.batch_size * cfg.seq_len, tokens_seen) if (progress and acc.is_main_process) \
        else None
    t0, last = time.perf_counter(), {}
    step = start
    try:
        for batch in batches:
            if step >= cfg.steps:
                break
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            x = batch.to(acc.device)
            B, T = x.shape
            pos = torch.arange(T, device=acc.device).expand(B, T)
            with torch.no_grad():
                t_logits = teacher(x, pos)
            s_logits = model(x, pos)
            kl = forward_kl(t_logits, s_logits)
            ce = F.cross_entropy(s_logits[:, :-1].float().reshape(-1, s_logits.shape[-1]), x[:, 1:].reshape(-1)) \
                if cfg.ce_weight > 0 else kl.new_zeros(())
            loss = kl + cfg.ce_weight * ce
            acc.backward(loss)
            if cfg.grad_clip:
                acc.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += cfg.batch_size * cfg.seq_len
            red = acc.reduce(torch.stack([loss.detach(), kl.detach(), ce.detach()]), reduction="mean")
            dt = time.perf_counter() - t0
            last = {"step": step, "tokens": tokens_seen, "loss": red[0].item(), "kl": red[1].item(),
                    "ce": red[2].item(), "lr": cfg.lr_at(step - 1),
                    "tokens_per_s": (tokens_seen - start * cfg.batch_size * cfg.seq_len) / max(dt, 1e-9)}
            if log_f is not None:
                log_f.write(json.dumps(last) + "\n")
                log_f.flush()
            if bar is not None:
                bar[0].update(bar[1], completed=tokens_seen, loss=last["loss"], tps=last["tokens_per_s"])
            if step % cfg.save_every == 0 or step == cfg.steps:
                _checkpoint(acc, out, step, tokens_seen)
    finally:
        if bar is not None:
            bar[0].stop()
        if log_f is not None:
            log_f.close()
    acc.wait_for_everyone()
    final = acc.unwrap_model(model)
    # every rank's fingerprint, gathered: proof that DDP kept the replicas identical
    fp = params_fingerprint(final)
    fps = acc.gather(torch.tensor([int(fp[:15], 16)], device=acc.device)).tolist()
    summary = {"steps": step, "tokens": tokens_seen, "processes": acc.num_processes, "final": last,
               "rank_fingerprints": [f"{v:015x}" for v in fps], "fingerprint": fp, "config": asdict(cfg)}
    if acc.is_main_process:
        tmp = Path(tempfile.mkdtemp(prefix=".model.", dir=out))
        try:
            save_mla(final, tmp / "m", tokenizer_dir=tokenizer_dir)
            # manifest.json last: until it is in place, a half-replaced model fails load_mla's hash check
            for f in sorted((tmp / "m").iterdir(), key=lambda f: f.name == "manifest.json"):
                f.replace(out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    acc.wait_for_everyone()
    final.eval()
    return summary


def _checkpoint(acc, out: Path, step: int, tokens: int) -> None:
    # written under a temporary name and renamed once complete: an interrupted save leaves no step-* directory
    ck = out / CHECKPOINTS / f"step-{step:06d}"
    tmp = out / CHECKPOINTS / f".step-{step:06d}.tmp"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # from an earlier, interrupted save
    acc.wait_for_everyone()
    try:
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "tokens": tokens}) + "\n")
            shutil.rmtree(ck, ignore_errors=True)
            os.rename(tmp, ck)
            for old in sorted((out / CHECKPOINTS).glob("step-*"))[:-2]:  # keep the last two
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    acc.wait_for_everyone()


def _progress(total: int, done: int):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    p = Progress(TextColumn("[bold]distill[/]"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
                 TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
                 TimeRemainingColumn())
    task = p.add_task("distill", total=total, completed=done, loss=float("nan"), tps=0.0)
    p.start()
    return p, task
