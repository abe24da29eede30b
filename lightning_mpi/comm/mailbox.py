"""Point-to-point messages that nobody waits for: fixed-size float32 tensors pushed to one peer.

A :class:`Mailbox` sends on a private communicator (so no other traffic can match its messages)
with ``Isend`` and keeps each message alive until its send completes; the receiver takes whatever
has arrived (``Iprobe``) or, at a known end, waits for the next message (polling, so that the wait
raises when another rank failed). Every message is received into one reused inbox buffer.

It counts what it sent to and received from every rank, so that after a failed run the next run
can settle it (:meth:`Mailbox.settle`): every message still in flight is received and dropped, every
send completes, and nothing stale is left to match later traffic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.transport import Transport, wait_request


class Mailbox:
    """Messages of ``numel`` float32 values between the ranks of ``transport``.

    Collective: construction (duplicates the communicator; blocking, so callers agree first, see
    ``Transport.barrier(agree=True)``) and :meth:`close`. Waits watch ``transport``'s error channel.
    """

    def __init__(self, transport: Transport, numel: int, tag: int = 7301) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self.MPI = MPI
        self.transport = transport
        self.resources = transport.resources
        self.comm: Any = self.resources.comm(transport.comm.Dup())
        self.resources.mailbox(self)
        self.tag = tag
        self.inbox = torch.empty(numel, dtype=torch.float32)
        self._sending: list[tuple[Any, Tensor]] = []  # (request, message) until the send completes
        self.sent_to = [0] * transport.size
        self.received_from = [0] * transport.size

    def send(self, dest: int, message: Tensor) -> None:
        """Start sending ``message`` (contiguous CPU float32, ``numel`` values) to rank ``dest``; do not wait."""
        self._sending.append((self.comm.Isend(message.numpy(), dest=dest, tag=self.tag), message))
        self.sent_to[dest] += 1

    def reap(self) -> None:
        """Forget the messages whose sends have completed."""
        self._sending = [(r, m) for r, m in self._sending if not r.Test()]

    def _receive_from(self, source: int) -> Tensor:
        self.comm.Recv(self.inbox.numpy(), source=source, tag=self.tag)
        self.received_from[source] += 1
        return self.inbox

    def arrived(self) -> Iterator[Tensor]:
        """Receive every message that has arrived, one at a time; each is :attr:`inbox`, valid
        until the next one is received."""
        status = self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.tag, status=status):
            yield self._receive_from(status.Get_source())

    def wait_for_one(self) -> Tensor:
        """Wait until a message arrives (with the transport's timeout, watching its error
        channel); return it (in :attr:`inbox`)."""
        probe = _Probe(self.comm, self.tag)
        t = self.transport
        wait_request(probe, t.timeout, "gossip drain", t.rank, t.size, t.watch)
        return self._receive_from(probe.status.Get_source())

    def finish_sends(self) -> None:
        """Wait until every message sent so far has left."""
        t = self.transport
        for request, _ in self._sending:
            wait_request(request, t.timeout, "gossip send", t.rank, t.size, t.watch)
        self._sending = []

    def settle(self, transport: Transport) -> None:
        """After a failed run, over ``transport`` (a fresh, healthy one; collective): receive and
        drop every message sent to this rank that it has not received, then complete every send."""
        everyone = transport.allgather_object(self.sent_to)
        buffer = torch.empty_like(self.inbox).numpy()
        for source, sent in enumerate(everyone):
            for _ in range(sent[transport.rank] - self.received_from[source]):
                request = self.comm.Irecv(buffer, source=source, tag=self.tag)
                wait_request(
                    request,
                    transport.timeout,
                    "settling a failed run's messages",
                    transport.rank,
                    transport.size,
                    transport.watch,
                )
                self.received_from[source] += 1
        for request, _ in self._sending:
            wait_request(
                request,
                transport.timeout,
                "settling a failed run's messages",
                transport.rank,
                transport.size,
                transport.watch,
            )
        self._sending = []

    def close(self) -> None:
        """Free the communicator (after a failed run: leave it to the next run, which settles the
        messages still in flight first). Safe to call twice."""
        if self.comm is None or not self.resources.forget_mailbox(self):
            return  # closed, or abandoned: reclaim settles it and frees the communicator
        self.reap()
        for request, _ in self._sending:  # sends nobody will receive (closed without on_train_end)
            request.Cancel()
            request.Wait()
        self._sending = []
        self.resources.free_comm(self.comm)
        self.comm = None


class _Probe:
    """A "request" that completes when a message has arrived (``Iprobe``), for :func:`wait_request`."""

    def __init__(self, comm: Any, tag: int) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self.comm, self.tag, self.MPI = comm, tag, MPI
        self.status = MPI.Status()

    def Test(self) -> bool:  # noqa: N802  (mpi4py's name)
        return bool(self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.tag, status=self.status))
