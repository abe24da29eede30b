"""How each Trainer stage runs in this process: every failure on every rank, ``fit`` resumed by itself.

``mpiexec`` (or ``srun``, or ``lightning-mpi``) started the ranks, so the Trainer strategy's
Lightning launcher starts no process. :func:`trainer_launcher` fills Lightning's launcher slot with
:class:`~..resume.AutoResume` around :class:`InProcessLauncher`:

- ``fit``/``validate``/``test``/``predict`` run inside
  :meth:`~..failures.RunFailures.propagate_errors`: a failure is posted to the other ranks before
  Lightning's ``on_exception`` hooks run, so that callbacks that make collectives there (a
  checkpoint on exception) start on fresh communicators everywhere;
- ``fit`` without ``ckpt_path`` after a restart resumes from the newest checkpoint every rank can
  read (:func:`~..resume.resume_checkpoint`); in a rank spawned to replace a lost one
  (``heal="replace"``) it resumes from the survivors' handover instead, whatever ``ckpt_path``
  says (:meth:`~..replacement.RunReplacing.receive`, collective with the survivors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning_mpi.comm.transport import Transport
from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.replacement import REPLACEMENT_REASON, RunReplacing
from lightning_mpi.strategies.resume import AutoResume, resume_checkpoint


class InProcessLauncher:
    """Lightning's launcher slot, used to run ``fit``/``validate``/``test``/``predict`` inside
    :meth:`~..failures.RunFailures.propagate_errors` in this process (module docstring)."""

    is_interactive_compatible = True

    def __init__(self, failures: RunFailures) -> None:
        self._failures = failures

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any | None = None, **kwargs: Any) -> Any:
        with self._failures.propagate_errors():
            return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher starts no process."""


class RunView(Protocol):
    """What the launcher reads of the strategy when ``fit`` starts: the current run."""

    @property
    def transport(self) -> Transport: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def trainer_launcher(run: RunView, failures: RunFailures, replacing: RunReplacing, fitting: Any) -> AutoResume:
    """The Trainer strategy's launcher (module docstring); ``fitting`` is the Trainer package's
    ``TrainerFn.FITTING``."""

    def resume_from(trainer: Any, reason: str) -> str | None:
        if reason == REPLACEMENT_REASON:
            return replacing.receive()  # the survivors' state (collective)
        return resume_checkpoint(trainer, run.transport, run.global_rank, run.world_size, reason)

    return AutoResume(InProcessLauncher(failures), fitting, resume_from, forced=replacing.resume_reason)
