"""Documents from the files people have: plain text (`.txt`, `.md`, `.markdown`, `.rst`, `.text`: one document per
file), `.jsonl` (one per line, a string field) and `.parquet` (one per row, a string column), named directly or
by glob patterns.

Each reader yields (text, bytes) pairs: a document and how many bytes of its file it advanced (for a
progress bar). A bad line or file is one InputError naming the file (and the line of a .jsonl).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import InputError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
_GLOB_CHARS = set("*?[")
PARQUET_BATCH_ROWS = 1024


def expand_inputs(patterns: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files named by `patterns`, in the order given: an existing path as is, otherwise a glob pattern
    (`**` recursive) expanded in sorted order. A pattern matching nothing, a missing file, a folder or an
    unsupported suffix is an InputError."""
    if not patterns:
        raise InputError("no input files given")
    files: list[Path] = []
    for pattern in patterns:
        text = os.fspath(pattern)
        if not os.path.lexists(text) and _GLOB_CHARS & set(text):
            matches = sorted(p for p in glob.glob(text, recursive=True) if os.path.isfile(p))
            if not matches:
                raise InputError(f"{text}: the pattern matches no file")
            files.extend(Path(p) for p in matches)
            continue
        path = Path(text)
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file" if not os.path.isdir(path) else
                             f"{path}: is a folder; name its files or a pattern like {path}/*.jsonl")
        files.append(path)
    for path in files:
        if path.suffix.lower() not in SUFFIXES:
            raise InputError(f"{path}: unsupported file type {path.suffix or '(none)'}; expected "
                             f"{', '.join(SUFFIXES)}")
    return files


def read_txt(path: Path) -> Iterator[tuple[str, int]]:
    """The whole UTF-8 file as one document."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        yield raw.decode("utf-8"), len(raw)
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file") from None


def read_jsonl(path: Path, field: str) -> Iterator[tuple[str, int]]:
    """The string `field` of every JSON object line (blank lines skipped)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below; lines are decoded one by one
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise InputError(f"{path}:{number}: not UTF-8") from None
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{number}: malformed JSON at column {exc.colno}: {exc.msg}") from None
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise InputError(f"{path}:{number}: no string field {field!r} (set it with --field)")
            yield value, len(raw)


def read_parquet(path: Path, column: str) -> Iterator[tuple[str, int]]:
    """The string `column` of every row (null values skipped), read in record batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        names = reader.schema_arrow.names
        if column not in names:
            raise InputError(f"{path}: no column {column!r} (columns: {', '.join(names)}; set it with --column)")
        kind = reader.schema_arrow.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _t: False)(kind)):
            raise InputError(f"{path}: column {column!r} holds {kind}, expected strings")
        rows = max(1, reader.metadata.num_rows)
        size = path.stat().st_size
        for batch in reader.iter_batches(columns=[column], batch_size=PARQUET_BATCH_ROWS):
            values = batch.column(0).to_pylist()
            share = size * len(values) // rows
            for k, value in enumerate(values):
                if value is not None:
                    yield value, share if k == len(values) - 1 else 0
    except InputError:
        raise
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (pa.ArrowException, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{path}: not a readable parquet file: {text}") from None


def read_documents(path: Path, field: str = "text", column: str = "text") -> Iterator[tuple[str, int]]:
    """(document, bytes advanced) of one input file, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path, field)
    if suffix == ".parquet":
        return read_parquet(path, column)
    return read_txt(path)
