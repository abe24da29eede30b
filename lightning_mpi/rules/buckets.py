"""Gradient buckets of the every-step gradient-averaging rules: their options, and how the
synchronous rules average them (non-blocking, pipelined, overlapped with backward).

Gradients travel in buckets of whole tensors, in reverse model order (the last layers' gradients
are ready first in backward). :class:`Buckets` holds the options of that bucketing, so that
:class:`~lightning_mpi.rules.sync.SyncRule`, :class:`~lightning_mpi.rules.compressed.rule.CompressedSyncRule`
and :class:`~lightning_mpi.rules.powersgd.rule.PowerSGDRule` define them once
(:class:`SegmentedBuckets` adds the options of the pipelined ASA exchange).

A :class:`BucketExchanger` gives every bucket (and every pipelined segment of it) its own
communicator, starts each bucket's exchange (Allreduce or ASA with the rule's wire format,
optionally topology-aware) on a :class:`~lightning_mpi.comm.engine.ExchangeScheduler`, and runs
a :class:`~lightning_mpi.comm.progress.ProgressThread` while exchanges are in flight.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_mpi.comm.buffers import Bucket
from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.collectives import (
    ASAWorkspace,
    allreduce_mean_steps,
    asa_mean_steps,
    hierarchical_mean_steps,
    segments,
)
from lightning_mpi.comm.engine import Exchange, watched_scheduler
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import number, option, options_class
from lightning_mpi.rules.base import Rule

_POSITIVE = number(0, math.inf, low_open=True, high_open=True)


@options_class
class Buckets(Rule):
    """Options of the bucketed exchange (a base of the every-step rules, not a rule of its own)."""

    bucket_mb: float = option(
        default=25.0,
        doc="exchange bucket size in MiB (> 0); a bucket closes once it holds this much, so it ends on a "
        "whole tensor: smaller buckets start exchanging earlier in backward, larger ones pay less latency.",
        check=_POSITIVE,
    )
    first_bucket_mb: float = option(
        default=1.0,
        doc="size of the first bucket (the last layers' gradients) in MiB (> 0; at most `bucket_mb`): small, as "
        "in DDP, so that the link gets busy after the last layer or two of backward.",
        check=_POSITIVE,
    )
    overlap: bool = option(
        default=True,
        doc="start each bucket's exchange from the gradient hooks as soon as its gradients are ready, so it "
        "runs behind the rest of backward.",
    )

    def bucket_bytes(self) -> int:
        """:attr:`bucket_mb` in bytes (at least 1)."""
        return max(1, int(self.bucket_mb * 2**20))

    def first_bucket_bytes(self) -> int:
        """:attr:`first_bucket_mb` in bytes, at most :meth:`bucket_bytes` (at least 1)."""
        return max(1, int(min(self.first_bucket_mb, self.bucket_mb) * 2**20))


@options_class
class SegmentedBuckets(Buckets):
    """Bucket options of the ASA-based rules, whose buckets travel as a pipeline of segments."""

    segment_mb: float = option(
        default=4.0,
        doc="each bucket is exchanged as a pipeline of segments of this many MiB (> 0): one segment is cast and "
        "summed while the next is on the wire.",
        check=_POSITIVE,
    )
    progress_thread: bool = option(
        default=True,
        doc="with `overlap`, a light thread drives MPI progress while backward runs in torch kernels (MPICH "
        "moves data only inside MPI calls) and moves each exchange to its next phase.",
    )


class BucketExchanger:
    """Averages padded buckets over ranks, non-blocking, with scratch that is allocated once.

    ``start(bucket)`` launches a bucket's exchange (segmented for ASA) on the :class:`ExchangeScheduler`
    engine; ``poll()`` advances everything in flight; ``finish()`` waits for all of it.
    """

    def __init__(
        self,
        transport: Transport,
        exchange: str,
        wire: str,
        segment_mb: float,
        progress_thread: bool,
        topology_aware: bool,
    ) -> None:
        self.transport = transport
        self.exchange = exchange
        self.codec = get_codec(wire)
        self.segment_numel = max(1, int(segment_mb * 2**20) // 4)
        # The driver polls only while exchanges are in flight: started by start(), paused by finish().
        self.progress, self.driver = watched_scheduler(
            transport, progress_thread, "SyncRule(progress_thread=True)", ", or pass progress_thread=False"
        )
        self._workspaces: dict[tuple[int, int], ASAWorkspace] = {}
        self._slots: dict[int, tuple[Transport | None, list[Tensor], list[Transport]]] = {}  # by id(bucket)
        self.local: Transport | None = None
        self.leaders: Transport | None = None
        #: buckets are padded to a multiple of this: every team that cuts them into chunks must
        #: find whole chunks (all ranks; with topology, also the node leaders).
        self.pad_multiple = transport.size
        if topology_aware and transport.size > 1:
            self.local, self.leaders = transport.node_split()
            num_leaders = sum(transport.allgather_object(self.leaders is not None))
            self.pad_multiple = math.lcm(transport.size, num_leaders)
        self.seconds = 0.0
        self.wire_bytes = 0

    def _team(self) -> Transport | None:
        """Who takes part in the across-the-link exchange (None: this rank only shares in-node)."""
        return self.transport if self.local is None else self.leaders

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Give every bucket, and every pipelined segment of it, its own communicator.

        Must run on every rank with the same buckets in the same order (communicator creation is
        collective); after that, exchanges may start and finish in any order on each rank."""
        for bucket in buckets:
            local = self.local.dup() if self.local is not None else None
            team = self._team()
            team = team.dup() if team is not None else None
            # Both exchanges pipeline: MPICH moves one large Iallreduce in a few big serial
            # steps (send, then reduce), while several segment-sized ones keep the link busy and
            # reduce one segment while the next travels (2 hosts at 1 Gbit/s, 71 MB in 25 MB
            # buckets: 802 ms from the first start to the last finish instead of 1,039 ms).
            # Topology-aware buckets go in one piece: the leaders' result is scaled and broadcast
            # within the node as soon as their exchange returns, which must be the whole bucket,
            # not its first segment while later ones are still on the wire.
            if self.local is None:
                parts = segments(bucket.flat, self.pad_multiple, self.segment_numel)
            else:
                parts = [bucket.flat]
            teams = [team] + [team.dup() for _ in parts[1:]] if team is not None else []
            self._slots[id(bucket)] = (local, parts, teams)

    def wire_bytes_for(self, bucket: Bucket) -> int:
        """Bytes this rank sends across ranks for one exchange of ``bucket`` (bandwidth-optimal algorithms)."""
        team = self._team()
        world = team.size if team is not None else 1
        if world == 1:
            return 0
        elem = bucket.flat.element_size()
        if self.exchange == "allreduce":
            return int(2 * (world - 1) / world * bucket.flat.numel() * elem)
        chunk = bucket.flat.numel() // world
        words = self.codec.wire_numel(chunk) * torch.empty((), dtype=self.codec.wire_dtype).element_size()
        return 2 * (world - 1) * words  # Alltoall out + Allgather out

    def _segment_steps(self, team: Transport, segment: Tensor) -> Exchange:
        if self.exchange == "allreduce":
            return allreduce_mean_steps(team, segment)
        key = (segment.data_ptr(), segment.numel())
        work = self._workspaces.get(key)
        if work is None:
            work = ASAWorkspace.for_buffer(segment, team.size, self.codec)
            self._workspaces[key] = work
        return asa_mean_steps(team, segment, self.codec, work)

    def _team_steps(self, key: int, on_done: Callable[[], None] | None = None) -> Exchange:
        _, parts, teams = self._slots[key]
        # Later segments run as exchanges of their own, on their own communicators, so that
        # segment k+1 is cast and sent while segment k is on the wire or being summed. Whichever
        # segment finishes last calls ``on_done``.
        pending = [len(parts)]

        def counted(steps: Exchange) -> Exchange:
            yield from steps
            pending[0] -= 1
            if pending[0] == 0 and on_done is not None:
                on_done()

        for team, segment in zip(teams[1:], parts[1:], strict=True):  # one team per segment (prepare)
            self.progress.start(counted(self._segment_steps(team, segment)))
        yield from counted(self._segment_steps(teams[0], parts[0]))

    def _steps(self, bucket: Bucket, on_done: Callable[[Bucket], None] | None) -> Exchange:
        local, _, teams = self._slots[id(bucket)]
        if local is not None:
            leaders = teams[0] if teams else None

            def leader_exchange(_team: Transport, _flat: Tensor) -> Exchange:
                return self._team_steps(id(bucket))  # one part: see prepare

            yield from hierarchical_mean_steps(local, leaders, bucket.flat, self.transport.size, leader_exchange)
            if on_done is not None:
                on_done(bucket)
        else:
            yield from self._team_steps(id(bucket), (lambda: on_done(bucket)) if on_done is not None else None)

    def start(self, bucket: Bucket, on_done: Callable[[Bucket], None] | None = None) -> None:
        """Launch ``bucket``'s exchange; ``on_done(bucket)`` runs once all of it has arrived."""
        if self.transport.size == 1:
            return
        begin = time.perf_counter()
        if self.driver is not None:
            self.driver.start()
        self.progress.start(self._steps(bucket, on_done))
        self.wire_bytes += self.wire_bytes_for(bucket)
        self.seconds += time.perf_counter() - begin

    def poll(self) -> None:
        begin = time.perf_counter()
        self.progress.poll()
        self.seconds += time.perf_counter() - begin

    def finish(self, between: Callable[[], None] | None = None) -> None:
        """Wait for everything in flight; ``between()`` runs after each completed wait."""
        begin = time.perf_counter()
        self.progress.wait_all(between)
        if self.driver is not None:
            self.driver.pause()
        self.seconds += time.perf_counter() - begin

    def release(self, buckets: Sequence[Bucket]) -> None:
        """Free the communicators :meth:`prepare` made for ``buckets`` (collective, like prepare)."""
        self._free_slots([id(bucket) for bucket in buckets])

    def _free_slots(self, keys: Sequence[int]) -> None:
        """Free the slots' communicators and drop their segments' workspaces."""
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is None:
                continue
            local, parts, teams = slot
            for team in ([local] if local is not None else []) + teams:
                team.free()
            for part in parts:  # keyed by address, which a later bucket may reuse
                self._workspaces.pop((part.data_ptr(), part.numel()), None)

    def close(self) -> None:
        """Finish what is in flight, stop the progress thread, free every communicator made here.

        After a failed run (the transport was abandoned) nothing is waited for: the exchanges in
        flight are dropped, and the communicators are left to the next run."""
        if self.transport.abandoned:
            self.progress.abandon()
        else:
            self.finish()
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        self._free_slots(list(self._slots))
        for team in (self.local, self.leaders):
            if team is not None:
                team.free()
        self.local = self.leaders = None

    def __call__(self, bucket: Bucket) -> None:
        """Blocking exchange of one bucket."""
        self.start(bucket)
        self.finish()
