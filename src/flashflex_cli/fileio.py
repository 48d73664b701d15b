"""Atomic, deterministic file I/O shared by every command."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import InputError


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` via a temporary file in the same folder and a rename.

    A crash or an exception never leaves a half-written file at `path`. A trailing newline is added.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not text.endswith("\n"):
        text += "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def dumps_json(data: Any) -> str:
    """Stable JSON: 2-space indent, keys in the order the model defines them, newline at the end."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def write_model(path: str | os.PathLike[str], model: BaseModel) -> Path:
    """Write a pydantic model as stable JSON, atomically."""
    return atomic_write_text(path, dumps_json(model.model_dump(mode="json", exclude_none=True)))


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a missing or malformed file raises InputError with a one-line message."""
    source = Path(path)
    if not source.exists():
        raise InputError(f"{source}: no such file")
    if source.is_dir():
        raise InputError(f"{source}: is a folder, expected a JSON file")
    try:
        return json.loads(source.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise InputError(f"{source}: not a UTF-8 text file") from None


def validation_message(source: str, exc: ValidationError) -> str:
    """Turn a pydantic ValidationError into one line naming the file, the field and the problem."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = len(exc.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {where}: {first['msg']}{suffix}"


def load_model(path: str | os.PathLike[str], model_type: type[BaseModel], expected_schema: str) -> Any:
    """Load and validate a versioned JSON file (`"schema": expected_schema`) into `model_type`."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object at the top level")
    schema = data.get("schema")
    if schema != expected_schema:
        raise InputError(f"{path}: unknown schema {schema!r}, expected {expected_schema!r}")
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(str(path), exc)) from None
