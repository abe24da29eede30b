"""Where the ranks go: hydra's placement of N ranks over the hosts, and its one-line-per-host
summary printed before a launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .hosts import HostEntry

__all__ = ["format_topology", "oversubscribed", "plan_topology"]


def plan_topology(
    nprocs: int, hosts: Sequence[HostEntry], ppn: int | None = None, by_node: bool = False
) -> list[tuple[str, list[int]]]:
    """Where hydra places ``nprocs`` ranks: ``[(host, [ranks...]), ...]`` in host order.

    Hosts are visited round-robin; each visit takes ``ppn`` ranks if given, else the host's slots,
    else 1, until all ranks are placed (so more ranks than slots wrap around). A host listed
    twice is reported once. No hosts means one machine: ``[("localhost", [0..N-1])]``. The Open
    MPI command from :func:`build_command` places ranks the same way when they fit in the slots.

    ``by_node`` (:attr:`~.command.LaunchSpec.ranks_by_node`): Open MPI's ``--map-by node`` (one rank
    per visit), or with ``ppn`` its ``--map-by ppr:K:node --rank-by node`` (``ppn`` per host, then
    numbered round-robin over the hosts that have ranks left).
    """
    if not hosts:
        return [("localhost", list(range(nprocs)))]
    placed: dict[str, list[int]] = {e.name: [] for e in hosts}
    rank = 0
    while rank < nprocs:
        for entry in hosts:
            take = min(1 if by_node and not ppn else ppn or entry.slots or 1, nprocs - rank)
            placed[entry.name].extend(range(rank, rank + take))
            rank += take
            if rank == nprocs:
                break
    if by_node and ppn:
        counts = {name: len(ranks) for name, ranks in placed.items()}
        placed = {name: [] for name in placed}
        rank = 0
        while rank < nprocs:
            for name, ranks in placed.items():
                if len(ranks) < counts[name] and rank < nprocs:
                    ranks.append(rank)
                    rank += 1
    return list(placed.items())


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def format_topology(placement: Sequence[tuple[str, Sequence[int]]]) -> list[str]:
    """One line per host: ``"localhost: 2 ranks (0-1)"``."""
    lines = []
    for host, ranks in placement:
        count = len(ranks)
        noun = "rank" if count == 1 else "ranks"
        lines.append(f"{host}: {count} {noun}" + (f" ({_ranges(ranks)})" if ranks else ""))
    return lines


def oversubscribed(nprocs: int, hosts: Sequence[HostEntry], ppn: int | None, local_cpus: int) -> str | None:
    """Why the job puts more ranks on some host than Open MPI gives it slots, or ``None``.

    On one machine (no hosts) the slots are the CPUs (``local_cpus``). On hosts: with ``ppn``,
    ``ppn`` per host (``--map-by ppr:K:node``); else what :func:`~.command.build_command` writes,
    each host's explicit slots or ``ceil(nprocs / hosts)``.
    Hydra runs an oversubscribed job as it is (:func:`plan_topology` wraps around); Open MPI
    refuses it unless given ``--oversubscribe``.
    """
    if not hosts:
        return f"{nprocs} ranks on {local_cpus} CPUs" if nprocs > local_cpus else None
    if ppn:
        capacity = ppn * len(hosts)
    else:
        capacity = sum(e.slots or math.ceil(nprocs / len(hosts)) for e in hosts)
    return f"{nprocs} ranks on {capacity} slots" if nprocs > capacity else None
