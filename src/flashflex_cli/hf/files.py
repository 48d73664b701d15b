"""A local Hugging Face checkpoint folder: `config.json` plus `model.safetensors`, or shards listed in
`model.safetensors.index.json` ({"metadata": {...}, "weight_map": {tensor name: file name}}).

Opening reads only the safetensors headers (names, shapes, dtypes); `read` takes one slice of one tensor
through safetensors' memory-mapped slicing (`safe_open(...).get_slice`), so a rank touches only the bytes of
its own shard (a column slice touches each row's pages, one tensor at a time). Every problem (a missing or
corrupt file, an index naming a missing tensor) is one InputError naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError
from ..fileio import read_json

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors dtype names whose values convert to fp32 exactly (F64 rounds, accepted like any fp64 input)
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, full shape and safetensors dtype name ("F32", "BF16", ...)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def _safetensors_error(path: Path, exc: Exception) -> InputError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return InputError(f"{path}: not a readable safetensors file: {text}")


def _headers(path: Path) -> dict[str, TensorEntry]:
    """Name -> TensorEntry of every tensor in one safetensors file (header only)."""
    from safetensors import safe_open

    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            out = {}
            for name in handle.keys():
                view = handle.get_slice(name)
                out[name] = TensorEntry(path, tuple(int(n) for n in view.get_shape()), str(view.get_dtype()))
            return out
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # safetensors raises SafetensorError (an Exception) for a corrupt header
        raise _safetensors_error(path, exc) from None


def _index_files(folder: Path) -> dict[str, str]:
    """The index's weight map, every entry a plain file name in `folder`."""
    index = folder / INDEX
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{index}: expected an object with a non-empty \"weight_map\"")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or os.path.basename(file) != file or file in (".", ".."):
            raise InputError(f"{index}: weight_map[{name!r}] must be a file name in the same folder, got {file!r}")
    return weight_map


class HFCheckpoint:
    """The tensors of a local Hugging Face checkpoint folder (headers read on construction)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError(f"--init-from {self.folder}: no such folder")
        self.entries: dict[str, TensorEntry] = {}
        if (self.folder / INDEX).is_file():
            weight_map = _index_files(self.folder)
            headers = {file: _headers(self.folder / file) for file in sorted(set(weight_map.values()))}
            for name, file in weight_map.items():
                if name not in headers[file]:
                    raise InputError(f"{self.folder / INDEX}: tensor {name} is not in {file}")
                self.entries[name] = headers[file][name]
        elif (self.folder / WEIGHTS).is_file():
            self.entries = _headers(self.folder / WEIGHTS)
        else:
            raise InputError(f"{self.folder}: no {WEIGHTS} or {INDEX} (a Hugging Face safetensors checkpoint)")

    def entry(self, name: str) -> TensorEntry:
        """The entry of tensor `name`; InputError naming the folder when it is absent."""
        if name not in self.entries:
            raise InputError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        return self.entries[name]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor `name` as fp32: rows [start, stop) of dimension `dim` (0 or 1), or all of it (dim None)."""
        from safetensors import safe_open

        entry = self.entry(name)
        if entry.dtype not in FLOAT_DTYPES:
            raise InputError(f"{entry.file}: tensor {name} has dtype {entry.dtype}, expected a float type "
                             f"({', '.join(FLOAT_DTYPES)})")
        if dim not in (None, 0, 1):
            raise ValueError(f"slicing dimension {dim} is not supported")
        try:
            with safe_open(entry.file, framework="pt", device="cpu") as handle:
                view = handle.get_slice(name)
                part = view[:] if dim is None else view[start:stop] if dim == 0 else view[:, start:stop]
        except OSError as exc:
            raise InputError(f"{entry.file}: cannot read: {exc.strerror or exc}") from None
        except Exception as exc:  # SafetensorError: a file changed or truncated since its header was read
            raise _safetensors_error(entry.file, exc) from None
        return part.to(torch.float32)
