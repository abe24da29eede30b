"""``python -m lightning_mpi.comm.spawned SCRIPT ARGS...``: what the survivors spawn to replace a
lost rank without waiting for the new process's imports (:class:`~.healing.Growing`).

MPI starts at once and the process joins the survivors (:func:`~.respawn.join_parent`: hello,
merge), so their spawn ends in a second or more; then it runs ``SCRIPT`` as ``__main__`` with
``sys.argv = [SCRIPT, *ARGS]`` (the script's directory first on ``sys.path``, as for ``python
SCRIPT``) and ``LIGHTNING_MPI_REPLACEMENT=1`` in its environment. The survivors go on training
meanwhile; the script's strategy takes the joined communicator (:func:`~.healing.join_run`), says
it is ready, and the survivors let it in at their next batch. A process whose spawn the survivors
gave up (another new process died, or training ended first) leaves with exit code 0.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m lightning_mpi.comm.spawned SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.path[0] = os.path.dirname(script)
    from lightning_mpi.comm.errors import ProcessFailed
    from lightning_mpi.comm.respawn import JOINED, REPLACEMENT_ENV, join_parent

    try:
        merged = join_parent()
    except ProcessFailed as given_up:  # another new process died, or training ended first: not needed
        sys.stderr.write(f"lightning_mpi.comm.spawned: {given_up}; this process leaves\n")
        raise SystemExit(0) from None
    if merged is None:
        raise SystemExit("lightning_mpi.comm.spawned: this process was not spawned by survivors of a heal")
    JOINED[:] = [merged]
    os.environ[REPLACEMENT_ENV] = "1"
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
