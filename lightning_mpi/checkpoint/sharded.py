"""Sharded checkpoints: every rank writes its own optimizer shard at once; nothing is gathered.

A checkpoint is a directory::

    NAME/manifest.json                  what is where (written last, so its presence means complete)
    NAME/replicated.pt                  rank 0: the checkpoint dict with each shard replaced by a slot marker
    NAME/shard-00000-of-00004.pt ...    rank r: {slot: this rank's shard state} for every slot, and its
                                        share of the spread tensors

A **slot** is a place in the checkpoint dict that holds a shard state
(:mod:`lightning_mpi.rules.zero.state`): a top-level value (Fabric's ``{"optimizer": ...}``) or an
item of a top-level list (Lightning's ``checkpoint["optimizer_states"][i]``), named ``key`` or
``key/i``. Everything else is the same on every rank and rank 0 writes it, except the **spread**
tensors: tensors of a top-level mapping (Lightning's ``checkpoint["state_dict"]``) that the caller
names as equal on every rank (the parameters, which ZeRO's Allgather makes equal). Each is written
by one rank, the ranks' shares balanced by bytes, so that the slowest rank writes about
(weights + optimizer state) / W and not all the weights; ``replicated.pt`` holds a marker naming
the file and :func:`load_sharded` puts the tensor back.

:func:`save_sharded` builds the directory under a hidden name and renames it into place (see
:mod:`lightning_mpi.checkpoint.files`). :func:`load_sharded` gives the checkpoint dict back with
each slot holding a :class:`ShardFiles`: all shard states of the save, read lazily from
memory-mapped files, which a bound ZeRO rule loads at any world size.

Plain files, one per rank, were measured faster than one MPI-IO file here (``benchmarks/zero.py``):
``torch.save`` streams the tensors straight into the file, where MPI-IO needs the shard serialised
in memory first, and a node-local or parallel file system writes separate files in parallel anyway.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_mpi.checkpoint.files import make_staging_dir, publish_dir, remove_dir, resolve_dir, write_new_file
from lightning_mpi.rules.zero.state import is_shard_state

FORMAT = "lightning_mpi.sharded_checkpoint/2"
#: formats this version reads (/1: no spread tensors)
READABLE_FORMATS = ("lightning_mpi.sharded_checkpoint/1", FORMAT)
MANIFEST = "manifest.json"
REPLICATED = "replicated.pt"
SLOT_MARKER = "lightning_mpi.sharded_slot/1"
TENSOR_MARKER = "lightning_mpi.spread_tensor/1"
#: key of a shard file's share of the spread tensors: {"key/name": tensor}
SPREAD = "lightning_mpi.spread_tensors"


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def is_sharded_checkpoint(path: Any) -> bool:
    """True when ``path`` is a complete sharded checkpoint directory (or an interrupted save left
    the previous one aside, see :func:`~lightning_mpi.checkpoint.files.resolve_dir`)."""
    try:
        return resolve_dir(Path(path), _complete) is not None
    except OSError:
        return False


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def split_shards(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(replicated, shards)``: the checkpoint with every shard state replaced by a slot marker,
    and the shard states by slot name."""
    replicated: dict[str, Any] = {}
    shards: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if is_shard_state(value):
            shards[key] = value
            replicated[key] = {"format": SLOT_MARKER, "slot": key}
        elif isinstance(value, (list, tuple)) and any(is_shard_state(v) for v in value):
            items = []
            for i, item in enumerate(value):
                if is_shard_state(item):
                    shards[f"{key}/{i}"] = item
                    items.append({"format": SLOT_MARKER, "slot": f"{key}/{i}"})
                else:
                    items.append(item)
            replicated[key] = type(value)(items) if isinstance(value, tuple) else items
        else:
            replicated[key] = value
    return replicated, shards


def fill_slots(replicated: Mapping[str, Any], value_for: Any) -> dict[str, Any]:
    """The checkpoint with every slot marker replaced by ``value_for(slot_name)``."""

    def filled(value: Any) -> Any:
        if isinstance(value, Mapping) and value.get("format") == SLOT_MARKER:
            return value_for(value["slot"])
        return value

    out: dict[str, Any] = {}
    for key, value in replicated.items():
        if isinstance(value, (list, tuple)):
            items = [filled(v) for v in value]
            out[key] = type(value)(items) if isinstance(value, tuple) else items
        else:
            out[key] = filled(value)
    return out


def spread_tensors(
    replicated: Mapping[str, Any], spread: Collection[str], world: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(replicated, shares)``: ``replicated`` with each tensor named in ``spread`` (``"key/name"``:
    item ``name`` of the top-level mapping ``key``) replaced by a marker naming the rank that writes
    it, and each rank's share ``{"key/name": tensor}``. Largest first, each to the rank with the
    fewest bytes so far: the same choice on every rank, which all pass the same tensors."""
    out = dict(replicated)
    shares: list[dict[str, Any]] = [{} for _ in range(world)]
    if not spread:
        return out, shares
    loads = [0] * world
    for key, value in replicated.items():
        if not isinstance(value, Mapping):
            continue
        names = [n for n, t in value.items() if isinstance(n, str) and f"{key}/{n}" in spread and torch.is_tensor(t)]
        if not names:
            continue
        mapping = value.copy() if hasattr(value, "copy") else dict(value)  # an OrderedDict stays one
        for name in sorted(names, key=lambda n: -value[n].numel() * value[n].element_size()):
            owner = min(range(world), key=loads.__getitem__)
            loads[owner] += value[name].numel() * value[name].element_size()
            shares[owner][f"{key}/{name}"] = value[name]
            mapping[name] = {"format": TENSOR_MARKER, "rank": owner, "address": f"{key}/{name}"}
        out[key] = mapping
    return out, shares


def _unspread(checkpoint: dict[str, Any], read: Any) -> None:
    """Put the spread tensors back in place of their markers; ``read(rank)`` is that rank's file."""
    for key, value in checkpoint.items():
        if isinstance(value, Mapping) and any(_is_tensor_marker(v) for v in value.values()):
            mapping = value.copy() if hasattr(value, "copy") else dict(value)
            for name, item in value.items():
                if _is_tensor_marker(item):
                    mapping[name] = read(item["rank"])[SPREAD][item["address"]]
            checkpoint[key] = mapping


def _is_tensor_marker(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("format") == TENSOR_MARKER


def save_sharded(directory: Any, checkpoint: Mapping[str, Any], transport: Any, spread: Collection[str] = ()) -> None:
    """Write ``checkpoint`` as a sharded checkpoint directory; collective over ``transport``.

    Every rank passes its own checkpoint dict: its shard states in their slots, everything else the
    same as on rank 0 (which writes it). ``spread``: the tensors (``"key/name"``, see the module
    docstring) that are equal on every rank and that the ranks share the writing of; the same on
    every rank. All ranks write at once; the directory appears complete
    at ``directory`` (replacing an earlier one) or not at all, and every rank returns once it is in
    place. A failure on any rank raises on every rank (``RuntimeError`` naming it) and leaves no
    partial directory. Needs a file system that every rank sees at ``directory``.
    """
    target = Path(directory)
    rank, world = transport.rank, transport.size
    made: tuple[bool, str] | None = None
    if rank == 0:
        try:
            made = (True, str(make_staging_dir(target)))
        except OSError as exc:
            made = (False, f"rank 0 could not create a directory beside {target}: {exc}")
    if world > 1:
        made = transport.broadcast_object(made)
    assert made is not None
    if not made[0]:
        raise RuntimeError(f"lightning_mpi: sharded checkpoint not saved: {made[1]}")
    staging = Path(made[1])
    replicated, shards = split_shards(checkpoint)
    replicated, shares = spread_tensors(replicated, spread, world)
    sizes: dict[str, int] = {}
    failure = None
    try:
        name = shard_file(rank, world)
        content = {**shards, SPREAD: shares[rank]} if spread else shards
        sizes[name] = write_new_file(staging / name, lambda f: torch.save(content, f))
        if rank == 0:
            sizes[REPLICATED] = write_new_file(staging / REPLICATED, lambda f: torch.save(replicated, f))
    except Exception as exc:  # noqa: BLE001  reported to every rank below, then raised everywhere
        failure = f"{type(exc).__name__}: {exc}"
    reports = (
        transport.allgather_object((failure, sizes, sorted(shards)))
        if world > 1
        else [(failure, sizes, sorted(shards))]
    )
    failed = [(r, f) for r, (f, _, _) in enumerate(reports) if f is not None]
    slots = reports[0][2]
    if not failed and any(s != slots for _, _, s in reports):
        failed = [(0, f"ranks hold shard states in different slots: {[s for _, _, s in reports]}")]
    outcome = None
    if rank == 0:
        if failed:
            remove_dir(staging)
        else:
            try:
                manifest = {
                    "format": FORMAT,
                    "world_size": world,
                    "replicated": REPLICATED,
                    "shards": [shard_file(r, world) for r in range(world)],
                    "slots": slots,
                    "bytes": {k: v for _, s, _ in reports for k, v in s.items()},
                    "torch": torch.__version__,
                }
                write_new_file(staging / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
                publish_dir(staging, target)
            except Exception as exc:  # noqa: BLE001
                remove_dir(staging)
                outcome = f"rank 0 could not publish {target}: {type(exc).__name__}: {exc}"
    if world > 1:
        outcome = transport.broadcast_object(outcome)
    if failed:
        raise RuntimeError(
            "lightning_mpi: sharded checkpoint not saved: " + "; ".join(f"rank {r}: {f}" for r, f in failed)
        )
    if outcome is not None:
        raise RuntimeError(f"lightning_mpi: sharded checkpoint not saved: {outcome}")


def read_manifest(directory: Any) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory actually to read (see :func:`is_sharded_checkpoint`) and its manifest."""
    path = resolve_dir(Path(directory), _complete)
    if path is None:
        raise FileNotFoundError(f"{directory} is not a sharded checkpoint (no {MANIFEST} in it)")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{path / MANIFEST} has format {manifest.get('format')!r}, expected one of {READABLE_FORMATS}")
    return path, manifest


class ShardFiles(Sequence):
    """The shard states of one slot, one per saving rank, each read on first access.

    Files are memory-mapped (``torch.load(mmap=True)``): a rank that takes only some elements
    of each shard (resharding) reads only those pages. Files are shared between the slots of one
    load."""

    def __init__(self, directory: Path, names: Sequence[str], slot: str, cache: dict[str, Any]) -> None:
        self.directory, self.names, self.slot, self._cache = directory, list(names), slot, cache

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _read_file(self.directory, self.names[index], self._cache)[self.slot]


def _read_file(directory: Path, name: str, cache: dict[str, Any]) -> Any:
    if name not in cache:
        cache[name] = torch.load(directory / name, map_location="cpu", mmap=True, weights_only=True)
    return cache[name]


def load_sharded(directory: Any, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dict, with a :class:`ShardFiles` in every slot (no collective).

    ``weights_only`` applies to the replicated part (a Lightning checkpoint may hold objects of
    the user's classes in ``hyper_parameters``); shard files only ever hold tensors and numbers."""
    path, manifest = read_manifest(directory)
    replicated = torch.load(path / manifest["replicated"], map_location="cpu", weights_only=weights_only)
    cache: dict[str, Any] = {}
    checkpoint = fill_slots(replicated, lambda slot: ShardFiles(path, manifest["shards"], slot, cache))
    _unspread(checkpoint, lambda rank: _read_file(path, manifest["shards"][rank], cache))
    return checkpoint
