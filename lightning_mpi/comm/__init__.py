"""MPI only, no Lightning: moving torch tensors between ranks, and keeping a run that fails on one
rank from hanging the others.

From the bottom up:

- :mod:`.cuda`: whether the MPI library takes CUDA device buffers;
- :mod:`.resources`: what one run made over MPI (communicators, windows, mailboxes), so that a
  failed run's can be abandoned whole; :mod:`.errors`: one rank's failure told to every other;
- :mod:`.transport`: blocking and non-blocking collectives on tensors, every wait with a timeout
  and watching the error channel; :mod:`.ring`: its sums over point-to-point messages, for jobs
  that heal;
- :mod:`.mailbox`: point-to-point messages nobody waits for; :mod:`.window`: one-sided windows
  (a sharded vector, counters, a decision board); :mod:`.reclaim`: freeing a failed run's
  handles on the next run's fresh communicator;
- :mod:`.buffers`, :mod:`.codecs`, :mod:`.sparse`, :mod:`.collectives`: buckets, wire formats and
  the averaging exchanges written as generators; :mod:`.engine`: the scheduler that drives many
  of them at once; :mod:`.progress`: the thread that enters MPI while training computes.

Why ``from mpi4py import MPI`` sits inside functions here: importing ``mpi4py.MPI`` initialises MPI
(``MPI_Init_thread``). A process that only imports lightning_mpi (the ``lightning-mpi`` launcher,
which must leave MPI to the ranks it starts; a test runner; a script that builds a Trainer before
choosing a strategy) must not become an MPI process by doing so. Every function that imports it
is handed a communicator or is about to use one, so MPI is initialised by then anyway.
"""
