"""The link and the compute of a step: measured on the running job (:mod:`.probe`), and the
schedule they allow, as pure functions (:mod:`.model`)."""

from lightning_mpi.rules.link.model import Link
from lightning_mpi.rules.link.probe import LinkProbe, Measurement, StepClock

__all__ = ["Link", "LinkProbe", "Measurement", "StepClock"]
