# SPDX-License-Identifier: Apache-2.0
"""Compression chosen by measured fidelity: the smallest cache that keeps the model within the user's targets.

``kvexport convert MODEL --choose --min-agreement 0.9 --max-ppl-increase 0.1 --min-recall 0.9`` measures candidate
caches on the PyTorch library path against the original model, on *calibration* text (the held-out text stays for
the validate stage's report), and keeps the one that holds the fewest bytes per sequence among those that meet every
target. Candidates (:data:`FAMILIES`): a press with kvexport's lookahead and neighbours, at a ladder of budgets, with
the model's cache format or int8, and int8 alone (no eviction); then the MLA ranks (:data:`MLA_RATIOS`: the
undistilled rewrite of :func:`kvexport.eval.sweep.mla_settings_for`, 1.5x / 2x / 3.6x fewer elements per token)
under the best GQA family's press and format. For each family the budget is found by bisection on the ladder
(fidelity grows with the budget), so a family costs about log2(ladder) measurements; families that cannot beat the
best found so far in bytes (read off an empty cache of that shape) are not measured at all. The ranks are searched
from the largest down and stop at the first that misses at its largest budget (fidelity grows with the rank too), so
a model that MLA loses costs a rewrite per rank tried (a rank whose cache would not be smaller is rewritten, sized and
skipped) and one measurement.

Measures (:class:`kvexport.eval.sweep.Sweep`): next-token agreement, KL and perplexity over ``windows`` windows of
``context`` tokens of calibration prose (the Python documentation's calibration pages), and passkey retrieval at
``context`` tokens at three depths; a recall target is relative to what the original retrieves (a probe the original
fails is not counted). The trail (every candidate tried, its numbers, why it was kept or dropped) goes to
``choice.json`` and the report.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvexport.errors import BadUsage

LADDER = (256, 512, 1024, 2048, 4096)
#: MLA compressions tried (per-token elements of the GQA cache / the latent cache's), least compressed first
MLA_RATIOS = (1.5, 2.0, 3.6)


@dataclass(frozen=True)
class Targets:
    """What a chosen cache must keep: agreement >= ``min_agreement``, perplexity increase <= ``max_ppl_increase``,
    passkey accuracy >= ``min_recall`` x the original's (None: not a target)."""

    min_agreement: float | None = 0.90
    max_ppl_increase: float | None = 0.10
    min_recall: float | None = 0.90

    def __post_init__(self):
        if all(v is None for v in asdict(self).values()):
            raise BadUsage("--choose needs at least one target (--min-agreement, --max-ppl-increase, --min-recall)")
        if self.min_recall is not None and not 0 <= self.min_recall <= 1:
            raise BadUsage(f"--min-recall {self.min_recall} must be in [0, 1] (a fraction of the original's accuracy)")

    def misses(self, m: dict[str, Any]) -> list[str]:
        """The targets a measurement misses, in words (empty: all met)."""
        out = []
        t = m["text"]
        if self.min_agreement is not None and t["agreement"] < self.min_agreement:
            out.append(f"agreement {t['agreement']:.1%} < {self.min_agreement:.0%}")
        if self.max_ppl_increase is not None and t["ppl_increase"] > self.max_ppl_increase:
            out.append(f"perplexity +{t['ppl_increase']:.1%} > +{self.max_ppl_increase:.0%}")
        if self.min_recall is not None:
            for k, p in m["probes"].items():
                if p["original"] > 0 and p["accuracy"] < self.min_recall * p["original"]:
                    out.append(f"{k} {p['accuracy']:.2f} < {self.min_recall:.0%} of the original's {p['original']:.2f}")
        return out


@dataclass(frozen=True)
class Family:
    """A kind of cache whose size is set by its budget (None: no eviction); ``mla``: on the MLA rewrite that many
    times smaller per token (None: the model's own attention)."""

    press: str | None
    kv_dtype: str | None = None
    neighbors: int = 3
    lookahead: int = 64
    mla: float | None = None

    def setting(self, budget: int | None, window: int, chunk: int):
        from kvexport.eval.sweep import Setting
        from kvexport.presses import PRESSES

        if self.press is None:
            return Setting(kv_dtype=self.kv_dtype, chunk=chunk, mla=self.mla)
        look = (("lookahead", self.lookahead),) if self.lookahead and PRESSES[self.press].observes else ()
        return Setting(self.press, budget, window=window, chunk=chunk, kv_dtype=self.kv_dtype, mla=self.mla,
                       press_kw=(("neighbors", self.neighbors),), generate_kw=look)

    @property
    def label(self) -> str:
        mla = "" if self.mla is None else f"MLA {self.mla:g}x, "
        if self.press is None:
            return f"{mla}no eviction, {self.kv_dtype} cache"
        return f"{mla}{self.press} + lookahead {self.lookahead} + neighbours {self.neighbors}" + (
            f", {self.kv_dtype} cache" if self.kv_dtype else "")


#: what --choose tries, cheapest in bytes per kept token first
FAMILIES = (Family("snapkv", "int8"), Family(None, "int8"), Family("expected_attention", "int8"),
            Family("snapkv"), Family("expected_attention"))


@dataclass
class Choice:
    """The chosen cache (None: nothing met the targets) and every measurement that led there."""

    chosen: dict[str, Any] | None
    trail: list[dict[str, Any]] = field(default_factory=list)
    targets: dict[str, Any] = field(default_factory=dict)
    context: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resident_bytes(m: dict[str, Any], positions: int) -> int:
    """Bytes a sequence's cache holds: a static cache's as measured; a full cache's per slot x ``positions``."""
    p = next(iter(m["probes"].values()))
    total = int(p["resident_bytes"]["total"])
    return total if m["press"] is not None else int(total / p["slots"] * positions)


def predicted_bytes(decoder, fam: Family, budget: int | None, window: int, chunk: int, positions: int) -> int:
    """What the cache of ``fam`` at ``budget`` would hold for one sequence, read off an empty cache of that shape (no
    forward pass): a static cache's buffers, or a full cache sized for ``positions`` tokens."""
    from kvexport.presses import make_press

    if fam.press is None:
        cache = decoder.new_cache(1, None, positions, 0)
    else:
        press = make_press(fam.press, budget=budget, neighbors=fam.neighbors)
        cache = decoder.new_cache(1, press, press.layer_budgets(decoder.spec.num_layers, positions), window, chunk,
                                  lookahead=fam.lookahead if press.observes else 0)
    if fam.kv_dtype is not None:
        cache.set_kv_dtype(fam.kv_dtype, decoder)
    return int(cache.resident_bytes()["total"])


def choose(model_dir, targets: Targets, *, context: int = 4096, positions: int = 8192, window: int = 32,
           chunk: int = 512, families=FAMILIES, ladder=LADDER, windows: int = 2, threads: int | None = None,
           mla_ratios=MLA_RATIOS, log=None) -> Choice:
    """Search the families, then the MLA ranks (module docstring), for the fewest resident bytes at ``positions``
    tokens that meet ``targets`` at ``context`` tokens. ``log(line)`` narrates."""
    from dataclasses import replace

    from kvexport.eval.sweep import Sweep, SweepSpec
    from kvexport.mla.config import equalizes_latent

    say = log or (lambda _m: None)
    t0 = time.time()
    # an MLA rank is measured as the rewrite stage will make it: its default calibration, not the sweep's prose
    spec = SweepSpec(windows=windows, context=context, scored=64, probe_lengths=(context,), probe_kinds=("passkey",),
                     text_split="calibration", threads=threads, calibration_tokens=0)
    sw = Sweep(model_dir, spec, log=say)
    ladder = [b for b in ladder if b < context]
    if not ladder:
        raise BadUsage(f"--choose at a context of {context} tokens leaves no budget to try (smallest {LADDER[0]})")
    best: tuple[int, dict] | None = None
    trail: list[dict[str, Any]] = []

    def measure(fam: Family, budget: int | None) -> tuple[bool, dict]:
        m = sw.measure(fam.setting(budget, window, chunk))
        miss = targets.misses(m)
        b = resident_bytes(m, positions)
        row = {"family": fam.label, "press": fam.press, "kv_dtype": fam.kv_dtype, "budget": budget,
               "neighbors": fam.neighbors if fam.press else None, "lookahead": fam.lookahead if fam.press else None,
               "mla": None if fam.mla is None else {"ratio": fam.mla, **_mla_dims(sw.decoder.spec, fam.mla)},
               "resident_bytes": b, "agreement": m["text"]["agreement"], "kl": m["text"]["kl"],
               "ppl_increase": m["text"]["ppl_increase"],
               "recall": {k: [p["accuracy"], p["original"]] for k, p in m["probes"].items()},
               "meets": not miss, "misses": miss, "seconds": m["seconds"]}
        trail.append(row)
        say(f"  {fam.label}, budget {budget}: {b / 1e6:.1f} MB, agreement {row['agreement']:.1%}, "
            f"ppl {row['ppl_increase']:+.1%}" + ("" if not miss else f" - misses: {'; '.join(miss)}"))
        return not miss, row

    def search(fam: Family) -> str:
        """Bisect ``fam``'s budgets; -> "met", "missed" (at its largest budget) or "skipped" (nothing smaller)."""
        nonlocal best
        dec = sw.model(fam.mla)
        # only the budgets whose cache would be smaller than the best so far are worth measuring
        sizes = {b: predicted_bytes(dec, fam, b, window, chunk, positions)
                 for b in ([None] if fam.press is None else ladder)}
        rungs = [b for b, n in sizes.items() if best is None or n < best[0]]
        if not rungs:
            say(f"  {fam.label}: no budget would hold fewer bytes than the best so far; not measured")
            return "skipped"
        lo, hi, found = 0, len(rungs) - 1, None
        ok, row = measure(fam, rungs[hi])  # the largest first: if it misses, the family is out
        if ok:
            found, hi = row, hi - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                ok, row = measure(fam, rungs[mid])
                if ok:
                    found, hi = row, mid - 1
                else:
                    lo = mid + 1
        if found is not None and (best is None or found["resident_bytes"] < best[0]):
            best = (found["resident_bytes"], found)
        return "met" if found is not None else "missed"

    for fam in families:
        search(fam)
    # the MLA ranks under the best family's press and cache format (or the first family's when none met), largest
    # rank first; a rank that misses at its largest budget ends the search (a smaller one keeps less)
    base = next((f for f in families if best is not None and f.label == best[1]["family"]), families[0])
    sw.spec.mla_equalize = equalizes_latent(base.kv_dtype)  # as the rewrite stage does for that cache format
    for ratio in mla_ratios:
        if search(replace(base, mla=float(ratio))) == "missed":
            rest = [f"{r:g}x" for r in mla_ratios if r > ratio]
            if rest:
                say(f"  MLA {ratio:g}x missed at its largest budget; {', '.join(rest)} not measured")
            break
    for row in trail:
        row["chosen"] = best is not None and row is best[1]
    return Choice(best[1] if best else None, trail, asdict(targets), context, round(time.time() - t0, 1))


def _mla_dims(spec, ratio: float) -> dict[str, int]:
    from kvexport.eval.sweep import mla_settings_for

    m = mla_settings_for(spec, ratio)
    return {"kv_rank": int(m.kv_rank), "rope_dim": int(m.rope_dim)}


__all__ = ["Targets", "Family", "FAMILIES", "LADDER", "MLA_RATIOS", "Choice", "choose", "resident_bytes"]
