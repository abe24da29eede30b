"""``python -m lightning_mpi.comm.spawned SCRIPT ARGS...``: what the survivors spawn to replace a
lost rank without waiting for the new process's imports (:func:`~.healing.start_growth`).

With ``--spare`` first it is a warm spare (:mod:`.spare`), spawned by the run ahead of any loss:
it joins the run's ranks in a spare world, runs ``SCRIPT`` the same way, and its strategy waits
there to be let in (or dismissed) after it is built.

MPI starts at once and the process joins the survivors (:func:`~.respawn.join_parent`: hello,
merge), so their spawn returns in about a second; then it runs ``SCRIPT`` as ``__main__`` with
``sys.argv = [SCRIPT, *ARGS]`` (the script's directory first on ``sys.path``, as for ``python
SCRIPT``) and ``LIGHTNING_MPI_REPLACEMENT=1`` in its environment. The survivors go on training
meanwhile; the script's strategy takes the joined communicator (:func:`~.healing.join_run`), says
it is ready, and the survivors let it in at their next batch.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    from lightning_mpi.comm.spare import SPARE_ARG, SPARE_WORLD

    spare = len(sys.argv) > 1 and sys.argv[1] == SPARE_ARG
    if spare:
        del sys.argv[1]
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: python -m lightning_mpi.comm.spawned [{SPARE_ARG}] SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.path[0] = os.path.dirname(script)
    from lightning_mpi.comm.respawn import JOINED, REPLACEMENT_ENV, join_parent

    joined = join_parent()
    if joined is None:
        raise SystemExit("lightning_mpi.comm.spawned: this process was not spawned by survivors of a heal")
    # a warm spare waits in its spare world to be let in; a replacement is joined to the survivors already
    (SPARE_WORLD if spare else JOINED)[:] = [joined]
    os.environ[REPLACEMENT_ENV] = "1"
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
