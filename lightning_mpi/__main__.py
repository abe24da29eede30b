"""``python -m lightning_mpi ...`` is the ``lightning-mpi`` launcher (see :mod:`lightning_mpi.launcher`)."""

from lightning_mpi.launcher import main

raise SystemExit(main())
