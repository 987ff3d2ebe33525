# SPDX-License-Identifier: Apache-2.0
"""One call in a fresh Python process, with its progress lines and its error brought back (issue 20).

A stage that imports a large library and builds large short-lived graphs (the export: torch.export, onnxscript,
onnx_ir; several hundred thousand Python objects and a fragmented heap on a 28-layer model) leaves a few hundred MB
of anonymous memory in the process that no collection returns. Run in a child, all of it goes back to the system
when the child exits, and the stages after it start from what the parent held before.

The child is a new interpreter (``sys.executable``, this process's import path; no copy of the parent's heap) that
imports this module alone, reads its job from stdin and answers on a socket of its own; ``fn`` and its arguments
must pickle (a module-level function, paths, plain settings). ``progress(message)`` lines are relayed as they come;
an exception raised by ``fn`` is raised again in the parent (the same class when it pickles, with the child's
traceback attached as a note for ``--debug``); a child that dies without a word (killed for memory, a crash) is one
:class:`~kvexport.errors.KVExportError` naming its exit status. An interrupt of the parent stops the child.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable

from kvexport.errors import KVExportError

#: what the child runs: only this module is imported first, never the parent's main script (multiprocessing's
#: ``spawn`` would run a script that calls kvexport without an ``if __name__ == "__main__"`` guard again)
_CHILD = "from kvexport.convert.isolate import _serve; _serve()"


class ChildFailed(KVExportError):
    """The child raised something that cannot be brought back as itself, or ended without a result."""


def _serve() -> None:
    """The child: reads (fd, fn, args, kwargs, relay_progress) from stdin, runs ``fn``, answers on the socket."""
    # a terminal's Ctrl-C or hang-up reaches the whole process group: the parent handles it (cleans up its outputs)
    # and stops the child, which must not die half-way through its own reply first
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    fd, fn, args, kwargs, relay_progress = pickle.load(sys.stdin.buffer)
    with socket.socket(fileno=fd) as sock, sock.makefile("wb") as out:
        def send(*message) -> None:
            pickle.dump(message, out)
            out.flush()

        try:
            if relay_progress:
                kwargs = {**kwargs, "progress": lambda message: send("progress", str(message))}
            send("done", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            tb = traceback.format_exc()
            try:
                pickle.loads(pickle.dumps(e))
                exc = e
            except Exception:  # noqa: BLE001 - an exception that does not pickle comes back by name and message
                exc = None
            send("error", exc, type(e).__name__, str(e), tb)


def call_in_child(fn: Callable, *args: Any, progress: Callable[[str], None] | None = None, what: str = "child",
                  **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (+ ``progress=`` relayed when given) in a fresh process; -> its result."""
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports from
    with ours:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, env=env,
                                pass_fds=(theirs.fileno(),))
        try:
            try:
                proc.stdin.write(pickle.dumps((theirs.fileno(), fn, args, kwargs, progress is not None)))
                proc.stdin.close()
            except BrokenPipeError:  # the child died before it read its job: its exit status says the rest
                pass
            theirs.close()  # the child's end: the parent reads EOF once the child has closed it (or died)
            with ours.makefile("rb") as replies:
                while True:
                    try:
                        message = pickle.load(replies)
                    except EOFError:
                        break
                    kind = message[0]
                    if kind == "progress":
                        if progress is not None:
                            progress(message[1])
                    elif kind == "done":
                        proc.wait()
                        return message[1]
                    elif kind == "error":
                        _, exc, name, text, tb = message
                        proc.wait()
                        if exc is None:
                            exc = ChildFailed(f"{name}: {text}")
                        exc.add_note(f"raised in the {what} process:\n{tb}")
                        raise exc
            status = proc.wait()
            raise ChildFailed(f"the {what} process ended with exit status {status} before it finished "
                              "(killed for memory, or a crash)")
        finally:
            theirs.close()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


__all__ = ["call_in_child", "ChildFailed"]
