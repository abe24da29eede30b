"""``--heal``: a job that lost ranks on the way and still finished is a success.

Under ``mpirun --with-ft ulfm`` a job whose *first* ranks die goes on, and ``mpirun`` exits 0 when
the survivors finish. Two things measured with Open MPI 5.0.11 get in the way once replacements
were spawned (``heal="replace"``):

- a replacement that died is reported in ``mpirun``'s exit status (137 for a SIGKILL, although
  every survivor finished; the ``report-child-jobs-separately`` runtime option that would change
  it is not recognised by its PRRTE);
- after a replacement died before it joined, ``MPI_Finalize`` can wait forever (in its PMIx fence).

So the launcher gives the ranks a directory (:data:`HEAL_OUTCOME_ENV`); once every survivor is
done (``lightning_mpi.comm.ulfm.mark_finished``, collective), each leaves a ``finished.*`` file in
it. A job with such a file that ends by a signal (code > 128), or that is still running
``--grace`` seconds later (then it is stopped), is reported as finished: exit code 0, with a
note. An exception (code 1) is never overridden. The other way round, ``mpirun`` exits 0 after a
rank's ``MPI_Abort`` once ranks died (measured): a rank that fails the run leaves a ``failed.*``
file (``lightning_mpi.comm.ulfm.mark_failed``), and a job with one and no ``finished.*`` is
reported as failed (exit code 1), so that ``--max-restarts`` relaunches it. The directory is local
to the launcher's host (where rank 0 usually runs); on a shared file system any rank's file counts.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from .restarts import describe_exit

__all__ = [
    "FAILED_PREFIX",
    "FINISHED_PREFIX",
    "HEAL_OUTCOME_ENV",
    "SPARES_ENV",
    "OutcomeDir",
    "healed_exit_code",
    "marked_finished",
]

#: Exported to the ranks of a ``--heal`` job: the directory where they mark that training finished.
#: The same name as ``lightning_mpi.comm.ulfm.HEAL_OUTCOME_ENV`` (this package imports nothing of it).
HEAL_OUTCOME_ENV = "LIGHTNING_MPI_HEAL_OUTCOME"
#: Exported with ``--spares K``: the job's last K ranks are spares (``lightning_mpi.comm.spares``,
#: the same name as its ``SPARES_ENV``).
SPARES_ENV = "LIGHTNING_MPI_SPARES"
FINISHED_PREFIX = "finished."
FAILED_PREFIX = "failed."


def marked_finished(outcome_dir: str, prefix: str = FINISHED_PREFIX) -> bool:
    """Whether a rank left its ``finished.*`` file (``prefix``: another mark) in ``outcome_dir``."""
    try:
        return any(name.startswith(prefix) for name in os.listdir(outcome_dir))
    except OSError:
        return False


def healed_exit_code(code: int, outcome_dir: str | None, ended_after_finish: bool = False) -> tuple[int, str | None]:
    """The exit code to report for a ``--heal`` job that ended with ``code``, and a note when it
    differs from ``code`` (module docstring). ``ended_after_finish``: the launcher stopped a job
    that had not ended ``--grace`` seconds after its ranks marked training finished."""
    if outcome_dir is None:
        return code, None
    if ended_after_finish:
        return 0, (
            "training finished, but the job had not ended --grace seconds later (Open MPI can wait "
            "forever in MPI_Finalize after ranks were lost); stopped it"
        )
    if code == 0 and marked_finished(outcome_dir, FAILED_PREFIX) and not marked_finished(outcome_dir):
        return 1, "a rank failed the run (its traceback is above); mpirun reported success after ranks were lost"
    if code <= 128 or not marked_finished(outcome_dir):
        return code, None
    return 0, (
        f"training finished; mpirun reported {describe_exit(code)} for ranks lost on the way "
        "(with --heal that is not a failure)"
    )


class OutcomeDir:
    """A fresh directory for one launch's outcome marks (a context manager; removed on exit)."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="lightning-mpi-heal-")
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
