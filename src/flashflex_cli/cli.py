"""The `flashflex` command line: a thin typer app. Each command group lives in `commands/`.

Errors of the FlashflexError family become one line on stderr and their exit code, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from . import __version__
from .commands import calibrate as calibrate_commands
from .commands import data as data_commands
from .commands import export as export_commands
from .commands import launch as launch_commands
from .commands import planning as planning_commands
from .commands import profile as profile_commands
from .errors import FlashflexError

app = typer.Typer(
    name="flashflex",
    help="Plan and run asymmetric data/pipeline/tensor-parallel LLM training on heterogeneous GPU fleets.\n\n"
    "Workflow: `profile` the hardware -> `plan` a layout -> `show`/`diff` it -> `launch` it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"flashflex {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """flashflex: heterogeneous LLM training planner and runtime."""


profile_commands.register(app)
planning_commands.register(app)
launch_commands.register(app)
data_commands.register(app)
calibrate_commands.register(app)
export_commands.register(app)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns (and, when called from the shell, exits with) the process exit code."""
    try:
        app(args=argv, prog_name="flashflex")
        code = 0
    except FlashflexError as exc:
        typer.echo(f"error: {exc}", err=True)
        code = exc.exit_code
    except SystemExit as exc:  # typer/click usage errors (2), typer.Exit(code), --help (0)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        code = 130
    except OSError as exc:  # a safety net: file errors the commands did not turn into an InputError
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        typer.echo(f"error: cannot access{where}: {exc.strerror or exc}", err=True)
        code = 2
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
