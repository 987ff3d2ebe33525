# SPDX-License-Identifier: Apache-2.0
"""Interruptions that clean up: SIGINT, SIGTERM and SIGHUP raised as :class:`Interrupted` in the main thread.

Python's default SIGTERM handler ends the process at once, without running ``finally`` blocks or
``except BaseException`` clean-ups, so a ``kill`` during ``kvexport export`` would leave the temporary
sibling of ``--out`` behind. :func:`interrupts_raise` turns those signals into :class:`Interrupted`
(a :class:`KeyboardInterrupt`, like Ctrl-C), so every writer that cleans up on ``BaseException``
(:func:`kvexport.manifest.atomic_output`, :func:`kvexport.mla.io.save_mla`, ...) also cleans up
on ``kill``. Only the first signal raises; further ones arriving during the clean-up are remembered
and ignored, so a second ``kill`` cannot interrupt the removal of a half-written directory.

The CLI's ``main()`` runs every command inside :func:`interrupts_raise` and exits with ``128 + signum``;
the yielded :class:`SignalState` also catches the case where typer swallows the KeyboardInterrupt (it turns
it into a returned 130). Library users who want the same behaviour wrap their own calls.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator

#: signals turned into :class:`Interrupted` (SIGINT too: its default raises a KeyboardInterrupt that
#: typer turns into a silent return value; ours is recorded, so the CLI can report it)
SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Interrupted(KeyboardInterrupt):
    """The process received ``signum``; the CLI exits with ``128 + signum`` after cleaning up."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalState:
    """What :func:`interrupts_raise` saw: ``signum`` of the first signal (None if none arrived)."""

    def __init__(self) -> None:
        self.fired: list[int] = []

    @property
    def signum(self) -> int | None:
        return self.fired[0] if self.fired else None


@contextlib.contextmanager
def interrupts_raise(signals: tuple[int, ...] = SIGNALS) -> Iterator[SignalState]:
    """Within the block, the given signals raise :class:`Interrupted` once (main thread only; elsewhere a no-op).

    Yields a :class:`SignalState` that records the signals received (also when something up the stack
    swallowed the exception).
    """
    state = SignalState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        state.fired.append(signum)
        if len(state.fired) == 1:
            raise Interrupted(signum)

    previous = {}
    for s in signals:
        try:
            previous[s] = signal.signal(s, handler)
        except (OSError, ValueError):  # pragma: no cover - not settable here
            pass
    try:
        yield state
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def leftovers(parent: str | Path, name: str) -> list[Path]:
    """Temporary siblings of ``parent/name`` that kvexport writers create (``.NAME.*``): should be none."""
    return sorted(Path(parent).glob(f".{name}.*"))


def umask() -> int:
    """The process's file-creation mask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_mode(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open()`` / ``mkdir()`` would under the user's umask (0644 / 0755 by
    default): temporary files (``mkstemp``, onnx's external data) are created 0600, which an engine build running
    as another user cannot read. Directories are walked."""
    p = Path(path)
    mask = umask()
    if p.is_dir():
        os.chmod(p, 0o777 & ~mask)
        for child in p.rglob("*"):
            if not child.is_symlink():
                os.chmod(child, (0o777 if child.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(p, 0o666 & ~mask)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling of ``path`` and rename it onto ``path`` (removed on any error); the
    file gets the user's umask mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        user_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def rebase_paths(obj, old: str | Path, new: str | Path | None):
    """``obj`` (JSON-like) with every string that names ``old`` or a path below it naming ``new`` instead: what a
    directory built under a temporary name writes about itself, as it will be called once renamed into place."""
    if new is None:
        return obj
    old_s, new_s = str(Path(old).resolve()), str(Path(new).resolve())
    if old_s == new_s:
        return obj

    def walk(v):
        if isinstance(v, str):
            return new_s + v[len(old_s):] if v == old_s or v.startswith(old_s + "/") else v
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        return v

    return walk(obj)


__all__ = ["Interrupted", "rebase_paths", "SignalState", "interrupts_raise", "leftovers", "atomic_write_bytes", "user_mode", "umask",
           "SIGNALS"]
