"""Plain-text launcher templates (`launchers/*.tmpl`) a user can copy and edit.

Syntax, chosen so that shell `$VARS` in a template need no escaping:
- `{{ name }}` is replaced by a value; an unknown name is an error naming the template and the line.
- Lines between `#>>> node` and `#<<< node` are repeated once per node, with that node's values
  (`node`, `index`, `nproc`, `is_host`, ...), and the two marker lines are dropped.

Every value is already a shell word (quoted with `shlex.quote` where needed, see `shell_word`), so put
fields where a word goes, never inside quotes. Values of `#SBATCH` lines (`sbatch_word`) use a safe
character set instead, since sbatch parses those lines itself. No value may hold a control character
(a newline would start a line of its own), except the multi-line blocks in RAW_MULTILINE.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import InputError

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9._%+=@:/,\-]+$")
RAW_MULTILINE = frozenset({"sbatch_extra", "hetjob_separator"})
_FIELD = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_BLOCK = re.compile(r"^#>>> node[ \t]*\n(.*?)^#<<< node[ \t]*\n", re.S | re.M)


def plain_text(value: object, what: str) -> str:
    """`str(value)`, refused when it is empty or holds a control character (newline, tab, escape, ...)."""
    text = str(value)
    if not text:
        raise InputError(f"{what}: empty value")
    if _CONTROL.search(text):
        raise InputError(f"{what} {text!r}: control characters (newline, tab, ...) cannot go into a launch script")
    return text


def shell_word(value: object, what: str) -> str:
    """`value` as one shell word: checked by `plain_text`, then quoted with shlex.quote."""
    return shlex.quote(plain_text(value, what))


def shell_join(args: Sequence[object], what: str) -> str:
    """Several values as shell words joined by spaces."""
    return " ".join(shell_word(arg, what) for arg in args)


def sbatch_word(value: object, what: str) -> str:
    """A value for an `#SBATCH` line: letters, digits and `._%+=@:/,-` only (sbatch does its own parsing of
    quotes, `#` and spaces in those lines, so nothing else can be made safe there)."""
    text = plain_text(value, what)
    if not _SBATCH_SAFE.match(text):
        raise InputError(f"{what} {text!r}: an #SBATCH value may use only letters, digits and ._%+=@:/,-")
    return text


def launchers_dir() -> Path:
    """The folder of bundled templates: $FLASHFLEX_LAUNCHERS, else `launchers/` of the source checkout, else
    `flashflex_cli/launchers/` inside an installed package."""
    env = os.environ.get("FLASHFLEX_LAUNCHERS")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    checkout = here.parents[3] / "launchers"
    return checkout if checkout.is_dir() else here.parents[1] / "launchers"


def find_template(name_or_path: str) -> Path:
    """A template file by path, or by name in the bundled folder (`slurm` -> launchers/slurm.sbatch.tmpl)."""
    path = Path(name_or_path)
    if os.path.isfile(path):  # never raises, unlike Path.is_file on a name too long
        return path
    folder = launchers_dir()
    bundled = sorted(p for p in folder.glob("*.tmpl") if p.name.startswith(f"{name_or_path}."))
    for candidate in (folder / name_or_path, *bundled):
        if os.path.isfile(candidate):
            return candidate
    known = ", ".join(sorted(p.name for p in folder.glob("*.tmpl"))) or "none"
    raise InputError(f"no launcher template {name_or_path!r} (bundled in {folder}: {known})")


def _fill(text: str, values: Mapping[str, object], source: str, offset_line: int) -> str:
    def replace(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            line = offset_line + text.count("\n", 0, match.start()) + 1
            raise InputError(f"{source}:{line}: unknown template field {{{{ {key} }}}}; "
                             f"known: {', '.join(sorted(values))}")
        return str(values[key])

    return _FIELD.sub(replace, text)


def _check_values(values: Mapping[str, object]) -> None:
    """No value holds a control character, but for newlines in the RAW_MULTILINE blocks."""
    for key, value in values.items():
        text = str(value).replace("\n", "") if key in RAW_MULTILINE else str(value)
        if _CONTROL.search(text):
            raise InputError(f"template field {key} {str(value)!r}: control characters cannot go into a launch script")


def render(template: Path, values: Mapping[str, object], nodes: Sequence[Mapping[str, object]]) -> str:
    """Fill `template`: global `values`, and each `#>>> node` block once per entry of `nodes`."""
    for entry in (values, *nodes):
        _check_values(entry)
    try:
        text = template.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{template}: cannot read template: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"{template}: not a UTF-8 text file") from None
    out: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        head = text[position : match.start()]
        out.append(_fill(head, values, str(template), text.count("\n", 0, position)))
        block_line = text.count("\n", 0, match.start(1))
        for node_values in nodes:
            out.append(_fill(match.group(1), {**values, **node_values}, str(template), block_line))
        position = match.end()
    out.append(_fill(text[position:], values, str(template), text.count("\n", 0, position)))
    return "".join(out)
