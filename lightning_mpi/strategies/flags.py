"""Lightning's ``devices=`` and ``num_nodes=`` flags, checked against what MPI started.

With an ``mpi_*`` strategy the launcher (``mpiexec -n 4``, ``srun``, ``lightning-mpi``) decides
how many ranks run and where; the strategy spawns nothing. The Trainer and Fabric still take
``devices=`` and ``num_nodes=`` and hand them to the strategy, and a user coming from ``ddp`` will
write them. A value that contradicts MPI used to be ignored without a word (``devices=4`` under
``mpiexec -n 2`` trained on 2 ranks and reported ``trainer.num_devices == 4``). The rules here
follow Lightning's own cluster environments (``SLURMEnvironment.validate_settings`` refuses a
``devices=`` that disagrees with ``--ntasks-per-node``):

- ``devices=`` means, as for ``ddp``, processes per node. A count that disagrees with MPI's
  ranks per node is refused with a ``ValueError`` naming the flag, what MPI started and the fix.
  ``"auto"`` (the default) cannot be told from the count it resolves to (1 on the CPU, every
  visible GPU), so that count is always accepted.
- ``num_nodes=`` must be 1 (the default) or MPI's number of nodes (hosts).
- Afterwards the strategy's device list holds the device of each rank on this host, so
  ``trainer.num_devices`` is the number of ranks on this host, and rank ``r`` keeps device
  ``devices[local_rank % len(devices)]`` as before.

Every decision uses numbers that are the same on every rank (world size, node count, the flag),
so every rank raises or none does: no rank is left waiting in a collective for one that stopped.

Pure functions of plain values; :func:`layout_of` reads them from the MPI cluster environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MPILayout:
    """Where MPI put the ranks: the same ``world_size`` and ``num_nodes`` on every rank."""

    world_size: int
    num_nodes: int
    ranks_on_this_node: int

    def describe(self) -> str:
        """``"MPI started 2 ranks on 1 node (2 on this host)"``."""
        ranks = "rank" if self.world_size == 1 else "ranks"
        nodes = "node" if self.num_nodes == 1 else "nodes"
        return (
            f"MPI started {self.world_size} {ranks} on {self.num_nodes} {nodes} "
            f"({self.ranks_on_this_node} on this host)"
        )


def layout_of(environment: Any) -> MPILayout:
    """The layout of ``environment``, an MPI cluster environment (``comm``, ``local_comm``, ``num_nodes``)."""
    return MPILayout(
        world_size=environment.comm.Get_size(),
        num_nodes=environment.num_nodes,
        ranks_on_this_node=environment.local_comm.Get_size(),
    )


#: The first half of every fix: where the number of ranks comes from.
_LAUNCHER = (
    "With an mpi_* strategy the launcher decides how many ranks run and where: choose them with "
    "`mpiexec -n N` (or `lightning-mpi -n N`, `srun`)"
)


def check_devices_flag(count: int, auto_count: int, layout: MPILayout) -> None:
    """Raise ``ValueError`` when ``devices=`` (resolved by Lightning to ``count`` devices per node)
    disagrees with MPI's ranks per node; ``auto_count`` is what ``devices="auto"`` resolves to."""
    if count == auto_count or count * layout.num_nodes == layout.world_size:
        return
    per_node = layout.world_size / layout.num_nodes
    hint = (
        f"set `devices={int(per_node)}`"
        if per_node.is_integer()
        else "the ranks are spread unevenly over the nodes, so no devices= value fits"
    )
    raise ValueError(
        f"You set `devices={count}` (processes per node, as for ddp), but {layout.describe()}. "
        f"{_LAUNCHER}, and leave `devices=` out or {hint}."
    )


def check_num_nodes_flag(num_nodes: int, layout: MPILayout) -> None:
    """Raise ``ValueError`` when ``num_nodes=`` is neither 1 (the default) nor MPI's node count."""
    if num_nodes in (1, layout.num_nodes):
        return
    raise ValueError(
        f"You set `num_nodes={num_nodes}`, but {layout.describe()}. "
        f"{_LAUNCHER} and its host list, and leave `num_nodes=` out or set `num_nodes={layout.num_nodes}`."
    )


class RankDevices(list):
    """A device list already checked and laid out one entry per local rank (so checking it again,
    as Fabric's ``setup_environment`` does, changes nothing)."""


def devices_of_local_ranks(devices: Sequence[Any], ranks_on_this_node: int) -> RankDevices:
    """The device of each rank on this host: local rank ``r`` gets ``devices[r % len(devices)]``."""
    return RankDevices(devices[rank % len(devices)] for rank in range(ranks_on_this_node))


def auto_device_count(accelerator: Any) -> int:
    """What ``devices="auto"`` resolves to on ``accelerator`` (a Lightning Accelerator, or None: 1)."""
    return int(accelerator.auto_device_count()) if accelerator is not None else 1


def checked_parallel_devices(devices: Sequence[Any] | None, accelerator: Any, environment: Any) -> list[Any] | None:
    """The strategy's ``parallel_devices`` once Lightning has filled them in from ``devices=``:
    checked against MPI (:func:`check_devices_flag`), then one entry per rank on this host.

    ``None`` or empty (before Lightning filled them in) is returned unchanged, and so is a list this
    function returned (called again, or a strategy instance given to a second Trainer).
    """
    if devices is None or isinstance(devices, RankDevices):
        return devices
    if not devices:
        return list(devices)
    layout = layout_of(environment)
    check_devices_flag(len(devices), auto_device_count(accelerator), layout)
    return devices_of_local_ranks(devices, layout.ranks_on_this_node)


def check_num_nodes(num_nodes: int, environment: Any) -> None:
    """:func:`check_num_nodes_flag` against ``environment``, an MPI cluster environment."""
    check_num_nodes_flag(num_nodes, layout_of(environment))
