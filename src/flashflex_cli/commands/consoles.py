"""The two output streams of every command: results a person reads (tables, summaries, "wrote FILE") on stdout,
so that `flashflex show plan.json | less` shows them; diagnostics and progress (warnings, progress bars, step
lines) on stderr. With --json, stdout carries the JSON alone and the human-readable results move to stderr.

Piped into a file or a pager, a console is as wide as COLUMNS says, else WIDE_PIPE characters, so that tables
keep their rows on one line each (rich's own default for a pipe is 80 columns). A "wrote FILE" line (`wrote`) is
never wrapped, whatever the width, so `grep wrote` finds the whole path.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.text import Text

WIDE_PIPE = 160  # characters: the widest table (the plan's, at five stages and a profile note) fits


def _width(stream_is_terminal: bool) -> int | None:
    if stream_is_terminal or os.environ.get("COLUMNS"):
        return None  # rich reads the terminal's size or COLUMNS
    return WIDE_PIPE


def results(json_out: bool = False) -> Console:
    """The console of a command's results: stdout, or stderr when --json holds stdout."""
    stream = sys.stderr if json_out else sys.stdout
    return Console(file=stream, width=_width(stream.isatty()), highlight=False, soft_wrap=False)


def diagnostics() -> Console:
    """The console of warnings and progress: stderr."""
    return Console(stderr=True, width=_width(sys.stderr.isatty()), highlight=False)


def wrote(console: Console, path: object, detail: str = "", indent: str = "", path_style: str = "") -> None:
    """Print `{indent}wrote {path}{detail}` on one line: not wrapped at the console's width (soft wrap), and the
    path taken as text, not as rich markup, so a path of any length or with brackets appears whole."""
    console.print(Text.assemble(f"{indent}wrote ", (str(path), path_style), detail), soft_wrap=True)
