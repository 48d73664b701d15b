"""Export a flashflex checkpoint (written under any plan) as a Hugging Face folder: config.json,
model.safetensors (or model-0000K-of-0000N.safetensors shards with model.safetensors.index.json) and the
tokenizer files when the run had a tokenizer.

Tensors are read by global name through runtime/checkpoint/dcp.py `load_full` (which reassembles TP shards from
any plan), one output shard at a time, so host memory peaks near one shard (--max-shard-size). The folder is
built in a temporary folder beside OUT_DIR, then renamed onto it: a failure leaves no partial OUT_DIR.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError
from ...fileio import atomic_write_text, dumps_json, give_usual_mode, read_json
from ...hf.byte_tokenizer import (
    BYTE_VOCAB,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    byte_tokenizer_config,
    byte_tokenizer_json,
)
from ...hf.config import HF_DTYPES, hf_config
from ...hf.files import CONFIG, INDEX, WEIGHTS
from ...hf.names import HEAD, to_hf
from ...model.spec import ModelSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD = "5GB"  # transformers' save_pretrained default
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, what: str = "--max-shard-size") -> int:
    """Bytes of "5GB", "500MB", "2GiB", "1000000" (B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise InputError(f"{what} {text!r}: expected a size like 5GB, 500MB or 2GiB")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if not 1 <= value < 2**62:
        raise InputError(f"{what} {text!r}: must be at least one byte")
    return int(value)


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote: the folder, its weight files, tensor count, weight bytes, and the files copied
    from the run's --init-from folder or --tokenizer (tokenizer, generation config)."""

    out: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    copied: tuple[str, ...]
    tokenizer_note: str = ""


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint step folder (holding manifest.json), a checkpoint root's newest complete one, or a run
    folder's (its config.json's checkpoint folder, else RUN/checkpoints)."""
    from ...semantics.run_folder import MANIFEST, is_run_folder, latest_checkpoint, run_checkpoint_dir

    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such checkpoint or run folder")
    if (folder / MANIFEST).is_file():
        return folder
    if is_run_folder(folder) and latest_checkpoint(folder) is None:
        root = run_checkpoint_dir(folder)
        if root is None:
            raise InputError(f"{folder}: a run folder without checkpoints (launched with --no-checkpoint?)")
        folder = root
    found = latest_checkpoint(folder)
    if found is None:
        raise InputError(f"{folder}: no complete flashflex checkpoint (a step-N folder with {MANIFEST})")
    return found


def _manifest_spec(step_dir: Path, manifest: dict[str, Any]) -> ModelSpec:
    from pydantic import ValidationError

    from ...fileio import validation_message

    try:
        return ModelSpec.model_validate(manifest.get("model"))
    except ValidationError as exc:
        raise InputError(validation_message(f"{step_dir}/manifest.json model", exc)) from None


def plan_shards(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of `names` whose `sizes` (bytes) sum to at most `max_bytes` (a tensor larger than
    the limit gets a file of its own), in order, as transformers' save_pretrained groups them."""
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        if current and used + sizes[name] > max_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    if current:
        groups.append(current)
    return groups


def _check_out(out: Path, sources: list[Path], overwrite: bool) -> None:
    """OUT_DIR is none of the inputs, not inside one and holds none (--overwrite would delete it), and is
    new, empty, or replaced with --overwrite."""
    from ...fileio import check_writable_dir

    check_writable_dir(out, "--hf")
    target = out.resolve()
    for source in sources:
        root = source.resolve()
        if target == root or root in target.parents or target in root.parents:
            raise InputError(f"--hf {out}: overlaps the checkpoint {source}; write the export elsewhere")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(f"--hf {out}: folder exists and is not empty (pass --overwrite to replace it)")


def _tokenizer_sources(manifest: dict[str, Any], tokenizer: Path | None) -> list[Path]:
    """Tokenizer files to copy: --tokenizer FILE, else those beside the run's --init-from checkpoint."""
    if tokenizer is not None:
        if not tokenizer.is_file():
            raise InputError(f"--tokenizer {tokenizer}: no such file")
        return [tokenizer]
    origin = manifest.get("init_from")
    if not isinstance(origin, str) or not Path(origin).is_dir():
        return []
    return [Path(origin) / name for name in TOKENIZER_FILES if (Path(origin) / name).is_file()]


def export_hf(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], max_shard_bytes: int,
              dtype: str = "fp32", tokenizer: str | os.PathLike[str] | None = None,
              overwrite: bool = False) -> ExportSummary:
    """Write the Hugging Face folder `out` from flashflex checkpoint `checkpoint` (a step folder or a root).

    dtype: "fp32" (the master weights, exact), "bf16" or "fp16" (rounded to nearest even by torch)."""
    from safetensors.torch import save_file

    from ...semantics.parameters import model_params
    from ...semantics.run_folder import read_manifest
    from .dcp import load_full

    if dtype not in TORCH_DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise InputError("--max-shard-size must be at least one byte")
    out_dir = Path(out)
    step_dir = resolve_checkpoint(checkpoint)
    _check_out(out_dir, [Path(checkpoint), step_dir], overwrite)
    manifest = read_manifest(step_dir)
    spec = _manifest_spec(step_dir, manifest)
    table = manifest.get("tensors") or {}
    # a tied model has no head tensor (transformers ties lm_head to the embedding on load)
    infos = [info for info in model_params(spec) if not (spec.tie_embeddings and info.name == HEAD)]
    for info in infos:
        if info.name not in table:
            raise InputError(f"{step_dir}: parameter {info.name} is missing from the checkpoint")
        if tuple(table[info.name].get("shape", ())) != info.shape:
            raise InputError(f"{step_dir}: parameter {info.name} has shape {table[info.name].get('shape')}, the "
                             f"model needs {list(info.shape)}")
    tokenizer_files = _tokenizer_sources(manifest, Path(tokenizer) if tokenizer else None)
    byte_level = not tokenizer_files and spec.vocab_size >= BYTE_VOCAB and _byte_level_data(manifest)
    item = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    sizes = {info.name: item * int(torch.Size(info.shape).numel()) for info in infos}
    groups = plan_shards([info.name for info in infos], sizes, max_shard_bytes)
    files = [WEIGHTS] if len(groups) == 1 else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                                                for k in range(len(groups))]
    seq_len = int((manifest.get("train") or {}).get("seq_len", 2048))

    tmp = out_dir.parent / f".{out_dir.name[:40]}.export-{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.mkdir(parents=True)
        weight_map: dict[str, str] = {}
        for file, names in zip(files, groups, strict=True):
            with warnings.catch_warnings():  # DCP warns that it loads in a single process, as intended here
                warnings.simplefilter("ignore")
                full = load_full(step_dir, names)
            tensors = {to_hf(name): full.pop(name).to(TORCH_DTYPES[dtype]).contiguous() for name in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            give_usual_mode(tmp / file)  # safetensors writes through a private (0600) temporary file
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write_text(tmp / INDEX, dumps_json(index))
        atomic_write_text(tmp / CONFIG, dumps_json(hf_config(spec, dtype, seq_len)))
        for source in tokenizer_files:
            shutil.copyfile(source, tmp / (source.name if tokenizer is None else "tokenizer.json"))
        if byte_level:
            atomic_write_text(tmp / TOKENIZER_FILE, byte_tokenizer_json())
            atomic_write_text(tmp / TOKENIZER_CONFIG, byte_tokenizer_config(seq_len))
        _replace_dir(tmp, out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(out_dir, tuple(files), len(infos), sum(sizes.values()),
                         tuple(p.name for p in tokenizer_files), _tokenizer_note(manifest, tokenizer_files, byte_level))


def _byte_level_data(manifest: dict[str, Any]) -> bool:
    """True when the run trained on a byte-level token file (`data prepare` without --tokenizer) that is still
    where the run read it."""
    from ...data.token_file import token_file_vocab

    data = manifest.get("data")
    return isinstance(data, str) and data != "synthetic" and token_file_vocab(data) == BYTE_VOCAB


def _tokenizer_note(manifest: dict[str, Any], copied: list[Path], byte_level: bool) -> str:
    """What the export's tokenizer is, in words for the summary line."""
    if copied:
        return f"copied {', '.join(p.name for p in copied)}"
    if byte_level:
        return "a byte-level tokenizer (token id = UTF-8 byte) as the run's data was prepared"
    if manifest.get("data") == "synthetic":
        return "no tokenizer (trained on synthetic tokens)"
    return ("no tokenizer: pass --tokenizer with the tokenizer.json that `flashflex data prepare --tokenizer` used "
            "(a byte-level run's data file was not found to tell)")


def _replace_dir(new: Path, target: Path) -> None:
    """Rename folder `new` onto `target`; an existing `target` is first moved aside, then removed."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name[:40]}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_hf_weights(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder in its stored dtype (tests and small models only: loads all)."""
    from safetensors.torch import load_file

    base = Path(folder)
    if (base / INDEX).is_file():
        files = sorted(set(read_json(base / INDEX)["weight_map"].values()))
    else:
        files = [WEIGHTS]
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(base / file)))
    return out


__all__ = ["DEFAULT_MAX_SHARD", "HF_DTYPES", "ExportSummary", "export_hf", "parse_size", "plan_shards",
           "read_hf_weights", "resolve_checkpoint"]
