"""What one ``mpi_auto`` decision measures (:mod:`.rule`), every part collective and agreed over
the ranks, so that every rank decides from the same numbers:

- the link: a probe Allreduce of up to ``PROBE_NUMEL`` floats, timed
  (:class:`~lightning_mpi.rules.link.probe.LinkProbe`), with the compute of a step as the rule's
  step clock measured it;
- the cost of each every-step arm that is not in use, that the link does not rule out
  (:func:`~.choice.worth_timing`) and that was not timed yet on a link like this one
  (:func:`~.choice.still_valid`): one dry run of its exchange on the real gradient sizes
  (ASA fp16 on zeros; PowerSGD's whole step on copies of this rank's gradients), the slowest
  rank's time, turned into what it would add to a step (:func:`~.choice.dry_run_exposed`);
- where the arm in use exchanges every step, what its own steps showed: the median seconds its
  hooks held a step, the slowest rank's;
- on several hosts of several ranks (``inner``: the communicator of this rank's host), the exchange
  inside a host, ``"inner"``: a dry fp32 ASA of the gradient size over each host's ranks at once
  (twice, the faster kept), the slowest host's time, of which the part longer than the backward is
  what it adds to a step.

The training's parameters, gradients and state are untouched.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import cast

import torch
from torch import Tensor
from torch.optim import Optimizer

import lightning_mpi.rules.auto.choice as choice
from lightning_mpi.comm.codecs import FP16, FP32, Codec
from lightning_mpi.comm.collectives import ASAWorkspace, asa_mean_steps
from lightning_mpi.comm.engine import ExchangeScheduler
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.auto.choice import EVERY_STEP_ARMS, Sizes, still_valid, worth_timing
from lightning_mpi.rules.link.model import Link, exposed_seconds
from lightning_mpi.rules.link.probe import LinkProbe, Measurement
from lightning_mpi.rules.powersgd.rule import PowerSGDRule

#: Values of the bandwidth probe (fp32): 1 MiB, a few ms on 1 Gbit/s, 80 ms on 100 Mbit/s.
PROBE_NUMEL = 1 << 18
#: The most a later decision's link probe may cost, as a share of the compute of the steps since
#: the one before: on a slow link the decisions come more rarely than ``measure_every``. At
#: 100 Mbit/s the probe (three 1 MiB Allreduces and a barrier) took about 0.25 s, four steps,
#: every 100 steps, and ``mpi_auto`` made 6-9% fewer steps than ``mpi_streaming_diloco`` with
#: the same plan (docs/performance.md).
MEASURE_SHARE = 0.01
#: A probe cheaper than this never defers a decision (it is within a step's jitter; and on a fast
#: link a tiny model's steps are so short that 1% of them would defer every decision).
CHEAP_PROBE_SECONDS = 0.01


def probe_seconds(link: Link, world: int, numel: int, repeat_below: float = 0.25) -> float:
    """What the link probe of :meth:`DecisionProbe.measure` costs on ``link``: a tiny Allreduce and
    one of ``min(numel, PROBE_NUMEL)`` floats, each run three times where it takes under
    ``repeat_below`` seconds (as :class:`~lightning_mpi.rules.link.probe.LinkProbe` does)."""
    nbytes = 2 * (world - 1) / max(1, world) * min(numel, PROBE_NUMEL) * 4
    return sum(t * (1 if t >= repeat_below else 3) for t in (link.seconds(4.0), link.seconds(nbytes)))


def measure_interval(measure_every: int, measured: Measurement, world: int, numel: int) -> int:
    """Steps from a decision that kept its arm to the next: ``measure_every``, or more where the
    link probe would cost more than :data:`MEASURE_SHARE` of their compute (and more than
    :data:`CHEAP_PROBE_SECONDS`). Every input is agreed
    over the ranks, so every rank decides at the same step."""
    cost = probe_seconds(measured.link, world, numel)
    if measure_every <= 0 or cost < CHEAP_PROBE_SECONDS:
        return measure_every
    return max(measure_every, math.ceil(cost / (MEASURE_SHARE * max(measured.step_seconds, 1e-9))))


class DecisionProbe:
    """The measurements of one decision over ``transport`` (module docstring), for a model of
    ``params`` (``sizes``) and an arm that may add ``tolerance`` of a step."""

    def __init__(
        self,
        transport: Transport,
        params: Sequence[Tensor],
        sizes: Sizes,
        tolerance: float,
        inner: Transport | None = None,
    ) -> None:
        self.transport = transport
        self.params = params
        self.sizes = sizes
        self.tolerance = tolerance
        self.inner = inner

    def measure(
        self, step_seconds: float, arm: str, held: Iterable[float], observed: dict[str, tuple[float, float]]
    ) -> tuple[Measurement, float | None]:
        """Collective: the link measured at a step of ``step_seconds``; each dry-run arm's cost
        put into ``observed`` (exposed seconds per step, the bandwidth then); and, where ``arm``
        exchanges every step, the slowest rank's median of ``held`` (seconds its hooks held a step;
        ``None`` where no rank timed one)."""
        probe = torch.zeros(min(PROBE_NUMEL, max(1, self.sizes.numel)), dtype=torch.float32)
        nbytes = int(2 * (self.transport.size - 1) / self.transport.size * probe.numel() * 4)
        measured = LinkProbe(self.transport).measure(step_seconds, lambda: self.transport.allreduce_(probe), nbytes)
        self.dry_runs(measured, arm, observed)
        if arm not in ("sync", "powersgd"):  # the same on every rank: the arm in use is agreed
            return measured, None
        # Agreed whether or not this rank timed a step of the arm (-1: none), so that every rank
        # joins this Allreduce whatever its own ``held`` holds.
        times = sorted(held)
        mine = times[len(times) // 2] if times else -1.0
        agreed = torch.tensor([mine], dtype=torch.float64)
        slowest = float(self.transport.allreduce_(agreed, "max")[0])
        return measured, (slowest if slowest >= 0 else None)

    def dry_runs(self, measured: Measurement, arm_in_use: str, observed: dict[str, tuple[float, float]]) -> None:
        """Collective: time one exchange of every every-step arm that the link does not rule out
        (and that is not in use: its own steps are timed), on the real gradient sizes, and keep
        what it would add to a step as that arm's observed cost."""
        step, link = measured.step_seconds, measured.link
        for arm in EVERY_STEP_ARMS:
            if arm == arm_in_use or not worth_timing(arm, step, link, self.sizes, self.tolerance):
                continue
            if arm in observed and still_valid(observed[arm][1], link.bandwidth):
                # Timed already on a link like this one (agreed values: every rank skips it alike).
                # A dry run costs about a step or two (ASA of the whole gradient; PowerSGD on copies
                # of it), at every decision; on shared memory they cost mpi_auto 5-15% of
                # mpi_streaming_diloco's steps in 30 s when re-run every 100 steps.
                continue
            seconds = self.sync_seconds() if arm == "sync" else self.powersgd_seconds()
            agreed = torch.tensor([seconds], dtype=torch.float64)
            real = float(self.transport.allreduce_(agreed, "max")[0])  # every rank decides from the same
            # through the module: a test pins what the dry runs say
            observed[arm] = (choice.dry_run_exposed(arm, real, step, link, self.sizes), link.bandwidth)
        if self.inner is not None:  # the exchange inside the hosts (every host at once), timed at every decision
            # twice, the faster kept: the first touches fresh buffers (at 10 Mbit/s it measured over 10% of a
            # step where the next one measured 0%, and the decisions switched to two levels one decision late)
            inside = min(self.sync_seconds(self.inner, FP32) for _ in range(2))
            agreed = torch.tensor([inside], dtype=torch.float64)
            real = float(self.transport.allreduce_(agreed, "max")[0])
            observed["inner"] = (exposed_seconds(real, choice.BACKWARD_SHARE * step), link.bandwidth)

    def sync_seconds(self, transport: Transport | None = None, wire: Codec = FP16) -> float:
        """Collective over ``transport`` (the run's): one ASA exchange of the real gradient size
        (zeros) on ``wire``, timed."""
        transport = transport or self.transport
        size = transport.size
        flat = torch.zeros(-(-self.sizes.numel // size) * size, dtype=torch.float32)
        work = ASAWorkspace.for_buffer(flat, size, wire)
        scheduler = ExchangeScheduler(
            transport.timeout, transport.rank, size, watch=transport.watch, comm=transport.comm
        )
        start = time.perf_counter()
        scheduler.start(asa_mean_steps(transport, flat, wire, work))
        scheduler.wait_all()
        return time.perf_counter() - start

    def powersgd_seconds(self) -> float:
        """Collective: PowerSGD's step (compress, two Allreduces, decompress, error feedback) on
        copies of this rank's gradients, timed once: the matrix products and orthogonalisation the
        link model cannot see. Once, so that the probe costs about one PowerSGD step: that one
        also draws the Q's and allocates the buckets, which overstates PowerSGD's cost a little;
        its steady cost shows in its own steps once it runs."""
        shadow = []
        for param in self.params:
            copy = torch.empty_like(param).requires_grad_(True)
            source = param.grad if param.grad is not None else param  # same cost, non-zero values
            copy.grad = source.detach().clone()
            shadow.append(copy)
        steps = SimpleNamespace(param_groups=[{"params": shadow}])  # before_step reads only these
        bound = PowerSGDRule(overlap=False).bind(self.transport, shadow)
        try:
            with warnings.catch_warnings():  # a rank's own non-finite gradients: timed all the same
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                bound.before_step(cast(Optimizer, steps))
                return time.perf_counter() - start
        finally:
            bound.close()
