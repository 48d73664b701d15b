"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under any other plan.

Layout of a checkpoint folder D:

    D/step-000010/          one complete checkpoint: DCP files (.metadata, __R_0.distcp) + manifest.json
    D/step-000010.tmp/      a save in progress (ignored by loads, removed by the next save)
    D/latest                the name of the newest complete checkpoint, replaced atomically

Each tensor shard is saved once, by the rank that owns it (the lowest rank holding that slice), under
the key "NAME@DIM:START:STOP" (a slice of dimension DIM of the full tensor NAME) or "NAME@full". DCP
accepts a different set of keys on every rank. Loading reads every shard of the requested names and
reassembles full tensors, so a checkpoint saved under one plan loads under any other (another TP
degree, stage split or pipeline count).

A save goes to `step-N.tmp`, then is renamed to `step-N`, then `latest` is rewritten: a crash at any
point leaves the previous checkpoint and pointer intact. The two newest checkpoints are kept. A save that
fails for want of space or permission (`one_line_save_errors`) is one line naming the folder and the OS error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import InputError, RuntimeFailure
from ..fileio import atomic_write_text, dumps_json
from .shards import ShardSpec

MANIFEST = "manifest.json"
LATEST = "latest"
SCHEMA = "flashflex.checkpoint/1"
KEEP = 2
_DIR = re.compile(r"^step-(\d{6,})$")


def shards_for(state: Mapping[str, torch.Tensor], specs: Iterable[Any], rank: int) -> dict[str, ShardSpec]:
    """The Shard of every key of an engine's `state_for_checkpoint()`: a parameter's own ShardSpec (name,
    full_shape, dim, start, stop, owner), the same for its "<name>.exp_avg" / "<name>.exp_avg_sq" moments;
    any other key (the "step" scalar) is one whole tensor written by rank 0."""
    by_name = {spec.name: spec for spec in specs}
    out: dict[str, ShardSpec] = {}
    for key in state:
        base = by_name.get(key) or by_name.get(key.rsplit(".exp_avg", 1)[0])
        if base is None:
            out[key] = ShardSpec(key, tuple(state[key].shape), None, 0, 1, rank == 0)
        else:
            out[key] = ShardSpec(key, tuple(base.full_shape), base.dim, base.start, base.stop, base.owner)
    return out


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The folder of the checkpoint taken after `step` optimizer steps."""
    return Path(root) / f"step-{step:06d}"


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under `root`: the one `latest` names, else the highest complete step."""
    folder = Path(root)
    pointer = folder / LATEST
    if pointer.is_file():
        candidate = folder / pointer.read_text(encoding="utf-8").strip()
        if (candidate / MANIFEST).is_file():
            return candidate
    complete = sorted((p for p in folder.glob("step-*") if _DIR.match(p.name) and (p / MANIFEST).is_file()),
                      key=lambda p: int(_DIR.match(p.name).group(1)))  # type: ignore[union-attr]
    return complete[-1] if complete else None


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of one checkpoint folder."""
    target = Path(path) / MANIFEST
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{target}: unreadable checkpoint manifest: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{target}: a checkpoint manifest must be a JSON object")
    if data.get("schema") != SCHEMA:
        raise InputError(f"{target}: unknown checkpoint schema {data.get('schema')!r}")
    return data


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


def save_error(root: str | os.PathLike[str], exc: BaseException) -> BaseException | None:
    """One-line replacement of a failed save's exception (None: keep it): an OSError inside it, or else the one
    a probe write into `root` raises, becomes a CheckpointWriteError naming `root` and the cause; DCP's
    CheckpointException (a BaseException whose text holds a traceback per rank) otherwise becomes a
    RuntimeError with its first rank's error."""
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
        replacement = save_error(root, exc)
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
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        for stale in Path(root).glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
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
        body = {"schema": SCHEMA, "step": step, **manifest, "tensors": dict(sorted(table.items()))}
        atomic_write_text(tmp / MANIFEST, dumps_json(body))
        os.replace(tmp, final)
        atomic_write_text(Path(root) / LATEST, final.name)
        complete = sorted(p for p in Path(root).glob("step-*") if _DIR.match(p.name))
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

