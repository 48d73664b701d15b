"""Initial weights from a local Hugging Face checkpoint, each rank reading only the slices it holds.

`check_checkpoint(folder, spec)` runs in the launcher before any process starts (config, files, every tensor's
presence, shape and dtype; headers only). `SlicedLoader(folder, spec)` is what a rank passes to RankEngine as
`initial`: called with (ParamInfo, tp size, tp rank), it returns that rank's fp32 shard of the parameter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import InputError
from ..model.spec import ModelSpec
from .config import check_config
from .files import FLOAT_DTYPES, HFCheckpoint
from .names import HEAD, to_hf

if TYPE_CHECKING:
    from ..semantics.parameters import ParamInfo


def _source_name(checkpoint: HFCheckpoint, spec: ModelSpec, name: str) -> str:
    """The checkpoint tensor holding runtime parameter `name`: a tied model's head (if the runtime asks for
    one) reads the embedding, since tied Hugging Face checkpoints usually omit lm_head.weight."""
    hf = to_hf(name)
    if name == HEAD and spec.tie_embeddings and hf not in checkpoint.entries:
        return to_hf("embed")
    return hf


def check_checkpoint(folder: str | os.PathLike[str], spec: ModelSpec) -> HFCheckpoint:
    """`folder` is a Hugging Face checkpoint of `spec`: config fields equal, files readable, every runtime
    parameter present with its shape and a float dtype. One InputError naming the first problem."""
    from ..semantics.parameters import model_params

    check_config(folder, spec)
    checkpoint = HFCheckpoint(folder)
    for info in model_params(spec):
        source = _source_name(checkpoint, spec, info.name)
        entry = checkpoint.entry(source)
        if entry.shape != info.shape:
            raise InputError(f"{entry.file}: tensor {source} has shape {list(entry.shape)}, the model needs "
                             f"{list(info.shape)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise InputError(f"{entry.file}: tensor {source} has dtype {entry.dtype}, expected one of "
                             f"{', '.join(FLOAT_DTYPES)}")
    return checkpoint


class SlicedLoader:
    """Callable (info: runtime ParamInfo, tp: TP degree, tp_rank) -> fp32 local shard tensor of `info`
    (shape info.local_shape(tp, tp_rank)), read from the checkpoint by memory-mapped slicing."""

    def __init__(self, folder: str | os.PathLike[str], spec: ModelSpec) -> None:
        self.folder = Path(folder)
        self.spec = spec
        self.checkpoint = check_checkpoint(folder, spec)

    def __call__(self, info: ParamInfo, tp: int, tp_rank: int) -> torch.Tensor:
        source = _source_name(self.checkpoint, self.spec, info.name)
        start, stop = info.bounds(tp, tp_rank)
        dim = info.shard_dim if tp > 1 else None
        return self.checkpoint.read(source, dim, start, stop)
