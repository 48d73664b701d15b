"""CLI commands: `flashflex data prepare` (text files -> token file)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

data_app = typer.Typer(help="Prepare training data (token files).", no_args_is_help=True)


@data_app.command("prepare")
def prepare_command(
    text_files: list[Path] = typer.Argument(..., help="UTF-8 text files, concatenated in the order given."),
    out: Path = typer.Option(..., "--out", "-o", help="Token file to write (e.g. data.bin)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer",
                                          help="A Hugging Face tokenizer.json; default: byte-level (vocab 256)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Tokenize TEXT_FILES into a memory-mappable token file for `flashflex launch --data`."""
    from ..fileio import check_writable_output, refuse_same_path
    from ..runtime.data import prepare

    check_writable_output(out)
    refuse_same_path(out, [*text_files, tokenizer])
    count, vocab = prepare([str(p) for p in text_files], out, tokenizer)
    summary = {"out": str(out), "tokens": count, "vocab_size": vocab,
               "tokenizer": str(tokenizer) if tokenizer else "bytes"}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        Console(stderr=True).print(f"wrote [bold]{out}[/]: {count:,} tokens, vocab {vocab} "
                                   f"({summary['tokenizer']} tokenizer)")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.add_typer(data_app, name="data")
