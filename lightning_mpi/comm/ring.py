"""Allreduces over point-to-point messages (recursive doubling, or a ring: reduce-scatter, then
allgather), for jobs that heal.

Under Open MPI's fault tolerance (ULFM) a non-blocking collective (libnbc) that meets a dead peer
frees its pending sends at once (``ompi_request_is_failed`` marks them failed, ``NBC_Progress``
frees them), while the transport below may still hold them; when it later completes one (the
peer's connection closed, or a partitioned host came back), Open MPI aborts the process: "Send
error after request freed". That took a live rank of the healthy side of a partition with it (8
ranks on 4 simulated hosts: 2 runs of 8, at a heal or when the cut ended), and the run stopped
with too few ranks. Here every request stays this module's until it completes: an
exchange cut short by a failure keeps its requests for the life of the process
(:func:`~lightning_mpi.comm.resources.keep_pending`), so nothing is freed in flight.

The ring moves what a bandwidth-optimal allreduce moves (``2 (p - 1) / p`` of the buffer out of each
rank) in ``2 (p - 1)`` steps. Each chunk is reduced on one rank and then passed on unchanged, so
every rank ends with the same bytes. Short buffers go by recursive doubling instead
(:func:`doubling_allreduce_steps`, up to :data:`DOUBLING_BYTES`): each of the ring's steps waits
for a neighbour to be scheduled and for Python to post the next one, which made a job of 8 ranks
on 2 cores 20% slower with the ring alone (340 KB of gradients a step).
:meth:`~lightning_mpi.comm.transport.Transport.iallreduce_` uses :func:`allreduce_steps` for host
buffers whenever the job runs with fault tolerance on.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.resources import keep_pending

#: Each allreduce on a communicator takes the next tag from here on (wrapping): the ranks start
#: their allreduces on one communicator in the same order (as MPI requires of collectives), so the
#: steps of two allreduces in flight at once never match each other's messages.
FIRST_TAG = 28_000  # above the rules' own tags (the ZeRO mirror's go up to 27_410)
TAGS = 4_000  # MPI guarantees tags up to 32767

#: Buffers up to this many bytes go by recursive doubling, longer ones round the ring.
DOUBLING_BYTES = 1 << 20

_REDUCE = {
    "sum": lambda mine, theirs: mine.add_(theirs),
    "prod": lambda mine, theirs: mine.mul_(theirs),
    "max": lambda mine, theirs: torch.maximum(mine, theirs, out=mine),
    "min": lambda mine, theirs: torch.minimum(mine, theirs, out=mine),
}


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """``size`` contiguous chunks of ``numel`` elements, as even as can be (the first ones one
    element longer; some empty when ``numel < size``)."""
    base, extra = divmod(numel, size)
    bounds, start = [], 0
    for i in range(size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _posted(requests: list[Any], *buffers: Any) -> Generator[Any, None, None]:
    """Yield each of ``requests`` to wait on, in order; an exchange dropped before the last one
    completed (a failure, or nobody drives it any more) keeps them and ``buffers`` for the life of
    the process: never freed in flight."""
    completed = False
    try:
        yield from requests
        completed = True
    finally:
        if not completed:
            keep_pending((requests, *buffers))


def ring_allreduce_steps(comm: Any, flat: Tensor, op: str, tag: int) -> Generator[Any, None, Tensor]:
    """Reduce the 1-D CPU tensor ``flat`` in place over ``comm`` with ``op`` ("sum", "prod",
    "max", "min"), yielding each request to wait on (receive, then send, per step); every rank
    calls it with the same ``numel``, dtype, ``op`` and ``tag``."""
    reduce = _REDUCE[op]
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return flat
    right, left = (rank + 1) % size, (rank - 1) % size
    bounds = chunk_bounds(flat.numel(), size)
    array = flat.numpy()
    longest = max(end - start for start, end in bounds)
    scratch = torch.empty(longest, dtype=flat.dtype)
    inbox = scratch.numpy()
    # reduce-scatter: after step s, chunk (rank - s - 1) holds s + 2 ranks' values here
    for step in range(size - 1):
        out_start, out_end = bounds[(rank - step) % size]
        in_start, in_end = bounds[(rank - step - 1) % size]
        n = in_end - in_start
        receive = comm.Irecv(inbox[:n], source=left, tag=tag)
        yield from _posted([receive, comm.Isend(array[out_start:out_end], dest=right, tag=tag)], array, inbox)
        reduce(flat[in_start:in_end], scratch[:n])
    # allgather: the reduced chunk (rank + 1) goes round unchanged
    for step in range(size - 1):
        out_start, out_end = bounds[(rank + 1 - step) % size]
        in_start, in_end = bounds[(rank - step) % size]
        receive = comm.Irecv(array[in_start:in_end], source=left, tag=tag)
        yield from _posted([receive, comm.Isend(array[out_start:out_end], dest=right, tag=tag)], array)
    return flat


def doubling_allreduce_steps(comm: Any, flat: Tensor, op: str, tag: int) -> Generator[Any, None, Tensor]:
    """As :func:`ring_allreduce_steps`, by recursive doubling: ``log2 p`` steps (two more when ``p``
    is not a power of two) that each move the whole buffer, for short buffers, where the ring's
    ``2 (p - 1)`` steps cost more in waiting than its bandwidth saves. Partners combine each other's
    values with the same commutative ``op``, so every rank ends with the same bytes."""
    reduce = _REDUCE[op]
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return flat
    power = 1 << (size.bit_length() - 1)  # the largest power of two up to size
    extra = size - power  # the first 2 * extra ranks pair up: the even one hands its values over
    array = flat.numpy()
    scratch = torch.empty_like(flat)
    inbox = scratch.numpy()
    if rank < 2 * extra and rank % 2 == 0:  # folded into rank + 1, and sent the result at the end
        yield from _posted([comm.Isend(array, dest=rank + 1, tag=tag)], array)
        yield from _posted([comm.Irecv(array, source=rank + 1, tag=tag)], array)
        return flat
    if rank < 2 * extra:
        yield from _posted([comm.Irecv(inbox, source=rank - 1, tag=tag)], inbox)
        reduce(flat, scratch)
    me = rank // 2 if rank < 2 * extra else rank - extra  # among the power-of-two ranks
    distance = 1
    while distance < power:
        partner = me ^ distance
        peer = partner * 2 + 1 if partner < extra else partner + extra
        receive = comm.Irecv(inbox, source=peer, tag=tag)
        yield from _posted([receive, comm.Isend(array, dest=peer, tag=tag)], array, inbox)
        reduce(flat, scratch)
        distance *= 2
    if rank < 2 * extra:
        yield from _posted([comm.Isend(array, dest=rank - 1, tag=tag)], array)
    return flat


def ring_tags() -> Generator[int, None, None]:
    """The tags one communicator's allreduces take in turn (:data:`FIRST_TAG` on)."""
    while True:
        yield from range(FIRST_TAG, FIRST_TAG + TAGS)


def allreduce_steps(comm: Any, flat: Tensor, op: str, tag: int) -> Generator[Any, None, Tensor]:
    """:func:`doubling_allreduce_steps` up to :data:`DOUBLING_BYTES`, else :func:`ring_allreduce_steps`."""
    if flat.numel() * flat.element_size() <= DOUBLING_BYTES:
        return (yield from doubling_allreduce_steps(comm, flat, op, tag))
    return (yield from ring_allreduce_steps(comm, flat, op, tag))
