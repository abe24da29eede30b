"""The sharded optimizer state's format, and its conversions from and to torch's own format.

A rank's **shard state** (what :meth:`~lightning_mpi.rules.zero.rule.BoundZeroRule.optimizer_state`
returns and a sharded checkpoint stores per rank) is a plain dict of tensors, numbers and lists, so
``torch.load(weights_only=True)`` reads it::

    {"format": SHARD_FORMAT, "world_size": W, "rank": r,
     "param_groups": [...],            # torch's format: hyperparameters + "params": parameter indices
     "param_shapes": [[...], ...],     # shape of every parameter, by index
     "pieces": [[index, start, length], ...],
     "state": [{key: value}, ...]}     # one dict per piece

Parameter indices number the parameters of the user's optimizer group by group, as torch's
``Optimizer.state_dict()`` does, so ``param_groups`` is exactly what the unsharded optimizer would
save. A piece's per-element state (momentum, Adam's moments, ...) is a 1-D tensor of ``length``
values: elements ``[start, start + length)`` of the flattened full tensor. Its per-parameter
scalars (:data:`SCALAR_KEYS`: Adam's ``step``, ASGD's ``eta``/``mu``, NAdam's ``mu_product``) are the
same in every piece of a parameter, since every piece steps together. Keys that start with ``_``
belong to lightning_mpi (``_master``: the fp32 master weights of a piece) and are not optimizer
state.

Shards of any world size together cover every element of every stepped parameter once, so they
can be assembled into torch's format (:func:`consolidate`) or cut again for another layout
(:func:`gather_range`): resharding needs no world-size-specific code.

A save may hold several *copies* of one optimizer, each sharded over its own ranks: ``mpi_hybrid``
with ZeRO inside its replicas, whose replicas step apart between their outer exchanges. Each shard
then also says which copy it belongs to, ``"copy": c`` (0 where absent), and its ``world_size`` and
``rank`` are within its copy; :func:`copies` sorts the shards of a save by copy. Copy 0 is the one
whose shards include the run's rank 0: what a one-process (or ``ddp``) save would hold, so
:func:`consolidate` and a loader that needs one copy take it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

SHARD_FORMAT = "lightning_mpi.zero_shard/1"

#: state entries that hold one value per parameter, not one per element
SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def is_shard_state(obj: Any) -> bool:
    """True for a shard state dict (see the module docstring)."""
    return isinstance(obj, Mapping) and obj.get("format") == SHARD_FORMAT


def is_elementwise(key: str, value: Any) -> bool:
    """True when state entry ``key`` holds one value per element (a tensor not in :data:`SCALAR_KEYS`)."""
    return isinstance(value, Tensor) and key not in SCALAR_KEYS


def _to_place(key: str, value: Any, like: Tensor | None) -> Any:
    """Put a loaded state value where torch's ``Optimizer.load_state_dict`` would: floating
    per-element state on the piece's device and dtype, ``step`` left as saved (torch keeps it on the
    CPU unless the optimizer is capturable or fused; the optimizer moves it itself then)."""
    if not isinstance(value, Tensor):
        return value
    if like is None or key == "step":
        return value.clone()
    if value.is_floating_point() and key not in SCALAR_KEYS:
        return value.to(device=like.device, dtype=like.dtype, copy=True)
    return value.to(device=like.device, copy=True)


def slice_param_state(state: Mapping[str, Any], start: int, length: int, like: Tensor | None = None) -> dict[str, Any]:
    """The state of elements ``[start, start + length)`` of a parameter, from its full state.

    Per-element tensors (any shape: they are flattened) are sliced; scalars are copied. ``like``:
    the piece tensor, whose device and dtype the result takes.
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        if is_elementwise(key, value):
            flat = value.reshape(-1)
            if flat.numel() < start + length:
                raise ValueError(
                    f"optimizer state {key!r} holds {flat.numel()} values, but elements [{start}, {start + length}) "
                    "were asked for: the checkpoint was written for another model"
                )
            value = flat[start : start + length]
        out[key] = _to_place(key, value, like)
    return out


Source = tuple[int, int, Mapping[str, Any]]  # (start, length, piece state) of one saved piece


def gather_range(
    sources: Sequence[Source], start: int, length: int, like: Tensor | None = None, what: str = "parameter"
) -> dict[str, Any]:
    """The state of elements ``[start, start + length)`` of one parameter, from saved pieces of it.

    ``sources`` are pieces of the same parameter from a layout of any world size; the ones that
    overlap the range are cut and joined in order. Raises ``ValueError`` when they leave part of
    the range uncovered or disagree on the state's keys.
    """
    overlapping = sorted((s for s in sources if s[0] < start + length and s[0] + s[1] > start), key=lambda s: s[0])
    if not overlapping:
        return {}  # never stepped (no state saved for it)
    # lightning_mpi's own ``_`` entries (master weights) exist only where a bucket keeps them: kept
    # when every overlapping piece has them, else left out (the loader takes them from the weights)
    keys = {k for k in overlapping[0][2] if not k.startswith("_")}
    private = set.intersection(*({k for k in s[2] if k.startswith("_")} for s in overlapping))
    parts: dict[str, list[Tensor]] = {
        k: [] for k, v in overlapping[0][2].items() if is_elementwise(k, v) and (k in keys or k in private)
    }
    cursor = start
    for piece_start, piece_length, state in overlapping:
        if {k for k in state if not k.startswith("_")} != keys:
            raise ValueError(f"saved pieces of {what} disagree on their state keys: {sorted(keys)} vs {sorted(state)}")
        if piece_start > cursor:
            break
        lo, hi = cursor - piece_start, min(piece_length, start + length - piece_start)
        for key in parts:
            parts[key].append(state[key][lo:hi])
        cursor = piece_start + hi
    if cursor != start + length:
        raise ValueError(
            f"the saved optimizer state of {what} covers elements only up to {cursor}, "
            f"not [{start}, {start + length}): "
            "a shard file is missing or belongs to another checkpoint"
        )
    out: dict[str, Any] = {}
    for key, value in overlapping[0][2].items():
        if key.startswith("_") and key not in private:
            continue
        joined = (parts[key][0] if len(parts[key]) == 1 else torch.cat(parts[key])) if key in parts else value
        out[key] = _to_place(key, joined, like)
    return out


def index_sources(shards: Sequence[Mapping[str, Any]]) -> dict[int, list[Source]]:
    """Saved pieces of every parameter index, over all shards (checks their format)."""
    by_param: dict[int, list[Source]] = {}
    for shard in shards:
        if not is_shard_state(shard):
            raise ValueError(
                f"not a lightning_mpi shard state (format {shard.get('format')!r}, expected {SHARD_FORMAT!r})"
            )
        for (index, start, length), state in zip(shard["pieces"], shard["state"], strict=True):
            by_param.setdefault(int(index), []).append((int(start), int(length), state))
    return by_param


def check_shard_set(shards: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` unless ``shards`` are all ``world_size`` shards of one save, one per rank."""
    if not shards:
        raise ValueError("no shard states given")
    world = int(shards[0]["world_size"])
    ranks = sorted(int(s["rank"]) for s in shards)
    if ranks != list(range(world)) or any(int(s["world_size"]) != world for s in shards):
        raise ValueError(f"expected the shard states of ranks 0..{world - 1} of one save, got ranks {ranks}")


def copies(shards: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The shard states of one save, by the copy of the optimizer each belongs to (module docstring),
    in copy order; a save of one copy is one list."""
    by_copy: dict[int, list[Mapping[str, Any]]] = {}
    for shard in shards:
        by_copy.setdefault(int(shard.get("copy", 0)), []).append(shard)
    return [by_copy[copy] for copy in sorted(by_copy)]


def consolidate(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """All shards of one save as one optimizer state in torch's format (``Optimizer.state_dict()``);
    of a save of several copies, copy 0 (the run's rank 0's: module docstring).

    Every stepped parameter's per-element state is assembled to its full shape; scalars come from
    its first piece; ``_``-keys (lightning_mpi's own, such as master weights) are left out.
    """
    shards = copies(shards)[0] if shards else shards
    check_shard_set(shards)
    shapes = [tuple(s) for s in shards[0]["param_shapes"]]
    by_param = index_sources(shards)
    state: dict[int, dict[str, Any]] = {}
    for index, sources in sorted(by_param.items()):
        numel = _numel(shapes[index])
        gathered = gather_range(sources, 0, numel, what=f"parameter {index}")
        entry = {}
        for key, value in gathered.items():
            if key.startswith("_"):
                continue
            entry[key] = value.reshape(shapes[index]) if is_elementwise(key, value) else value
        state[index] = entry
    groups = [dict(group, params=list(group["params"])) for group in shards[0]["param_groups"]]
    return {"state": state, "param_groups": groups}


def state_numel(shard: Mapping[str, Any], elementwise_only: bool = True) -> int:
    """Elements of optimizer state a shard holds (per-element entries; ``_``-keys left out)."""
    return sum(
        v.numel()
        for state in shard["state"]
        for k, v in state.items()
        if isinstance(v, Tensor) and not k.startswith("_") and (is_elementwise(k, v) or not elementwise_only)
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
