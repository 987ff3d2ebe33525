# SPDX-License-Identifier: Apache-2.0
"""The ``kvexport`` command line. Each subcommand lives in its own module and registers on :data:`app`."""

from __future__ import annotations

import sys

# subcommand modules register themselves on import
from kvexport.cli import (  # noqa: E402,F401
    bench_cmd,
    convert_cmds,
    eval_cmds,
    export_cmds,
    generate_cmd,
    get_cmd,
    mla_cmds,
    serve_cmd,
    trt_cmds,
)
from kvexport.cli.app import app
from kvexport.quiet import quiet_libraries


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and turns kvexport errors into one line and an exit code."""
    import click

    from kvexport.atomic import Interrupted, interrupts_raise
    from kvexport.errors import InternalError, KVExportError

    try:  # typer >= 0.25 raises the exceptions of its vendored copy of click
        from typer._click import exceptions as tx
    except ImportError:  # pragma: no cover - older typer uses click itself
        tx = click.exceptions
    exit_types = tuple({click.exceptions.Exit, getattr(tx, "Exit", click.exceptions.Exit)})
    abort_types = tuple({click.exceptions.Abort, getattr(tx, "Abort", click.exceptions.Abort)})
    usage_types = tuple({click.ClickException, getattr(tx, "ClickException", click.ClickException)})

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    quiet_libraries()
    try:
        with interrupts_raise() as sig:  # SIGINT/SIGTERM/SIGHUP -> Interrupted: temporary outputs are cleaned up
            rv = app(args=args, prog_name="kvexport", standalone_mode=False)
        if sig.signum is not None:  # typer turns KeyboardInterrupt into a returned 130
            print(f"error: interrupted ({Interrupted(sig.signum)})", file=sys.stderr)
            return 128 + sig.signum
        if isinstance(rv, int) and not isinstance(rv, bool) and rv != 0:
            return rv
    except exit_types as e:
        return int(e.exit_code or 0)
    except abort_types as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, Interrupted):
            print(f"error: interrupted ({cause})", file=sys.stderr)
            return cause.exit_code
        print("error: interrupted", file=sys.stderr)
        return 130
    except usage_types as e:  # unknown option, missing argument, bad value: bad usage, one line
        if not e.format_message():  # no_args_is_help: the help was printed, nothing went wrong
            return 0
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        print(f"error: {e.format_message()}{hint}", file=sys.stderr)
        return 2
    except KVExportError as e:
        if debug or isinstance(e, InternalError):
            import traceback

            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"error: interrupted ({e})", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line, traceback with --debug
        if debug:
            import traceback

            traceback.print_exc()
        print(f"error: internal error: {e.__class__.__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return InternalError.exit_code
    return 0


def run() -> None:
    sys.exit(main())
