"""When ZeRO's buckets are exchanged: in index order, from the gradient hooks or at the step, a few
at a time, with MPI progress driven while torch computes.

:class:`BucketSchedule` runs the exchanges of one ZeRO binding's buckets
(:class:`~lightning_mpi.rules.zero.bucket.ShardBucket`) on one communicator. The contract:

- **order**: non-blocking collectives must start in the same order on every rank, so buckets
  start strictly in index order: a gradient hook marks its buckets ready, and every ready bucket
  at the head of the line starts (:meth:`BucketSchedule.on_grads_ready`). Waiting for a staging
  slot cannot deadlock then: the rank that started the fewest buckets waits only for buckets every
  rank has started.
- **staging**: each exchange holds one slot of a :class:`~lightning_mpi.comm.shard_exchange.StagingPool`
  per (dtype, device), at most ``inflight_buckets`` at once; a bucket waits for a free one.
- **progress**: MPICH moves data only inside MPI calls, so the hooks poll, and with
  ``progress_thread`` a :class:`~lightning_mpi.comm.progress.ProgressThread` polls while torch
  computes (paused between steps).
- **the step**: :meth:`BucketSchedule.reduce_scatter_rest` starts every bucket not yet started,
  waits for all, and redoes (accumulating) every bucket when a gradient arrived after its bucket
  left (a second backward before the step); :meth:`BucketSchedule.gather` allgathers every
  bucket's stepped chunk.
- :meth:`BucketSchedule.close`: hooks removed, exchanges finished (or abandoned with a failed
  run), the thread stopped, the staging memory released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import Codec
from lightning_mpi.comm.engine import watched_scheduler
from lightning_mpi.comm.shard_exchange import Staging, StagingPool
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.zero.bucket import ShardBucket


class BucketSchedule:
    """The exchanges of one ZeRO binding's buckets (see the module docstring).

    Args:
        transport: the run's transport (its timeout, failure watch and size).
        buckets: the binding's buckets, in index order.
        codec: the wire format (the staging slots' size).
        inflight_buckets: staging slots per (dtype, device).
        progress_thread: drive MPI progress from a thread while torch computes.
        hooks_launch: whether a gradient hook may start exchanges now (not while the rule is
            paused, nor when the exchange must start at the step).
    """

    def __init__(
        self,
        transport: Transport,
        buckets: Sequence[ShardBucket],
        codec: Codec,
        inflight_buckets: int,
        progress_thread: bool,
        hooks_launch: Callable[[], bool],
    ) -> None:
        self._transport = transport
        self.buckets = buckets
        self._hooks_launch = hooks_launch
        self._pools: dict[tuple[torch.dtype, torch.device], StagingPool] = {}
        for b in buckets:
            key = (b.plan.dtype, b.plan.device)
            largest = max(x.plan.chunk for x in buckets if (x.plan.dtype, x.plan.device) == key)
            if key not in self._pools:
                self._pools[key] = StagingPool(transport.size, largest, codec, inflight_buckets, *key)
        self.progress, self.driver = watched_scheduler(
            transport, progress_thread, "ZeroRule(progress_thread=True)", ", or pass progress_thread=False"
        )
        #: buckets started from the gradient hooks (not at the step)
        self.hook_launches = 0
        self._next = 0  # buckets launch in index order: the next one to go
        self._replayed = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def hook_params(self, params: Sequence[Tensor], buckets_of: dict[int, list[int]]) -> None:
        """Start exchanges from the gradient hooks of ``params`` (``buckets_of``: the buckets each
        parameter has elements in)."""
        for param_index, buckets in buckets_of.items():
            hook = self._make_hook([self.buckets[b] for b in buckets])
            self._hooks.append(params[param_index].register_post_accumulate_grad_hook(hook))

    def _make_hook(self, buckets: list[ShardBucket]) -> Callable[[Tensor], None]:
        def on_grad_ready(_param: Tensor) -> None:
            if not self._hooks_launch():
                return
            if any(bucket.launched for bucket in buckets):
                self._replayed = True  # a second backward before the step: redone in before_step
                return
            for bucket in buckets:
                bucket.ready += 1
            self._launch_ready()
            self.progress.poll()  # MPICH moves data only inside MPI calls

        return on_grad_ready

    def _launch_ready(self) -> None:
        """Launch ready buckets in index order (see the module docstring)."""
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(
            self.buckets[self._next].members
        ):
            self._launch(self.buckets[self._next], accumulate=False)
            self.hook_launches += 1
            self._next += 1

    def _slot(self, bucket: ShardBucket) -> tuple[Staging, StagingPool]:
        pool = self._pools[(bucket.plan.dtype, bucket.plan.device)]
        slot = pool.acquire()
        while slot is None:
            self.progress.wait_for(pool.has_free)
            slot = pool.acquire()
        return slot, pool

    def _launch(self, bucket: ShardBucket, accumulate: bool) -> None:
        slot, pool = self._slot(bucket)
        if self.driver is not None:
            self.driver.start()
        bucket.launched = True
        self.progress.start(bucket.reduce_steps(slot, accumulate, pool.release))

    def _finish(self) -> None:
        self.progress.wait_all()
        if self.driver is not None:
            self.driver.pause()

    def reduce_scatter_rest(self) -> None:
        """At the step: reduce-scatter every bucket not yet launched, wait for all (and redo late
        gradients), and make every bucket ready for the next backward."""
        for bucket in self.buckets[self._next :]:
            if not bucket.launched:
                self._launch(bucket, accumulate=False)
        self._finish()
        if self._replayed:  # gradients that arrived after their bucket left: add their mean
            for bucket in self.buckets:
                self._launch(bucket, accumulate=True)
            self._finish()
        for bucket in self.buckets:
            bucket.ready, bucket.launched = 0, False
        self._next, self._replayed = 0, False

    def gather(self, exact: bool) -> None:
        """Allgather every bucket's stepped chunk into the parameters (a few buckets at once);
        ``exact``: in fp32 whatever the wire."""
        for bucket in self.buckets:
            if self._transport.size == 1 and bucket.master is None:
                continue  # the optimizer stepped the parameters themselves: nothing to share
            slot, pool = self._slot(bucket)
            self.progress.start(bucket.gather_steps(slot, pool.release, exact=exact))
        self.progress.wait_all()

    def close(self) -> None:
        """Remove the hooks, finish the exchanges in flight (abandon them with a failed run), stop
        the thread and release the staging memory."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._transport.abandoned:
            self.progress.abandon()
        else:
            self._finish()
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        for pool in self._pools.values():
            pool.drop()
