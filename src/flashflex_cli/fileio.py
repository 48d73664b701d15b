"""Atomic, deterministic file I/O shared by every command."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import stat
import sys
import tempfile
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ValidationError

from .errors import InputError
from .physical_limits import shown


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_usual_mode(path: str | os.PathLike[str], mode: int = 0o666) -> None:
    """Set `path`'s permissions to `mode` less the umask, as a plain `open` would have made them (for files that
    a library wrote through a private temporary file, 0600)."""
    os.chmod(path, mode & ~_umask())


NAME_MAX = 255  # bytes in one file name on the usual Linux file systems, when pathconf cannot say
_TEMP_STEM = 40  # characters of the target's name kept in its temporary file's name


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


def _stat(path: Path, what: str) -> os.stat_result | None:
    """os.stat of `path`, None when it does not exist; any other error is an InputError."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise InputError(f"{what} {path}: {_oserror_text(exc)}") from None


def _check_names(path: Path, what: str) -> None:
    """Every name in `path` fits the file system's name limit (checked before any stat)."""
    limit = _name_max(_existing_ancestor_plain(path))
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > limit:
            raise InputError(f"{what} {path}: file name too long ({size} bytes, at most {limit})")


def _existing_ancestor_plain(path: Path) -> Path:
    """The nearest existing folder above `path` by os.path.isdir (never raises), for pathconf."""
    current = path.parent
    while not os.path.isdir(current) and current != current.parent:
        current = current.parent
    return current


def _check_creatable(path: Path, what: str) -> None:
    """`path` does not exist: its nearest existing ancestor must be a writable folder."""
    anchor = path.parent
    while _stat(anchor, what) is None and anchor != anchor.parent:
        anchor = anchor.parent
    if not anchor.is_dir():
        raise InputError(f"{what} {path}: {anchor} is not a folder")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise InputError(f"{what} {path}: folder {anchor} is not writable")


def check_writable_output(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """Refuse an output file path that cannot be written, before any work: empty, a folder, not a regular
    file, under a file, in a folder that is not writable, or with a name too long. Returns the Path."""
    if os.fspath(path) in ("", "."):
        raise InputError(f"{what}: empty path, expected a file name")
    target = Path(path)
    _check_names(target, what)
    info = _stat(target, what)
    if info is None:
        _check_creatable(target, what)
    elif stat.S_ISDIR(info.st_mode):
        raise InputError(f"{what} {target}: is a folder, expected a file path")
    elif not stat.S_ISREG(info.st_mode):
        raise InputError(f"{what} {target}: exists and is not a regular file")
    elif not os.access(target.parent, os.W_OK | os.X_OK):
        raise InputError(f"{what} {target}: folder {target.parent} is not writable")
    return target


def check_writable_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse a folder path that cannot be created or written: empty, a file, under a file, not writable,
    or with a name too long. Returns the Path."""
    if not os.fspath(path):
        raise InputError(f"{what}: empty path, expected a folder")
    folder = Path(path)
    _check_names(folder, what)
    info = _stat(folder, what)
    if info is None:
        _check_creatable(folder, what)
    elif not stat.S_ISDIR(info.st_mode):
        raise InputError(f"{what} {folder}: is a file, expected a folder")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{what} {folder}: folder is not writable")
    return folder


def _same_path(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def refuse_same_path(out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None],
                     what: str = "--out") -> None:
    """Refuse an output path that is one of the inputs (it would be overwritten by its own result)."""
    target = Path(out)
    for source in inputs:
        if source is not None and _same_path(target, Path(source)):
            raise InputError(f"{what} {target} is also an input ({source}); write the output elsewhere")


def _oserror_text(exc: OSError) -> str:
    return exc.strerror or str(exc)


@contextmanager
def atomic_open(path: str | os.PathLike[str], binary: bool = False, mode: int = 0o666) -> Iterator[IO[Any]]:
    """A handle on a unique temporary file in `path`'s folder, renamed onto `path` when the block ends;
    the file gets permissions `mode` less the umask (0o777 for an executable script).

    An exception leaves `path` untouched and removes the temporary file; an OSError becomes one-line
    InputError naming the path and the cause ("cannot write /x/y: Is a directory").
    """
    target = check_writable_output(path, "cannot write")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:_TEMP_STEM]}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise InputError(f"cannot write {target}: {_oserror_text(exc)}") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            os.fchmod(handle.fileno(), mode & ~_umask())  # mkstemp makes 0600; give the usual mode
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"cannot write {target}: {_oserror_text(exc)}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o666) -> Path:
    """Write `text` to `path` via a unique temporary file in the same folder and a rename.

    A crash or an exception never leaves a half-written file at `path`. A trailing newline is added.
    """
    if not text.endswith("\n"):
        text += "\n"
    with atomic_open(path, mode=mode) as handle:
        handle.write(text)
    return Path(path)


def dumps_json(data: Any) -> str:
    """Stable JSON: 2-space indent, keys in the order the model defines them, newline at the end."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def write_model(path: str | os.PathLike[str], model: BaseModel) -> Path:
    """Write a pydantic model as stable JSON, atomically."""
    return atomic_write_text(path, dumps_json(model.model_dump(mode="json", exclude_none=True)))


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a missing or malformed file raises InputError with a one-line message."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{source}: is a folder, expected a JSON file") from None
    except UnicodeDecodeError:
        raise InputError(f"{source}: not a UTF-8 text file") from None
    except OSError as exc:
        raise InputError(f"{source}: cannot read: {_oserror_text(exc)}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError:  # an integer literal longer than Python's int-conversion limit (4300 digits)
        raise InputError(f"{source}: holds a number of more than {sys.get_int_max_str_digits()} digits") from None


# Custom pydantic error types whose messages show the refused value already: a physical limit (physical_limits.py),
# a run setting (run_config.py) and a plan's predicted figure (plan/predicted.py).
SHOWS_VALUE = ("physical_limit", "setting", "prediction")


def validation_problem(exc: ValidationError) -> tuple[str, str]:
    """The first problem of a pydantic ValidationError as (the field's dotted path, what is wrong with it, the
    value given and how many more problems there are). A validator of a whole object may name the field it
    refuses in its error's context ("field")."""
    first = exc.errors()[0]
    where, problem = _error_problem(first)
    more = len(exc.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return where, f"{problem}{suffix}"


def _error_problem(error: Any) -> tuple[str, str]:
    """One pydantic error as (the field's dotted path, what is wrong with it and the value given)."""
    parts = [str(part) for part in error["loc"]]
    named = (error.get("ctx") or {}).get("field")
    where = ".".join([*parts, named] if named else parts)
    return where, f"{str(error['msg']).removeprefix('Value error, ')}{_given(error)}"


# ---- settings: pydantic dataclasses refused in the project's words -------------------------------------------
#
# The run configuration (run_config.py, semantics/runtime_paths.RuntimeOptions) is made of pydantic dataclasses
# with strict JSON types. `setting_problem` words a refused value as the project always has: the type a field
# takes in plain words ("must be a whole number, got 1.5", "must be true or false or null", "must be one of auto,
# fused, foreach"), "is no setting (known: ...)", "is missing", "must be an object"; a range check's own message
# (a custom error) as it is.

# pydantic error types of a value of the wrong JSON type: worded by the field's type (`type_text`)
_TYPE_ERRORS = frozenset({
    "int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "bool_type", "bool_parsing",
    "string_type", "literal_error", "enum", "tuple_type", "list_type", "too_short", "too_long", "none_required",
    "is_instance_of"})
_UNKNOWN_KEY = frozenset({"extra_forbidden", "unexpected_keyword_argument", "unexpected_positional_argument"})
_MISSING = frozenset({"missing", "missing_argument", "missing_keyword_only_argument", "missing_positional_only_argument"})
_NOT_AN_OBJECT = frozenset({"dataclass_type", "dataclass_exact_type", "dataclass_args_type", "model_type", "dict_type"})


def type_text(hint: Any) -> str:
    """What a value of type `hint` is called in an error ("a number", "true or false", ...)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return f"one of {', '.join(str(a) for a in args)}"
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list, each {type_text(args[0]).removeprefix('a ')}"
    if origin is tuple:
        return f"a list of {len(args)} {type_text(args[0]).removeprefix('a ')}s"
    if dataclasses.is_dataclass(hint):
        return "an object"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            type(None): "null"}[hint]


def _error_rank(error: Any) -> int:
    """The order the problems of one value are reported in: unknown keys, missing ones, wrong types, the rest."""
    kind = error["type"]
    return 0 if kind in _UNKNOWN_KEY else 1 if kind in _MISSING else 2 if kind in _TYPE_ERRORS | _NOT_AN_OBJECT else 3


def _part(value: Any, name: str) -> Any:
    """Item or attribute `name` of `value` (None when it has none)."""
    if isinstance(value, dict):
        return value.get(name)
    if isinstance(value, list | tuple) and name.isdigit():
        return value[int(name)] if int(name) < len(value) else None
    return getattr(value, name, None)


def setting_problem(cls: type, values: dict[str, Any], exc: ValidationError) -> tuple[str, str]:
    """The first problem of `exc`, raised building the settings dataclass `cls` from `values`, as (the field's
    dotted path, what is wrong with it, in the project's words)."""
    error = sorted(exc.errors(), key=_error_rank)[0]
    kind, loc = error["type"], [str(part) for part in error["loc"]]
    hint: Any = cls
    value: Any = values
    where: list[str] = []
    for part in loc:  # down to the field the error is about; a fixed-length tuple is refused as a whole
        origin, args = get_origin(hint), get_args(hint)
        if dataclasses.is_dataclass(hint):
            hints = get_type_hints(hint)
            if part not in hints:
                break
            hint = hints[part]
        elif origin is tuple and len(args) == 2 and args[1] is Ellipsis and part.isdigit():
            hint = args[0]
        else:
            break
        value = _part(value, part)
        where.append(part)
    if len(where) < len(loc) and not dataclasses.is_dataclass(hint) and kind in _MISSING | _TYPE_ERRORS:
        kind = "tuple_type"  # an item of a fixed-length list missing or mistyped: the list is refused as a whole
    if kind in _UNKNOWN_KEY:
        parent = hint if dataclasses.is_dataclass(hint) else cls
        known = sorted(field.name for field in dataclasses.fields(parent))  # type: ignore[arg-type]
        return ".".join(loc), f"is no setting (known: {', '.join(known)})"
    if kind in _MISSING:
        return ".".join(loc), "is missing"
    if kind in _NOT_AN_OBJECT:
        return ".".join(where), f"must be an object, got {shown(value)}"
    if kind in _TYPE_ERRORS:
        return ".".join(where), f"must be {type_text(hint)}, got {shown(value)}"
    return _error_problem(error)


T = TypeVar("T")


def refused_in_one_line(error: Callable[[str, str], Exception]) -> Callable[[type[T]], type[T]]:
    """A class decorator for a pydantic dataclass: building it in code (`cls(...)`, dataclasses.replace) raises
    `error(field, problem)` (setting_problem's words) instead of pydantic's ValidationError. (Loading one from
    values goes through build_checked in run_config.py, which words its errors the same way.)"""

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__
        names = [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                values = {**dict(zip(names, args, strict=False)), **kwargs}
                raise error(*setting_problem(cls, values, exc)) from None

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate


def validation_message(source: str, exc: ValidationError) -> str:
    """Turn a pydantic ValidationError into one line naming the file, the field and the problem."""
    where, problem = validation_problem(exc)
    where = where or "(top level)"
    if problem.startswith(f"{where}."):  # a validator that names the nested field itself
        return f"{source}: {problem}"
    return f"{source}: {where}: {problem}"


def _given(error: Any) -> str:
    """', got VALUE' for an error about one scalar value whose message does not show it already."""
    value = error.get("input")
    if error["type"] in SHOWS_VALUE or not isinstance(value, str | int | float | bool):
        return ""
    return f", got {shown(value)}"


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
