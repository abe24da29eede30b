"""Preemption: on SIGTERM or SIGUSR1 every rank writes one consistent checkpoint and exits 0.

Slurm sends SIGTERM before it preempts or cancels a job (and SIGUSR1 ahead of time with
``--signal=USR1@T``); MPICH's ``mpiexec`` and ``lightning-mpi`` pass both on to every rank. Ranks
see the signal at different steps, or only some of them see it, so they vote on when to stop:

- every training batch, each rank starts a small non-blocking ``Iallreduce(MAX)`` of "I received a
  signal" on a communicator of its own (:class:`StopVote`);
- synchronous strategies complete it at the next batch, where every rank is anyway (the gradient
  exchange keeps them in step): all ranks learn the result at the same batch and stop there;
- asynchronous strategies only *test* it, so no rank waits for another; every rank sees the same
  results in the same order and stops at the first that says "stop", a few steps apart;
- at the stop, the ranks drain the votes (the one blocking collective, on a path that ends
  training anyway), write one checkpoint together, ``preempted.ckpt`` in the first
  ``ModelCheckpoint``'s directory (``<default_root_dir>/checkpoints`` without one), and raise
  :class:`Preempted`: a ``SystemExit`` with code 0, like Lightning's own ``SIGTERMException``, so
  the script ends without running what follows ``fit``, and a launcher does not restart it.

A relaunch with ``lightning-mpi --resume`` (or a Slurm requeue) resumes from it
(:mod:`.resume`). The signal handlers are installed while the training loop runs (from
``on_train_start``; Lightning's own SIGTERM handler, which needs ``torch.distributed``, is replaced
meanwhile); outside it the signals keep their previous behaviour.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import numpy as np

from lightning_mpi.comm.resources import keep_pending
from lightning_mpi.strategies.resume import checkpoint_dirs

__all__ = ["PREEMPTION_SIGNALS", "PREEMPTED_CHECKPOINT", "Preempted", "PreemptionWatch", "StopVote"]

#: Signals that ask the ranks to checkpoint and stop.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: File name of the checkpoint written on preemption.
PREEMPTED_CHECKPOINT = "preempted.ckpt"


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written; exit code 0."""

    #: every rank raises it after the same vote: not a failure to post (see ``propagate_errors``)
    agreed_by_every_rank = True

    def __init__(self, signum: int, path: str) -> None:
        super().__init__(0)
        self.signum = signum
        self.path = path

    def __str__(self) -> str:
        return f"preempted by {signal.Signals(self.signum).name}; checkpoint {self.path}"


class StopVote:
    """Ranks agree on one stop without a per-step barrier (see the module docstring).

    :meth:`step` is called once per batch on every rank with this rank's value (the signal it
    received, 0 for none); it returns the decision: 0 to go on, else the largest value of the
    first vote that was not 0. One vote is in flight at a time and nothing else runs on the
    vote's communicator, so the i-th vote of every rank is the same collective and all ranks
    decide on the same vote. ``lockstep=True`` (synchronous strategies) completes the vote in
    flight at the next call, so every rank decides at the same call; ``lockstep=False`` only tests
    it, and a new vote starts once it is complete: no rank waits, ranks decide at different calls.

    :meth:`finish` (blocking) is called once when a rank stops, whatever the reason: it keeps
    voting, now saying "I am finishing", until a vote shows every rank finishing; all ranks leave
    on that same vote, with the decision. Waits honour the transport's ``collective_timeout``, so
    a rank that died before it voted ends the wait with ``CollectiveTimeout`` instead of a hang.
    """

    def __init__(self, transport: Any, lockstep: bool) -> None:
        self.lockstep = lockstep
        # A communicator of its own: the votes never match a collective of the exchange rule.
        self.transport = transport.dup() if transport.size > 1 else None
        self.in_flight: tuple[Any, np.ndarray] | None = None
        self.started = 0
        self.decided = 0
        self.all_finishing = False

    def _start(self, value: int, finishing: bool = False) -> None:
        from mpi4py import MPI  # initialises MPI on import: only when a strategy runs (see lightning_mpi.comm)

        assert self.transport is not None
        # One MAX reduces both: the signal, and "finishing" as -1 (the max is -1 only if all are).
        buf = np.array([value, -1 if finishing else 0], dtype=np.int64)
        self.in_flight = (self.transport.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX), buf)
        self.started += 1

    def _complete(self, wait: bool) -> None:
        """Take the result of the vote in flight: waiting for it, or only if it is complete."""
        if self.in_flight is None:
            return
        request, buf = self.in_flight
        if wait:
            assert self.transport is not None  # a vote is in flight only with a transport
            # a watched wait: a rank that failed meanwhile fails this one too, instead of a hang
            self.transport._wait(request, "the preemption vote")
        elif not request.Test():
            return
        self.in_flight = None
        self.decided = self.decided or int(buf[0])
        self.all_finishing = int(buf[1]) == -1

    def step(self, value: int) -> int:
        if self.transport is None:
            self.decided = self.decided or value
            return self.decided
        if not self.decided:
            self._complete(wait=self.lockstep)
            if not self.decided and self.in_flight is None:
                self._start(value)
        return self.decided

    def finish(self) -> int:
        if self.transport is None:
            return self.decided
        self._complete(wait=True)
        while not self.all_finishing:
            self._start(0, finishing=True)
            self._complete(wait=True)
        return self.decided

    def close(self) -> None:
        """Free the communicator (after :meth:`finish`; a vote still in flight is abandoned, and
        kept with its buffer, since the other ranks may still complete it)."""
        if self.in_flight is not None:
            keep_pending(self.in_flight)
            self.in_flight = None
        elif self.transport is not None:
            self.transport.free()
        self.transport = None


class _SignalFlag:
    """Records the first preemption signal; installed only from the main thread."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works there; the signals keep their handlers
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}


class PreemptionWatch:
    """Checkpoint and stop on a preemption signal (module docstring), for the Trainer strategy.

    The strategy calls :meth:`start` when the training loop starts, :meth:`requested` at every
    training batch, :meth:`requested_at_end` when training ends (the votes are drained there),
    :meth:`checkpoint_and_exit` when either said yes, and :meth:`stop` on any way out.
    """

    def __init__(self) -> None:
        self._vote: StopVote | None = None
        self._flag: _SignalFlag | None = None

    def start(self, transport: Any, lockstep: bool) -> None:
        """Start voting (``lockstep`` for synchronous rules; asynchronous ones must not wait) and
        install the signal handlers."""
        self.stop()
        self._vote = StopVote(transport, lockstep=lockstep)
        self._flag = _SignalFlag()
        self._flag.install()

    def restart(self, transport: Any) -> None:
        """After a heal: vote again over the healed run's ``transport`` (collective), keeping a
        signal already received; the vote in flight is abandoned with the failed run."""
        vote = self._vote
        if vote is None:
            return
        if vote.in_flight is not None:
            keep_pending(vote.in_flight)
        self._vote = StopVote(transport, lockstep=vote.lockstep)

    def requested(self) -> bool:
        """This batch's vote: True when the ranks agreed to stop (a few steps apart if not lockstep)."""
        vote, flag = self._vote, self._flag
        return vote is not None and flag is not None and bool(vote.step(flag.signum or 0))

    def requested_at_end(self) -> bool:
        """At the end of training: drain the votes (blocking); True when they said stop."""
        return self._vote is not None and bool(self._vote.finish())

    def stop(self) -> None:
        """Put the signal handlers back and free the vote (safe to call twice)."""
        if self._flag is not None:
            self._flag.uninstall()
        if self._vote is not None:
            self._vote.close()
        self._vote = self._flag = None

    def checkpoint_and_exit(
        self,
        trainer: Any,
        rank: int,
        collective_scope: Callable[[], AbstractContextManager[Any]],
        end_training: Callable[[], None],
    ) -> NoReturn:
        """Drain the votes, write the checkpoint on every rank (rank 0 writes), end the rule's
        training together, raise :class:`Preempted`.

        ``collective_scope()`` makes the checkpoint callbacks' decisions collectives while saving;
        ``end_training()`` ends the rule's training (every rank is here after the same vote, so
        its windows and threads are released collectively at teardown, not left to process exit).
        """
        assert self._vote is not None
        # The largest signal number any rank received (the signal may have reached only some).
        signum = self._vote.finish()
        # The first directory that a relaunch searches (:func:`.resume.checkpoint_dirs`): the first
        # ``ModelCheckpoint``'s, resolved at setup, else ``<default_root_dir>/checkpoints``.
        path = os.path.join(checkpoint_dirs(trainer)[0], PREEMPTED_CHECKPOINT)
        with collective_scope():
            trainer.save_checkpoint(path)
        if rank == 0:
            sys.stderr.write(
                f"lightning_mpi: preempted ({signal.Signals(signum).name}) at step {trainer.global_step}: "
                f"every rank stops; checkpoint written to {path}. Launch again with "
                "`lightning-mpi --resume` (a Slurm requeue resumes by itself) to continue from it.\n"
            )
            sys.stderr.flush()
        self.stop()
        end_training()
        raise Preempted(signum, path)
