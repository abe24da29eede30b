"""Point-to-point messages that nobody waits for: fixed-size float32 tensors pushed to one peer.

A :class:`Mailbox` sends on a private communicator (so no other traffic can match its messages)
with ``Isend`` and keeps each message alive until its send completes; the receiver takes whatever
has arrived (``Iprobe``) or, at a known end, waits for the next message (``Probe``). Every message
is received into one reused inbox buffer.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.transport import Transport


class Mailbox:
    """Messages of ``numel`` float32 values between the ranks of ``transport``.

    Collective: construction (duplicates the communicator) and :meth:`close`.
    """

    def __init__(self, transport: Transport, numel: int, tag: int = 7301) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm: Any = transport.comm.Dup()
        self.tag = tag
        self.inbox = torch.empty(numel, dtype=torch.float32)
        self._sending: list[tuple[Any, Tensor]] = []  # (request, message) until the send completes

    def send(self, dest: int, message: Tensor) -> None:
        """Start sending ``message`` (contiguous CPU float32, ``numel`` values) to rank ``dest``; do not wait."""
        self._sending.append((self.comm.Isend(message.numpy(), dest=dest, tag=self.tag), message))

    def reap(self) -> None:
        """Forget the messages whose sends have completed."""
        self._sending = [(r, m) for r, m in self._sending if not r.Test()]

    def _receive_from(self, source: int) -> Tensor:
        self.comm.Recv(self.inbox.numpy(), source=source, tag=self.tag)
        return self.inbox

    def arrived(self) -> Iterator[Tensor]:
        """Receive every message that has arrived, one at a time; each is :attr:`inbox`, valid
        until the next one is received."""
        status = self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.tag, status=status):
            yield self._receive_from(status.Get_source())

    def wait_for_one(self) -> Tensor:
        """Block until a message arrives; return it (in :attr:`inbox`)."""
        status = self.MPI.Status()
        self.comm.Probe(source=self.MPI.ANY_SOURCE, tag=self.tag, status=status)
        return self._receive_from(status.Get_source())

    def finish_sends(self) -> None:
        """Wait until every message sent so far has left."""
        for request, _ in self._sending:
            request.Wait()
        self._sending = []

    def close(self) -> None:
        """Cancel sends still in flight (only after an aborted run) and free the communicator.
        Safe to call twice."""
        for request, _ in self._sending:
            request.Cancel()
            request.Wait()
        self._sending = []
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
