# SPDX-License-Identifier: Apache-2.0
"""Progress of a long step: one live line with a spinner, the elapsed time and the current sub-step.

    with StepProgress(console, "validate exp/snapkv") as p:
        validate(d, progress=p.callback)      # the library calls progress("prompt 2/4") between sub-steps

On a terminal the line updates in place (rich); elsewhere (a log, a pipe, a test) nothing is drawn and
:attr:`callback` is None, so libraries are not asked for sub-step messages nobody would see. The caller
prints the final line with :attr:`elapsed`.
"""

from __future__ import annotations

import time
from typing import Any, Callable


class StepProgress:
    def __init__(self, console: Any, label: str):
        self.console = console
        self.label = label
        self.live = bool(getattr(console, "is_terminal", False))
        self.steps: list[str] = []  # every sub-step message received, in order
        self._progress = None
        self._task = None
        self._t0 = time.perf_counter()

    def __enter__(self) -> "StepProgress":
        self._t0 = time.perf_counter()
        if self.live:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      TextColumn("[dim]{task.fields[step]}"), console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.label, step="")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def step(self, message: str) -> None:
        """Show ``message`` as the current sub-step."""
        self.steps.append(str(message))
        if self._progress is not None:
            self._progress.update(self._task, step=str(message))

    @property
    def callback(self) -> Callable[[str], None] | None:
        """``step`` on a terminal, else None (pass it as a library's ``progress=``)."""
        return self.step if self.live else None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0


def stdout_console():
    """The console results are printed on: a terminal's width, or wide enough that tables are never cut
    (``pytor…``) when the output goes to a file or a pipe."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200, soft_wrap=True)


__all__ = ["StepProgress", "stdout_console"]
