"""Plain-text launcher templates (`launchers/*.tmpl`) a user can copy and edit.

Syntax, chosen so that shell `$VARS` in a template need no escaping:
- `{{ name }}` is replaced by a value; an unknown name is an error naming the template and the line.
- Lines between `#>>> node` and `#<<< node` are repeated once per node, with that node's values
  (`node`, `index`, `nproc`, `is_host`, ...), and the two marker lines are dropped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import InputError

_FIELD = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_BLOCK = re.compile(r"^#>>> node[ \t]*\n(.*?)^#<<< node[ \t]*\n", re.S | re.M)


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
    if path.is_file():
        return path
    folder = launchers_dir()
    for candidate in (folder / name_or_path, *sorted(folder.glob(f"{name_or_path}.*.tmpl"))):
        if candidate.is_file():
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


def render(template: Path, values: Mapping[str, object], nodes: Sequence[Mapping[str, object]]) -> str:
    """Fill `template`: global `values`, and each `#>>> node` block once per entry of `nodes`."""
    try:
        text = template.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{template}: cannot read template: {exc.strerror}") from None
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
