"""How a parameter-server rule's center θ̃ is rebuilt after a heal (``heal="shrink"``).

The center is sharded over every rank's ``Win.Allocate`` window (:mod:`.base`): old rank
r of W hosts elements ``[r·n/W, (r+1)·n/W)`` of the padded flat center. When ranks die, their
shards die with them; the survivors rebuild the whole center, every one of them the same, and
bind the rule again over themselves with the shards cut anew for the new world size:

1. **What each survivor keeps** (:meth:`~.base.BoundServerRule.heal_state`, read on the
   survivor alone): its own shard of the center as its window holds it when the failed run is
   released, i.e. after every survivor agreed on the healed communicator, so no survivor's commit
   is still running (read from the window's memory, which no live rank writes any more); the
   center as it last pulled it (``ref``, a whole copy) with the server clock at that pull
   (``clock_at_pull``); the clock itself if it hosted it (old rank 0); its counters and weights.
2. **A surviving shard** is taken as its host kept it: every commit that reached it is in it.
3. **A lost shard** is taken from the freshest copy of it that a survivor holds: the slice of the
   ``ref`` of the survivor with the highest ``clock_at_pull`` (it pulled after the most commits),
   ties broken by the lowest old rank (:func:`freshest`): a choice every survivor makes alike from
   the same gathered numbers. **Lost**: every commit to that shard after that pull (by the lost
   rank and by the others), and the lost rank's own work since its last commit.
4. **The clock** restarts at the old clock where its host survived, else at the highest
   ``clock_at_pull`` (:func:`healed_clock`); each survivor keeps its own ``clock_at_pull``, so
   staleness stays a count of commits it did not see.
5. **Re-cut**: the rebuilt center (:func:`rebuild_center`, unpadded) is padded for the new world
   size and each survivor hosts its new shard of it (:func:`~lightning_mpi.comm.window.shard_bounds`).
6. **The workers** keep their own weights and their ``ref`` (laid out anew), so their next commit
   carries every local step since their last one. A survivor whose commit (or elastic exchange)
   was interrupted by the loss restarts from the rebuilt center instead (weights and ``ref``; EAMSGD
   momentum zeroed), as a dropped commit does: the shards that commit had reached keep it, the
   others never get it (each element is whole either way), and it is not sent again, so nothing
   is counted twice.

:func:`gather_and_rebuild` runs steps 3 to 5 over the survivors' transport (two
``allgather_object``: the clocks, then one shard each and the lost slices from their chosen
survivor: one center's worth of data in all). The rest is pure and tested alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.transport import Transport


def freshest(pulls: Mapping[int, int], lost: Iterable[int]) -> dict[int, int]:
    """For each lost old rank, the survivor (its old rank) whose copy of that shard is rebuilt
    from: the highest ``clock_at_pull`` in ``pulls`` (old rank -> clock at its last pull), ties
    to the lowest old rank. Every survivor computes the same answer from the same numbers."""
    if not pulls:
        raise ValueError("lightning_mpi: no survivor to rebuild the center from")
    best = min(pulls, key=lambda rank: (-int(pulls[rank]), rank))
    return {rank: best for rank in sorted(set(lost))}


def healed_clock(pulls: Mapping[int, int], hosted: Iterable[int]) -> int:
    """The server clock after a heal: the old clock where its host survived (``hosted``: the values
    that survivor read from its window), else the highest clock at a survivor's last pull."""
    return max([*map(int, hosted), *map(int, pulls.values())], default=0)


def rebuild_center(shards: Mapping[int, Tensor], pulled: Mapping[int, Tensor], old_world: int, numel: int) -> Tensor:
    """The whole center (``numel`` elements, unpadded) from the old ranks' shards: a survivor's own
    (``shards``, by old rank) or, for a lost one, the slice a survivor pulled (``pulled``, by the
    lost rank); every old rank's shard must come from exactly one of them."""
    parts = []
    for rank in range(old_world):
        if (rank in shards) == (rank in pulled):
            where = "both" if rank in shards else "neither"
            raise ValueError(f"lightning_mpi: shard {rank} of {old_world} is in {where} of the kept shards and pulls")
        parts.append((shards[rank] if rank in shards else pulled[rank]).reshape(-1))
    if len({part.numel() for part in parts}) != 1:
        raise ValueError(f"lightning_mpi: the {old_world} shards differ in size: {[p.numel() for p in parts]}")
    center = torch.cat(parts)
    if center.numel() < numel:
        raise ValueError(f"lightning_mpi: {center.numel()} elements rebuilt, fewer than the center's {numel}")
    return center[:numel].clone()


def joined_state(kept: Mapping[str, Any]) -> dict[str, Any]:
    """What a new rank (``heal="replace"``) takes from rank 0's :meth:`heal_state` at its let-in: no
    shard and no pull of its own (the survivors' shards are the whole center, re-cut over the grown
    run in :func:`gather_and_rebuild`; it starts from that center, zero momentum), rank 0's step
    count (it sets when commits happen) and no commits or skipped commits of its own."""
    return {
        "joined": True,
        "old_world": int(kept["old_world"]),
        "numel": int(kept["numel"]),
        "clock": None,
        "clock_at_pull": int(kept["clock_at_pull"]),
        "interrupted": False,
        "final_committed": bool(kept["final_committed"]),
        "steps": int(kept["steps"]),
        "commits": 0,
        "momentum": [torch.zeros_like(buf) for buf in kept.get("momentum", [])],
        "skipped_commits": 0,
    }


def padded(center: Tensor, length: int) -> Tensor:
    """``center`` (unpadded) laid out in a flat buffer of ``length`` (a world size's padding)."""
    out = torch.zeros(length, dtype=center.dtype)
    n = min(center.numel(), length)
    out[:n].copy_(center.reshape(-1)[:n])
    return out


def gather_and_rebuild(transport: Transport, kept: Mapping[str, Any]) -> dict[str, Any]:
    """Collective over the survivors' ``transport``: from each survivor's ``kept`` (its
    :meth:`~.base.BoundServerRule.heal_state`), the rebuilt center (unpadded), the clock,
    the lost old ranks and who each lost shard was taken from (module docstring)."""
    joined = bool(kept.get("joined"))  # a new rank (heal="replace"): no shard, no pull, nothing lost
    old_rank, old_world = (None if joined else int(kept["old_rank"])), int(kept["old_world"])
    mine = (old_rank, int(kept["clock_at_pull"]), kept["clock"])
    everyone = transport.allgather_object(mine) if transport.size > 1 else [mine]
    pulls = {rank: clock for rank, clock, _ in everyone if rank is not None}
    lost = sorted(set(range(old_world)) - set(pulls))
    chosen = freshest(pulls, lost)
    piece: dict[str, Any] = {"shard": None, "pulled": {}}
    if not joined:
        ref: Tensor = kept["ref"]
        size = ref.numel() // old_world
        piece = {
            "shard": kept["shard"],
            "pulled": {rank: ref[rank * size : (rank + 1) * size].clone() for rank in lost if chosen[rank] == old_rank},
        }
    pieces = transport.allgather_object(piece) if transport.size > 1 else [piece]
    shards = {rank: p["shard"] for (rank, _, _), p in zip(everyone, pieces, strict=True) if rank is not None}
    pulled = {lost_rank: slice_ for p in pieces for lost_rank, slice_ in p["pulled"].items()}
    center = rebuild_center(shards, pulled, old_world, int(kept["numel"]))
    clock = healed_clock(pulls, [hosted for _, _, hosted in everyone if hosted is not None])
    return {"center": center, "clock": clock, "lost": lost, "chosen": chosen, "pulls": pulls}
