"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under any other plan.

Layout of a checkpoint folder D:

    D/step-000010/          one complete checkpoint: DCP files (.metadata, __R_0.distcp) + manifest.json
    D/step-000010.tmp/      a save in progress (ignored by loads, removed by the next save)
    D/latest                the name of the newest complete checkpoint, replaced atomically

Each tensor shard is saved once, by the rank that owns it (the lowest rank holding that slice), under
the key "NAME@DIM:START:STOP" (a slice of dimension DIM of the full tensor NAME) or "NAME@full". DCP
accepts a different set of keys on every rank. A checkpoint saved under one plan loads under any other
(another TP degree, stage split or pipeline count) in two ways:

- `load_into` (resume): each rank names the slice of each tensor it holds and the tensor to fill; only the
  saved shards overlapping it are read, and of them only the overlap's bytes (a DCP LoadPlanner whose
  ReadItems name the saved key and the overlap's offsets, and a file reader that finds each saved tensor's
  raw data inside its torch.save record and preads the overlap's contiguous runs straight into the target, or
  through a staging buffer of at most STAGE_BYTES). Peak host memory: the rank's own tensors plus that buffer.
  Items it cannot address that way (a transformed record, a non-contiguous saved tensor, a dtype change) go
  through DCP's own read, which holds one whole saved shard at a time.
- `load_full` (export, tests): reads every shard of the requested names and reassembles full tensors.

A save goes to `step-N.tmp`, then is renamed to `step-N`, then `latest` is rewritten: a crash or an error (an
out-of-memory included) at any point leaves the previous checkpoint and pointer intact. A `step-N` saved
before (a run restarted without --resume) is swapped out only once the new one is complete. The two newest
checkpoints are kept. A save that fails for want of space or permission (`one_line_save_errors`) is one line
naming the folder and the OS error; one that a rank's out-of-memory stopped raises that rank's own error there
(runtime/device/oom.py reports it) and a peer error on the others.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ...errors import InputError, RuntimeFailure
from ...fileio import atomic_write_text, dumps_json
from ...semantics.run_folder import (
    CHECKPOINT_SCHEMA,
    LATEST,
    MANIFEST,
    STEP_DIR,
    latest_checkpoint,
    read_manifest,
    step_dir,
)
from ..device.oom import classify
from ..parallel.shards import ShardSpec

KEEP = 2


def shards_for(state: Mapping[str, torch.Tensor], specs: Iterable[Any], rank: int) -> dict[str, ShardSpec]:
    """The Shard of every key of an engine's `state_for_checkpoint()`: a parameter's own ShardSpec (name,
    full_shape, dim, start, stop, owner), the same for its "<name>.exp_avg" / "<name>.exp_avg_sq" moments and
    its "<name>.outer_momentum" and "<name>.outer_anchor" (low-communication training's outer state);
    any other key (the "step" scalar) is one whole tensor written by rank 0."""
    by_name = {spec.name: spec for spec in specs}
    out: dict[str, ShardSpec] = {}
    for key in state:
        base = by_name.get(key) or by_name.get(key.rsplit(".exp_avg", 1)[0]) \
            or by_name.get(key.removesuffix(".outer_momentum")) \
            or by_name.get(key.removesuffix(".outer_anchor"))  # runtime/parallel/outer_sync.py
        if base is None:
            out[key] = ShardSpec(key, tuple(state[key].shape), None, 0, 1, rank == 0)
        else:
            out[key] = ShardSpec(key, tuple(base.full_shape), base.dim, base.start, base.stop, base.owner)
    return out


class CheckpointWriteError(RuntimeFailure):
    """A checkpoint could not be written (a full, read-only or vanished folder); the previous one is intact."""


def _errors_within(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, the exceptions it was raised from, and those DCP gathered from every rank, depth first."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, dcp.api.CheckpointException):
            stack.extend(pair[0] for pair in item.failures.values())
        stack.extend(e for e in (item.__cause__, item.__context__) if e is not None)


PROBE_BYTES = 1 << 20


def probe_write(root: str | os.PathLike[str]) -> OSError | None:
    """The OSError that writing PROBE_BYTES into `root` raises (None: it can be written). torch's zip writer
    turns a short write (a full disk, a file-size limit) into "unexpected pos" without the OS error; this
    recovers it."""
    probe = Path(root) / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(bytes(PROBE_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return exc
    finally:
        with suppress(OSError):
            probe.unlink()
    return None


def _write_error(root: str | os.PathLike[str], error: OSError) -> CheckpointWriteError:
    where = f" ({error.filename})" if error.filename else ""
    return CheckpointWriteError(f"cannot write a checkpoint in {root}: {error.strerror or error}{where}")


def save_error(root: str | os.PathLike[str], exc: BaseException, rank: int | None = None) -> BaseException | None:
    """One-line replacement of a failed save's exception (None: keep it). In DCP's CheckpointException (a
    BaseException whose text holds a traceback per rank), an out-of-memory of this `rank` is that error itself,
    one of another rank a peer error naming it. Then an OSError inside it, or else the one a probe write into
    `root` raises, becomes a CheckpointWriteError naming `root` and the cause; a CheckpointException otherwise
    becomes a RuntimeError with its first rank's error."""
    if isinstance(exc, dcp.api.CheckpointException):
        for failed_rank, (error, *_) in sorted(exc.failures.items()):
            if isinstance(error, BaseException) and classify(error) is not None:
                if failed_rank == rank:
                    return error
                return RuntimeError(f"checkpoint save in {root} stopped: peer rank {failed_rank} ran out of "
                                    "memory")
    for inner in _errors_within(exc):
        if isinstance(inner, OSError):
            return _write_error(root, inner)
    if isinstance(exc, dcp.api.CheckpointException):
        probed = probe_write(root)
        if probed is not None:
            return _write_error(root, probed)
        first = next((pair[0] for pair in exc.failures.values()), None)
        text = str(first).strip().splitlines()[0] if first is not None and str(first).strip() else "unknown error"
        return RuntimeError(f"checkpoint save in {root} failed: {type(first).__name__}: {text}")
    return None


@contextmanager
def one_line_save_errors(root: str | os.PathLike[str]) -> Iterator[None]:
    """Around a `save`: its I/O errors become one line (see `save_error`), other errors pass through."""
    try:
        yield
    except (Exception, dcp.api.CheckpointException) as exc:
        replacement = save_error(root, exc, dist.get_rank() if dist.is_initialized() else None)
        if replacement is None:
            raise
        raise replacement from None


def save(root: str | os.PathLike[str], step: int, tensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec],
         manifest: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> Path:
    """Save this rank's owned shards (collective over `group`, default: the world). Returns the folder.

    tensors: local tensors by global name; shards: their place in the full tensors (same keys).
    manifest: extra fields for manifest.json (model, train, plan hash, ...), written by rank 0.
    """
    rank = dist.get_rank(group)
    newest = latest_checkpoint(root)
    if newest is not None and int(STEP_DIR.match(newest.name).group(1)) > step:  # type: ignore[union-attr]
        raise RuntimeFailure(f"checkpoint of step {step} not saved: {newest} is newer and `latest` never moves "
                             "back (start again with --overwrite)")
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        for stale in Path(root).glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier(group)
    state = {shards[name].key: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()
             if shards[name].owner}
    dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    entries = [(s.name, list(s.full_shape), s.dim, s.start, s.stop, str(tensors[name].dtype).removeprefix("torch."))
               for name, s in shards.items() if s.owner and name in tensors]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)
    if rank == 0:
        table: dict[str, dict[str, Any]] = {}
        for rank_entries in gathered:
            for name, shape, dim, start, stop, dtype in rank_entries:
                item = table.setdefault(name, {"shape": shape, "dtype": dtype, "shards": []})
                item["shards"].append([dim, start, stop])
        for item in table.values():
            item["shards"].sort(key=lambda s: (-1 if s[0] is None else s[0], s[1]))
        body = {"schema": CHECKPOINT_SCHEMA, "step": step, **manifest, "tensors": dict(sorted(table.items()))}
        atomic_write_text(tmp / MANIFEST, dumps_json(body))
        if final.exists():  # the same step saved before: keep it until the new one is in place
            replaced = final.with_name(final.name + ".replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
            os.replace(tmp, final)
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.replace(tmp, final)
        atomic_write_text(Path(root) / LATEST, final.name)
        complete = sorted(p for p in Path(root).glob("step-*") if STEP_DIR.match(p.name))
        for old in complete[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group)
    return final


def load_full(path: str | os.PathLike[str], names: Iterable[str],
              group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Full tensors of `names` (those present in the checkpoint) from checkpoint folder `path`.

    Collective over `group`: every rank calls it, each with its own names.
    """
    manifest = read_manifest(path)
    table: dict[str, Any] = manifest["tensors"]
    wanted = [name for name in dict.fromkeys(names) if name in table]
    state: dict[str, torch.Tensor] = {}
    plan: list[tuple[str, str, ShardSpec]] = []
    for name in wanted:
        shape = tuple(table[name]["shape"])
        for dim, start, stop in table[name]["shards"]:
            shard = ShardSpec(name, shape, dim, start, stop, True)
            local_shape = list(shape)
            if dim is not None:
                local_shape[dim] = stop - start
            state[shard.key] = torch.empty(local_shape, dtype=getattr(torch, table[name]["dtype"]))
            plan.append((name, shard.key, shard))
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    out: dict[str, torch.Tensor] = {}
    for name in wanted:
        shape = tuple(table[name]["shape"])
        parts = [(shard, state[key]) for n, key, shard in plan if n == name]
        if len(parts) == 1 and parts[0][0].dim is None:
            out[name] = parts[0][1]
            continue
        full = torch.empty(shape, dtype=parts[0][1].dtype)
        for shard, tensor in parts:
            full.narrow(shard.dim, shard.start, shard.stop - shard.start).copy_(tensor)  # type: ignore[arg-type]
        out[name] = full
    return out



def _cover(name: str, want: tuple[int, int], saved: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Pieces (start, stop, saved key) that tile [want) along one dimension, from saved intervals (start, stop,
    key); at each point the saved interval reaching furthest is used, so no piece is read twice."""
    pos, stop, out = want[0], want[1], []
    while pos < stop:
        around = [item for item in saved if item[0] <= pos < item[1]]
        if not around:
            raise InputError(f"checkpoint holds no saved shard of {name} covering index {pos}")
        best = max(around, key=lambda item: (item[1], -(item[1] - item[0])))
        out.append((pos, min(best[1], stop), best[2]))
        pos = out[-1][1]
    return out


def plan_reads(table: Mapping[str, Any], targets: Mapping[str, tuple[ShardSpec, torch.Tensor]],
               where: str) -> list[tuple[str, str, int | None, int, int, int]]:
    """For each target (key -> (its slice of the full tensor spec.name, tensor to fill)): the saved pieces to
    read, as (target key, saved key, dim, start, stop, offset in the saved shard) along `dim` (None: the whole
    tensor). `table`: the manifest's "tensors". Raises InputError naming `where` for a missing tensor, another
    shape, or slices the checkpoint does not cover; an `optional` target the checkpoint lacks gets no read."""
    reads: list[tuple[str, str, int | None, int, int, int]] = []
    for key, (spec, tensor) in targets.items():
        entry = table.get(spec.name)
        if entry is None and spec.optional:
            continue
        if entry is None:
            raise InputError(f"{where}: checkpoint has no tensor {spec.name}")
        shape = tuple(entry["shape"])
        if shape != tuple(spec.full_shape):
            raise InputError(f"{where}: {spec.name}: checkpoint shape {list(shape)}, model shape "
                             f"{list(spec.full_shape)}")
        local = list(shape)
        if spec.dim is not None:
            local[spec.dim] = spec.stop - spec.start
        if list(tensor.shape) != local:
            raise InputError(f"{spec.name}: target shape {list(tensor.shape)}, its slice has {local}")
        dims = {d for d, _, _ in entry["shards"] if d is not None} | ({spec.dim} - {None})
        if len(dims) > 1:
            raise InputError(f"{where}: {spec.name} is split along dimensions {sorted(dims)}; one is supported")
        if not dims:  # whole saved, whole wanted
            reads.append((key, ShardSpec(spec.name, shape, None, 0, 1, True).key, None, 0, 0, 0))
            continue
        dim = dims.pop()
        want = (spec.start, spec.stop) if spec.dim is not None else (0, shape[dim])
        saved = [(0, shape[dim], ShardSpec(spec.name, shape, None, 0, 1, True).key) if d is None
                 else (a, b, ShardSpec(spec.name, shape, d, a, b, True).key) for d, a, b in entry["shards"]]
        starts = {k: a for a, _, k in saved}
        for a, b, saved_key in _cover(spec.name, want, saved):
            reads.append((key, saved_key, dim, a - want[0], b - want[0], a - starts[saved_key]))
    return reads


class _SliceLoadPlanner(LoadPlanner):
    """Reads planned pieces of saved tensors straight into (slices of) the caller's tensors.

    pieces: (target key, saved key, dim, start, stop, offset in the saved shard); see `plan_reads`."""

    def __init__(self, pieces: list[tuple[str, str, int | None, int, int, int]]) -> None:
        self.pieces = pieces
        self.state: dict[str, torch.Tensor] = {}
        self.metadata: Metadata | None = None

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state, self.metadata = state_dict, metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for target, saved_key, dim, start, stop, offset in self.pieces:
            stored = self.metadata.state_dict_metadata.get(saved_key)
            if not isinstance(stored, TensorStorageMetadata) or len(stored.chunks) != 1:
                raise InputError(f"checkpoint entry {saved_key} is missing or not one saved tensor")
            chunk = stored.chunks[0]
            lengths = list(chunk.sizes)
            dest = [0] * len(lengths)
            source = [0] * len(lengths)
            if dim is not None:
                lengths[dim], dest[dim], source[dim] = stop - start, start, offset
            items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(target),
                                  dest_offsets=torch.Size(dest), storage_index=MetadataIndex(saved_key, chunk.offsets),
                                  storage_offsets=torch.Size(source), lengths=torch.Size(lengths)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise InputError(f"checkpoint entry {read_item.storage_index.fqn} is not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        out = self.state[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            if offset != 0 or length != out.shape[dim]:
                out = out.narrow(dim, offset, length)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the target: the data is already in place


STAGE_BYTES = 4 << 20  # staging buffer of _SliceReader for targets it cannot fill in place (bytes)


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[list[int], int]:
    """The region [offsets, offsets + lengths) of a row-major tensor of `shape` as contiguous runs: (first
    element of each run, in the region's row-major order; elements per run)."""
    n = len(shape)
    if n == 0:
        return [0], 1
    strides = [math.prod(shape[j + 1:]) for j in range(n)]
    k = n - 1
    while k > 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    base = offsets[k] * strides[k]
    starts = [base + sum((offsets[j] + i) * strides[j] for j, i in enumerate(idx))
              for idx in itertools.product(*(range(lengths[j]) for j in range(k)))]
    return starts, lengths[k] * strides[k]


def _pread_into(fd: int, buffer: memoryview, offset: int, where: str) -> None:
    """Fill `buffer` with the file's bytes from `offset`."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got <= 0:
            raise InputError(f"{where}: checkpoint file ends early (truncated?)")
        done += got


class _SliceReader(FileSystemReader):
    """DCP's file reader that reads only the bytes of each requested piece (see the module docstring)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        fallback: list[ReadItem] = []
        for relative, items in per_file.items():
            where = os.path.join(str(self.path), relative)
            with open(where, "rb") as stream:
                for item in items:
                    layout = self._layout(stream, item)
                    target = planner.resolve_tensor(item).detach()
                    if layout is None or layout[2] != target.dtype:
                        fallback.append(item)
                        continue
                    self._read_piece(stream.fileno(), layout, item, target, where)
                    planner.commit_tensor(item, target)
        if fallback:
            super().read_data(LoadPlan(fallback), planner).wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _layout(self, stream: Any, item: ReadItem) -> tuple[int, tuple[int, ...], torch.dtype] | None:
        """(byte offset in the file of the saved tensor's first element, its shape, dtype), or None when the
        record cannot be addressed directly. torch.load with map_location="meta" reads only the record's
        pickle and zip directory; the meta storage's `_checkpoint_offset` is its data's place in the record."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors or sys.byteorder != "little":
            return None
        meta = torch.load(self._slice_file(stream, info), map_location="meta", weights_only=True)
        if not isinstance(meta, torch.Tensor):
            return None
        offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if offset is None or not meta.is_contiguous():
            return None
        return info.offset + offset + meta.storage_offset() * meta.element_size(), tuple(meta.shape), meta.dtype

    @staticmethod
    def _read_piece(fd: int, layout: tuple[int, tuple[int, ...], torch.dtype], item: ReadItem,
                    target: torch.Tensor, where: str) -> None:
        """Read the piece `item` names into `target` (its shape), in place when `target` is a contiguous CPU
        tensor, else through a staging buffer of at most STAGE_BYTES (at least one row of dim 0)."""
        base, shape, dtype = layout
        size = torch.empty((), dtype=dtype).element_size()
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if not lengths:  # a 0-dim tensor: one element
            staged = torch.empty((), dtype=dtype)
            _pread_into(fd, _bytes_of(staged), base, where)
            target.copy_(staged)
            return
        rows, row_elems = lengths[0], math.prod(lengths[1:])
        in_place = target.device.type == "cpu" and target.is_contiguous()
        step = rows if in_place else max(1, STAGE_BYTES // max(1, row_elems * size))
        for first in range(0, rows, step):
            count = min(step, rows - first)
            part = target.narrow(0, first, count)
            dest = part if in_place else torch.empty((count, *lengths[1:]), dtype=dtype)
            if dest.numel():
                buffer = _bytes_of(dest)
                starts, run = _runs(shape, (offsets[0] + first, *offsets[1:]), (count, *lengths[1:]))
                for i, start in enumerate(starts):
                    _pread_into(fd, buffer[i * run * size:(i + 1) * run * size], base + start * size, where)
            if dest is not part:
                part.copy_(dest)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def load_into(path: str | os.PathLike[str], targets: Mapping[str, tuple[ShardSpec, torch.Tensor]],
              group: dist.ProcessGroup | None = None) -> None:
    """Fill every target tensor in place with its slice of the saved full tensor, whatever plan saved it.

    targets: key -> (ShardSpec naming the full tensor `spec.name` and the slice [start, stop) along `dim`
    (dim None: the whole tensor), tensor of that slice's shape, any device, the saved dtype or castable).
    Reads only the saved shards overlapping each slice (see the module docstring for peak memory). A target
    whose ShardSpec is `optional` and which the checkpoint lacks is left as it is.
    Collective over `group` (every rank calls it, each with its own targets).
    """
    table: dict[str, Any] = read_manifest(path)["tensors"]
    pieces = plan_reads(table, targets, str(path))
    read = {piece[0] for piece in pieces}
    dcp.load({key: tensor for key, (_, tensor) in targets.items() if key in read},
             storage_reader=_SliceReader(str(path)), planner=_SliceLoadPlanner(pieces), process_group=group)
