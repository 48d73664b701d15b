"""CLI commands: `flashflex data prepare` (text / .jsonl / .parquet files -> token file)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from .consoles import diagnostics, results, wrote

data_app = typer.Typer(help="Prepare training data (token files).", no_args_is_help=True)


@data_app.command("prepare")
def prepare_command(
    text_files: list[str] = typer.Argument(..., metavar="FILES...",
                                           help="Input files or glob patterns, in order: plain text .txt/.md/.rst "
                                           "(one document per file), .jsonl (one per line), .parquet (one per row)."),
    out: Path = typer.Option(..., "--out", "-o", help="Token file to write (e.g. data.bin)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer",
                                          help="A Hugging Face tokenizer.json; default: byte-level (vocab 256)."),
    field: str = typer.Option("text", "--field", help="The string field of each .jsonl line."),
    column: str = typer.Option("text", "--column", help="The string column of .parquet files."),
    eot: str | None = typer.Option(None, "--eot", help="End-of-text token between documents (default: the "
                                   "tokenizer's eos token; byte-level: a newline)."),
    append: bool = typer.Option(False, "--append", help="Add the tokens after those of an existing --out file."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Tokenize FILES into a memory-mappable token file for `flashflex launch --data`."""
    from ..data.prepare import prepare_files
    from ..fileio import check_writable_output, refuse_same_path

    check_writable_output(out)
    refuse_same_path(out, [*text_files, tokenizer])
    with progress_reporter(diagnostics()) as report:
        summary = prepare_files(text_files, out, tokenizer, field=field, column=column, append=append, eot=eot,
                                progress=report)
    result = {"out": str(out), "tokens": summary.tokens, "added_tokens": summary.added,
              "vocab_size": summary.vocab_size, "documents": summary.documents, "files": summary.files,
              "separator": summary.separator, "tokenizer": str(tokenizer) if tokenizer else "bytes"}
    if as_json:
        typer.echo(json.dumps(result))
    else:
        wrote(results(), out, f": {summary.tokens:,} tokens ({summary.documents:,} document(s) from "
                              f"{summary.files} file(s)), vocab {summary.vocab_size} ({result['tokenizer']} tokenizer)",
                  path_style="bold")


@contextmanager
def progress_reporter(console: Console) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar over input bytes on a terminal (stderr); nothing otherwise."""
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    with Progress("tokenizing", BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("tokenizing", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.add_typer(data_app, name="data")
