"""The pack/unpack hooks of :class:`lightning_mpi.LMSOffload`, for one training step.

An :class:`OffloadSession` decides *which* saved tensors leave the device and *when* they come
back; a tier (:mod:`lightning_mpi.offload.tiers`, :mod:`lightning_mpi.offload.disk`) moves the
bytes. No Lightning here: the session works inside any
``torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack)`` block.

Policy, in the order it is applied to each saved tensor:

1. Kept resident: parameters and buffers (their memory stays allocated anyway), casts of
   parameters (autocast caches them for the whole forward), tensors of a foreign kind (sparse,
   subclasses, devices the tier does not take), views that are not dense (expanded, strided
   slices: a copy frees nothing while their base lives), tensors smaller than ``min_bytes``,
   tensors saved while an excluded module runs, and tensors saved while backward runs (a
   reentrant checkpoint recomputing its segment, a graph built for double backward): backward
   uses those at once, and treating them as a new forward pass would drop the prefetch order of
   the one backward is walking through. Also tensors saved while a CUDA graph is being
   captured: an offload cannot be part of a captured graph (counted in ``captured_tensors``).
2. A tensor saved twice (relu output saved by relu and by the next op) is offloaded once.
3. The last ``keep_last`` candidates of a forward pass stay resident: backward needs them first.
   They wait in a sliding window; a candidate that leaves the window is swapped out.
4. Backward unpacks in (roughly) reverse order of saving, so when it starts the session prefetches
   from the end of the list, keeping ``prefetch`` tensors in flight ahead of use. A prefetched
   tensor that backward goes past without unpacking (an unused branch) leaves the window. A
   tensor handed to backward stays in the window until the *device* has run the work that uses
   it (the tier's ``used_marker``, an event recorded on the compute stream at the next unpack,
   when that work has been queued): autograd's thread runs ahead of the GPU, and counting
   tensors as used when the host hands them over would let restores pile up on the device.

A tensor that was modified in place after it was saved cannot be restored; plain autograd raises
for that ("modified by an inplace operation"), and so does the session, at unpack.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mpi.offload.tensors import is_dense, layout_of
from lightning_mpi.offload.tiers import Ticket

_CAST = "ToCopyBackward0"
_UNMARKED = object()  # a taken ticket whose consumer has not been queued yet
_LEAF = "AccumulateGrad"


@dataclass
class OffloadStats:
    """What LMSOffload did in one training step."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0  # bytes swapped out of the device (or out of RAM, disk tier on CPU)
    resident_bytes: int = 0  # bytes of saved tensors kept resident (each counted once per save)
    peak_saved_bytes: int = 0  # most bytes that were out of the device at one time
    copy_ms: float = 0.0  # time spent copying, out and back
    exposed_ms: float = 0.0  # part of it that training waited for
    file_bytes: int = 0  # size of the step's spill file (disk tier)
    captured_tensors: int = 0  # kept resident: saved while a CUDA graph was being captured

    @property
    def hidden_ms(self) -> float:
        """Copy time that overlapped compute."""
        return max(self.copy_ms - self.exposed_ms, 0.0)


def _inside_backward() -> bool:
    """True on a thread that runs autograd's backward (the engine sets a graph task there)."""
    return torch._C._current_graph_task_id() != -1


def _in_cuda_graph_capture(t: torch.Tensor) -> bool:
    """True when ``t`` is a CUDA tensor and its device's current stream is capturing a graph
    (``torch.cuda.graph``, ``make_graphed_callables``)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _Handle:
    """What autograd holds for an offloadable saved tensor. Autograd drops it when the saving
    node has run its backward; then ``__del__`` releases the tier's copy."""

    __slots__ = ("tensor", "ticket", "restored", "source", "version", "session", "__weakref__")

    def __init__(self, tensor: torch.Tensor, source: torch.Tensor, session: OffloadSession) -> None:
        self.tensor: torch.Tensor | None = tensor  # detached alias while resident (no cycle through grad_fn)
        self.ticket: Ticket | None = None
        self.restored: torch.Tensor | None = None
        self.source = weakref.ref(source)  # to detect in-place changes after saving
        self.version = source._version
        self.session = session

    def __del__(self) -> None:
        ticket, session = self.ticket, self.session
        if ticket is not None and not ticket.done and session is not None:
            session._forget(ticket)  # never blocks: __del__ may run on any thread, even the I/O one


class OffloadSession:
    """Pack/unpack hooks for one step. ``start()``, run forward and backward inside
    ``saved_tensors_hooks(session.pack, session.unpack)``, then ``finish()`` (or ``abort()``)."""

    def __init__(
        self,
        tier: Any,
        accepts: Callable[[torch.Tensor], bool],
        min_bytes: int,
        keep_last: int,
        prefetch: int,
    ) -> None:
        self.tier = tier
        self.accepts = accepts  # device filter of the tier
        self.min_bytes = max(int(min_bytes), 1)
        self.keep_last = keep_last
        self.prefetch = prefetch
        self.excluded_depth = 0  # > 0 while an excluded module runs (set by module hooks)
        self._lock = threading.RLock()  # unpack and __del__ may run on autograd's threads
        self._orphans: deque[Ticket] = deque()  # tickets whose handles died, to discard
        self._active = False

    # --- step boundaries --------------------------------------------------------------------
    def start(self, keep_storages: set[int]) -> None:
        """Begin a step. ``keep_storages``: storage addresses never to offload (parameters and
        buffers)."""
        with self._lock:
            self._keep_storages = keep_storages
            self._stats = OffloadStats()
            self._seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}
            self._window: deque[_Handle] = deque()
            self._order: list[Ticket] = []  # swapped-out tickets of the current forward pass
            self._tickets: list[Ticket] = []  # every ticket of the step, for cleanup
            self._cursor = -1  # next ticket to prefetch, walking down _order
            self._ahead: list[Ticket] = []  # the prefetch window: fetched ahead of backward
            # taken tickets whose use the device may not have run yet: [ticket, marker]; marker
            # _UNMARKED until the next unpack records it (then the consumer has been queued)
            self._unused: deque[list] = deque()
            self._backward = False
            self._saved_now = 0
            self.excluded_depth = 0
            self._active = True

    def finish(self) -> OffloadStats:
        """End the step: forget every copy, let the tier free its files, return the stats."""
        return self._close(self.tier.end_step)

    def abort(self) -> OffloadStats:
        """End a step that raised; never raises."""
        return self._close(self.tier.abort)

    # --- the hooks ------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        if not self._active or self.excluded_depth or _inside_backward() or not self._offloadable(tensor):
            if self._active:
                self._stats.resident_bytes += tensor.numel() * tensor.element_size()
            # Detached: returning the tensor itself would make an uncollectable cycle through
            # its grad_fn for tensors that are outputs of the node saving them.
            return tensor.detach()
        if _in_cuda_graph_capture(tensor):
            # A captured graph replays kernels only: the copies, event queries and host waits of
            # an offload cannot be part of it (and most are not even allowed during capture).
            self._stats.captured_tensors += 1
            self._stats.resident_bytes += tensor.numel() * tensor.element_size()
            return tensor.detach()
        with self._lock:
            self._drain_orphans()
            seen = self._seen.get(id(tensor))
            if seen is not None and seen[0]() is tensor:
                handle = seen[1]()
                if handle is not None and handle.version == tensor._version:
                    return handle  # saved again: one copy serves both
            if self._backward:  # a forward pass after a backward one (several in one step)
                self._new_forward_pass()
            handle = _Handle(tensor.detach(), tensor, self)
            self._seen[id(tensor)] = (weakref.ref(tensor), weakref.ref(handle))
            self._window.append(handle)
            while len(self._window) > self.keep_last:
                self._swap_out(self._window.popleft())
            return handle

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        handle: _Handle = packed
        if handle.restored is not None:
            return handle.restored
        if handle.tensor is not None:  # stayed resident (the keep_last window)
            self.begin_backward()
            with self._lock:
                self._mark_used()
            self._check_version(handle)
            return handle.tensor
        with self._lock:
            ticket = handle.ticket
            if not self._active or ticket is None:
                raise RuntimeError(
                    "LMSOffload: a saved tensor was unpacked after its training step ended; "
                    "saved tensors live until on_train_batch_end (no graph may outlive its step)"
                )
            self._drain_orphans()
            self.begin_backward()
            self._mark_used()
            if ticket.prefetched:
                self._leave_window(ticket)
            tensor = self.tier.take(ticket)
            self._unused.append([ticket, _UNMARKED])
            self._saved_now -= ticket.layout.nbytes
            self._check_version(handle)  # after take: the copy has finished and reported
            handle.restored = tensor
            self._pass_over(ticket)
            self._prefetch_more()
        return tensor

    def begin_backward(self) -> None:
        """Backward is starting: freeze the window (those tensors stay resident) and start
        prefetching from the last offloaded tensor. Idempotent; also triggered by the first
        unpack."""
        with self._lock:
            if self._backward or not self._active:
                return
            self._backward = True
            self._window.clear()
            self._cursor = len(self._order) - 1
            self._prefetch_more()

    # --- internals ------------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        # Exact type: nn.Parameter and tensor subclasses (DTensor, FakeTensor, ...) stay.
        if type(t) is not torch.Tensor or t.layout != torch.strided or not self.accepts(t):
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        if not is_dense(t):
            # An expanded or strided view of a larger base: a copy would free nothing while the
            # base lives, and would come back contiguous, with strides backward did not see.
            return False
        if t.untyped_storage().data_ptr() in self._keep_storages:
            return False  # a parameter or buffer, or a view of one
        root = t._base if t._base is not None else t
        fn = root.grad_fn
        if fn is not None and type(fn).__name__ == _CAST:
            nxt = fn.next_functions
            if nxt and nxt[0][0] is not None and type(nxt[0][0]).__name__ == _LEAF:
                return False  # an autocast copy of a parameter: cached, stays allocated anyway
        return True

    def _swap_out(self, handle: _Handle) -> None:
        tensor = handle.tensor
        assert tensor is not None, "only resident tensors wait in the window"
        if handle.version != tensor._version:
            return  # keep it; unpack reports the in-place change
        handle.tensor = None
        ticket = self.tier.swap_out(tensor, layout_of(tensor), handle.version)
        ticket.order = len(self._order)
        handle.ticket = ticket
        self._order.append(ticket)
        self._tickets.append(ticket)
        nbytes = ticket.layout.nbytes
        self._stats.offloaded_tensors += 1
        self._stats.offloaded_bytes += nbytes
        self._saved_now += nbytes
        self._stats.peak_saved_bytes = max(self._stats.peak_saved_bytes, self._saved_now)

    def _mark_used(self) -> None:
        """Backward has queued the work that uses every tensor taken so far: record the tier's
        marker for each one still unmarked."""
        marker_of = getattr(self.tier, "used_marker", None)
        for entry in self._unused:
            if entry[1] is _UNMARKED:
                entry[1] = marker_of(entry[0]) if marker_of is not None else None

    def _in_use_on_device(self) -> int:
        """Taken tensors the device may still be using (the one being used now not counted)."""
        while (
            self._unused
            and self._unused[0][1] is not _UNMARKED
            and (self._unused[0][1] is None or self._unused[0][1].query())
        ):
            self._unused.popleft()  # markers complete in stream order: the oldest first
        return sum(1 for _, marker in self._unused if marker is not _UNMARKED)

    def _prefetch_more(self) -> None:
        while len(self._ahead) + self._in_use_on_device() < self.prefetch and self._cursor >= 0:
            ticket = self._order[self._cursor]
            self._cursor -= 1
            if ticket.done or ticket.prefetched:
                continue
            self.tier.fetch(ticket)
            ticket.prefetched = True
            self._ahead.append(ticket)

    def _leave_window(self, ticket: Ticket) -> None:
        ticket.prefetched = False
        self._ahead.remove(ticket)  # the window is ``prefetch`` tickets long: a short scan

    def _pass_over(self, taken: Ticket) -> None:
        """Backward has reached ``taken``: prefetched tickets saved after it in the same forward
        pass were passed over (saved by a branch the loss does not use, whose graph is still
        alive). They leave the window, which would otherwise stay full of tensors nobody unpacks
        and stop prefetching; their data stays fetched in case one is unpacked after all."""
        if not (0 <= taken.order < len(self._order) and self._order[taken.order] is taken):
            return  # from an earlier forward pass: its order says nothing about this one
        for ticket in [t for t in self._ahead if t.order > taken.order]:
            self._leave_window(ticket)

    def _forget(self, ticket: Ticket) -> None:
        """Autograd dropped a saved tensor without unpacking it (an unused branch, a freed
        graph): release its copy and its prefetch slot. Called from ``_Handle.__del__``, which
        the garbage collector may run on any thread, including one the lock holder waits for;
        so it only queues the ticket unless the lock is free right now."""
        self._orphans.append(ticket)  # deque.append is atomic
        if self._lock.acquire(blocking=False):
            try:
                self._drain_orphans()
            finally:
                self._lock.release()

    def _drain_orphans(self) -> None:
        while self._orphans:
            ticket = self._orphans.popleft()
            if ticket.done:
                continue
            if ticket.prefetched:
                self._leave_window(ticket)
            self.tier.discard(ticket)
            if self._active:
                self._saved_now -= ticket.layout.nbytes
        if self._active and self._backward:
            self._prefetch_more()

    def _new_forward_pass(self) -> None:
        for ticket in list(self._ahead):  # the last backward is over: whatever it left is passed
            self._leave_window(ticket)
        self._backward = False
        self._order = []
        self._cursor = -1
        self._unused.clear()

    def _check_version(self, handle: _Handle) -> None:
        # handle.tensor (resident) is a detached alias: it shares the version counter.
        alias = handle.tensor if handle.tensor is not None else handle.source()
        error = handle.ticket.error if handle.ticket is not None else None
        if error is None and alias is not None and alias._version != handle.version:
            error = "modified in place after it was saved"
        if error is not None:
            raise RuntimeError(
                f"LMSOffload: a tensor saved for backward was {error}; autograd needs its saved "
                "value (without offloading, autograd raises 'modified by an inplace operation')"
            )

    def _close(self, end: Callable[[], Any]) -> OffloadStats:
        with self._lock:
            if not self._active:
                return OffloadStats()
            self._drain_orphans()
            self._active = False
            for ticket in self._tickets:
                if not ticket.done:
                    self.tier.discard(ticket)
            self._tickets, self._order, self._seen, self._ahead = [], [], {}, []
            self._window.clear()
            self._unused.clear()
            stats = self._stats
        tier_stats = end()
        stats.copy_ms = tier_stats.copy_s * 1000.0
        stats.exposed_ms = tier_stats.exposed_s * 1000.0
        stats.file_bytes = tier_stats.file_bytes
        return stats
