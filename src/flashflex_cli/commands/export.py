"""CLI command: `flashflex export RUN --hf OUT_DIR` (a run's newest flashflex checkpoint, or any checkpoint
folder, -> Hugging Face folder)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .consoles import results, wrote


def export_command(
    checkpoint: Path = typer.Argument(..., metavar="RUN",
                                      help="A run folder (its newest checkpoint), a checkpoint folder, or one "
                                      "step-N folder."),
    hf: Path = typer.Option(..., "--hf", help="Hugging Face folder to write (config.json, *.safetensors)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size",
                                       help="Largest weight file (e.g. 5GB, 500MB, 2GiB); above it the weights "
                                       "are sharded with model.safetensors.index.json."),
    dtype: str = typer.Option("fp32", "--dtype", help="Weight dtype: fp32 (exact master weights), bf16, fp16."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer.json to include (default: the "
                                          "tokenizer files of the run's --init-from folder, if any)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing, non-empty --hf folder."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Export a checkpoint written under any plan as a Hugging Face model folder that transformers loads."""
    from ..runtime.checkpoint.hf_export import export_hf, parse_size

    summary = export_hf(checkpoint, hf, parse_size(max_shard_size), dtype, tokenizer, overwrite)
    if as_json:
        typer.echo(json.dumps({"out": str(summary.out), "files": list(summary.files), "tensors": summary.tensors,
                               "bytes": summary.total_bytes, "copied": list(summary.copied)}))
        return
    tok = f", {summary.tokenizer_note}"
    wrote(results(), summary.out, f": {summary.tensors} tensors, {summary.total_bytes / 2**20:.1f} MiB in "
                                  f"{len(summary.files)} file(s){tok}")


def register(app: typer.Typer) -> None:
    """Add this module's command to the root app."""
    app.command("export")(export_command)
