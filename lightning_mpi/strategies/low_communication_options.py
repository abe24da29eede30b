"""Typed, documented constructor arguments of the low-communication strategies.

The same contract as :mod:`lightning_mpi.strategies.options` (one class per strategy, which turns
its arguments into a validated :class:`~lightning_mpi.rules.base.Rule` and passes the rest on with
``**kwargs``), kept apart so that neither module grows past a screenful of classes.
"""
from __future__ import annotations
