"""The "key=value,key=value" requests tests put in an environment variable to inject a failure into a run
(FLASHFLEX_OOM_INJECT: runtime/oom.py, FLASHFLEX_OVERFLOW_INJECT: runtime/loss_scale.py), parsed strictly: every
bad field is an InputError naming the variable and the field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import InputError


def parse_injection(env_name: str, text: str, keys: Sequence[str], required: Sequence[str],
                    choices: Mapping[str, Sequence[str]] | None = None) -> dict[str, int | str]:
    """The fields of `text` (comma-separated key=value), each key one of `keys`: a whole number >= 0, or for a key
    of `choices` one of its values (a string). Every key of `required` must be given."""
    choices = choices or {}
    fields: dict[str, int | str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in keys:
            raise InputError(f"{env_name}: {part!r} is not one of {', '.join(k + '=' for k in keys)}")
        if key in choices:
            if value not in choices[key]:
                raise InputError(f"{env_name}: {key} {value!r} is not one of {', '.join(choices[key])}")
            fields[key] = value
            continue
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"{env_name}: {key}={value!r} is not a whole number") from None
        if number < 0:
            raise InputError(f"{env_name}: {key}={value!r} is negative")
        fields[key] = number
    if any(key not in fields for key in required):
        raise InputError(f"{env_name}: {' and '.join(k + '=' for k in required)} are required, got {text!r}")
    return fields
