# SPDX-License-Identifier: Apache-2.0
"""A small stage runner: named steps run in order, each shown with a live line (spinner, elapsed time, the
current sub-step) on a terminal and its wall time when done.

A stage reports sub-steps through :meth:`Pipeline.step` (``"prompt 2/4"``); it can decide at run time that
it does not apply by raising :class:`StageSkipped` (recorded as skipped, with the reason). If a stage fails,
the runner marks it, prints its time and raises :class:`StageFailed` naming it (``stage 'export' failed:
...``) with the original error's exit code. The caller runs the pipeline inside ``atomic_output`` so that a
failure leaves no partial output directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvexport.errors import KVExportError


@dataclass
class StageRecord:
    name: str
    status: str = "pending"  # pending | done | skipped | failed
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3), "note": self.note}


class StageFailed(KVExportError):
    """Wraps the error of a failed stage, keeping its exit code and naming the stage."""

    def __init__(self, stage: str, error: BaseException):
        self.stage = stage
        self.error = error
        self.exit_code = getattr(error, "exit_code", 70)
        lines = [ln for ln in str(error).splitlines() if ln.strip()]
        msg = lines[0].strip() if lines else error.__class__.__name__
        if len(msg) > 300:
            msg = msg[:297] + "..."
        if not isinstance(error, KVExportError):
            msg = f"{error.__class__.__name__}: {msg} (rerun with --debug for the traceback)"
        super().__init__(f"stage '{stage}' failed: {msg}")


class StageSkipped(Exception):
    """Raised by a stage that finds it cannot apply (e.g. no TensorRT under --allow-partial): the message is
    the reason shown beside 'skipped'."""


@dataclass
class Stage:
    name: str
    fn: Callable[[], str | None]  # returns a short note for the summary, or None
    enabled: bool = True
    skip_reason: str = ""


@dataclass
class Pipeline:
    """Runs :class:`Stage` s in order with a progress display; records status and wall time."""

    stages: list[Stage]
    console: Any = None
    records: list[StageRecord] = field(default_factory=list)
    _live: Any = field(default=None, init=False, repr=False)

    @property
    def live(self) -> bool:
        """True when sub-steps are shown (the console is a terminal)."""
        return bool(getattr(self.console, "is_terminal", False))

    def step(self, message: str) -> None:
        """Show ``message`` as the running stage's current sub-step (nothing when not on a terminal)."""
        if self._live is not None:
            self._live.step(message)

    def run(self) -> list[StageRecord]:
        from rich.console import Console

        from kvexport.convert.progress import StepProgress

        self.console = console = self.console or Console(stderr=True)
        self.records = [StageRecord(s.name) for s in self.stages]
        n = len(self.stages)
        for i, (stage, rec) in enumerate(zip(self.stages, self.records, strict=False)):
            label = f"[{i + 1}/{n}] {stage.name}"
            if not stage.enabled:
                rec.status, rec.note = "skipped", stage.skip_reason
                console.print(f"[dim]{label:<22} skipped  {stage.skip_reason}[/]", highlight=False)
                continue
            t0 = time.perf_counter()
            try:
                with StepProgress(console, label) as self._live:
                    note = stage.fn()
            except StageSkipped as e:
                rec.status, rec.seconds, rec.note = "skipped", time.perf_counter() - t0, str(e)
                console.print(f"[yellow]{label:<22} skipped  {rec.note}[/]", highlight=False, soft_wrap=True)
                continue
            except BaseException as e:  # noqa: BLE001 - re-raised, named
                rec.status, rec.seconds = "failed", time.perf_counter() - t0
                console.print(f"[red]{label:<22} failed   {rec.seconds:7.1f}s[/]", highlight=False)
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise StageFailed(stage.name, e) from e
            finally:
                self._live = None
            rec.status, rec.seconds, rec.note = "done", time.perf_counter() - t0, note or ""
            console.print(f"[green]{label:<22} done     {rec.seconds:7.1f}s[/]  {rec.note}", highlight=False, soft_wrap=True)
        return self.records


__all__ = ["Pipeline", "Stage", "StageRecord", "StageFailed", "StageSkipped"]
