"""Tests of :mod:`lightning_mpi.launcher`, one file per module."""
