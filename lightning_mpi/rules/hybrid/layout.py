"""Where each rank sits in the two levels: its replica (the ranks of a host, or a group the user
names), the communicators inside a replica and across replicas, and the pieces of the outer Δ it
carries.

A *replica* is the ranks that share a key (:func:`host_key`): by default the host's name, as
Lightning's ``MPIEnvironment`` and :class:`~lightning_mpi.strategies.environment.MPIClusterMixin`
split nodes; with ``group_size=k`` (or the environment override ``LIGHTNING_MPI_RANKS_PER_NODE=k``,
which also fakes nodes for ``Transport.node_split``) the launch ranks ``k·i … k·i + k − 1`` of
``MPI_COMM_WORLD``. Both keys belong to the process, not to its rank in the run: a heal that shrinks
the run renumbers the ranks but leaves every survivor in its replica.

The outer Δ of a fragment is cut into ``S`` pieces, ``S`` the largest replica's size. Member ``m``
of a replica of ``g`` ranks carries the pieces ``k`` with ``k mod g = m``: with replicas of one
size, rank ``i`` of every replica carries piece ``i``, so each rank sends ``1/g`` of its replica's
bytes over its own link; a replica that a heal shrank carries the lost member's pieces on the
members it has left. Piece ``k`` is averaged over the ranks that carry it, one per replica
(:attr:`Layout.cross`), and an Allgather inside the replica (:attr:`Layout.gather`) gives every
member the whole mean.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from lightning_mpi.comm.respawn import REPLACEMENT_ENV
from lightning_mpi.comm.transport import Transport

#: Pretend hosts of ``k`` consecutive launch ranks (tests on one machine); ``group_size`` wins.
RANKS_PER_NODE_ENV = "LIGHTNING_MPI_RANKS_PER_NODE"


def ranks_per_group(group_size: int | None) -> int | None:
    """``group_size``, else the environment override, else ``None`` (replicas by host name).

    Raises:
        ValueError: the override is not an integer ≥ 1.
    """
    if group_size is not None:
        return group_size
    value = os.environ.get(RANKS_PER_NODE_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RANKS_PER_NODE_ENV}={value!r} is out of range: it must be an integer >= 1")
    return int(value)


def host_key(group_size: int | None) -> str:
    """This process's replica key (module docstring): its launch rank's group, or its host name.

    A process spawned into a healed run (``heal="replace"``) has a launch rank of its own spawn, so
    with groups it gets a key of its own: it forms a replica of its own."""
    from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

    per_group = ranks_per_group(group_size)
    host = MPI.Get_processor_name()
    if per_group is None:
        return f"host {host}"
    if os.environ.get(REPLACEMENT_ENV):
        return f"spawned {host} {os.getpid()}"
    return f"group {MPI.COMM_WORLD.Get_rank() // per_group}"


def replica_table(keys: list[str]) -> list[int]:
    """The replica of every rank, from the ranks' keys in rank order: replicas numbered in the order
    their first rank appears."""
    order = list(dict.fromkeys(keys))
    return [order.index(key) for key in keys]


def pieces_of(member: int, size: int, pieces: int) -> list[int]:
    """The pieces that member ``member`` of a replica of ``size`` ranks carries out of ``pieces``."""
    return [k for k in range(pieces) if k % size == member]


@dataclass
class Layout:
    """This rank's place (module docstring). ``table[r]`` is the replica of rank ``r`` of the run."""

    table: list[int]
    rank: int
    inner: Transport
    gather: Transport
    cross: dict[int, Transport] = field(default_factory=dict)
    #: the communicators made for this layout (freed by :meth:`free`; none at world size 1)
    made: list[Transport] = field(default_factory=list)

    @property
    def replica(self) -> int:
        return self.table[self.rank]

    @property
    def replicas(self) -> int:
        """R, the number of replicas."""
        return len(set(self.table))

    @property
    def members(self) -> list[int]:
        """The run's ranks of this replica, in order."""
        return [r for r, replica in enumerate(self.table) if replica == self.replica]

    @property
    def member(self) -> int:
        return self.members.index(self.rank)

    @property
    def size(self) -> int:
        """g, the ranks of this replica."""
        return len(self.members)

    @property
    def pieces(self) -> int:
        """S, the pieces each fragment's Δ is cut into: the largest replica's size."""
        return max(Counter(self.table).values())

    @property
    def mine(self) -> list[int]:
        """The pieces this rank carries across replicas."""
        return pieces_of(self.member, self.size, self.pieces)

    def signature(self) -> tuple[int, ...]:
        """What decides whether a residual saved under one layout is this rank's under another."""
        return (self.rank, self.pieces, self.replicas, *self.table)

    def free(self) -> None:
        """Free the communicators made here (local)."""
        for transport in self.made:
            transport.free()
        self.made = []


def build_layout(world: Transport, group_size: int | None) -> Layout:
    """Split ``world`` into replicas and pieces (collective over ``world``: one Allgather of the
    keys, then one split for the replica and one per piece, and a duplicate of the replica's
    communicator for the outer Allgather, which may be in flight while the replica exchanges
    gradients)."""
    key = host_key(group_size)
    keys = world.allgather_object(key) if world.size > 1 else [key]
    table = replica_table(keys)
    if world.size == 1:
        return Layout(table, 0, world, world, {0: world})
    inner = world.split(table[world.rank])
    assert inner is not None
    gather = inner.dup() if inner.size > 1 else inner
    layout = Layout(table, world.rank, inner, gather, made=[inner] if gather is inner else [inner, gather])
    for piece in range(layout.pieces):
        carried = world.split(0 if piece in layout.mine else None)
        if carried is not None:
            layout.cross[piece] = carried
            layout.made.append(carried)
    return layout
