"""What ``mpi_auto`` trains with, as pure functions of what it measured: no MPI, no clocks.

The arms, in order of preference (the first keeps replicas closest to one process with W times
the batch):

1. ``sync``: every-step ASA with a 16-bit wire (``mpi_asa16``), when its exchange hides behind
   backward: the part of it that the backward (taken as :data:`BACKWARD_SHARE` of a step's
   compute) cannot hide is at most ``tolerance`` of a step.
2. ``powersgd``: PowerSGD at rank 1 (``mpi_powersgd``), when its exchange costs at most
   ``tolerance`` of a step.
3. ``streaming``: Streaming DiLoCo (``mpi_streaming_diloco``) otherwise, at its defaults (wire,
   fragments, overlap, period), with the period its own ``period="auto"`` picks
   (:func:`~lightning_mpi.rules.link.model.hidden_schedule`) where the exchange needs a longer one
   to hide (:func:`streaming_plan`); on SparseLoCo's wire where the dense 4-bit fragments would
   need more than :data:`SPARSE_WHEN` times the default period to hide.

Per level, where the run spans several hosts of several ranks (``Sizes.hosts`` and
``Sizes.per_host`` above 1; hosts as ``mpi_hybrid`` finds them): the arms above are judged on the
link the whole run's exchanges cross, the slowest (between hosts). Where none of the every-step
arms hides there, the low-communication arm is ``hybrid`` (``mpi_hybrid``): every step inside each
host, unless its exchange there (``"inner"``: a dry fp32 ASA over the host's ranks) does not hide
either, and Streaming DiLoCo across hosts, each rank carrying its piece of its host's outer Δ, with
the plan that hides the piece's exchange (:func:`hybrid_plan`). Where the inner exchange does not
hide (or was not timed, as a host's shared memory is taken to hide when it was not), flat
Streaming DiLoCo, every rank a worker.

An every-step arm's cost is what it adds to a step: ``observed`` where it was timed, predicted
from the link only where it was not. The rule times every candidate that the link does not rule
out before it takes it (a dry run of the arm's exchange on the real gradients) and every arm
that ran (the time its hooks held the step); an observation counts while the link stays within
a factor 2 of the one it was made on. The link alone cannot see what an exchange costs in
compute: PowerSGD's matrix products and orthogonalisation took 54-68% of a step on 2 cores
where the link predicted 1-9%, and a 16-bit cast costs more than the bytes it saves on shared
memory.

Hysteresis (:func:`choose`): the arm in use is kept while its exposed time is at most
``tolerance · KEEP`` of a step; another sync-like arm is taken only when it is at most
``tolerance · ENTER``. Streaming DiLoCo keeps its plan unless the new one has another wire or
number of fragments, or a period off by more than a factor 2. So noise in the measurements does
not make the rule switch back and forth, and each switch (which costs an exchange of the
weights) has to buy a clear gain.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.sparseloco import SparseLoCoWire
from lightning_mpi.rules.diloco.fragments import Wire, exchange_bytes
from lightning_mpi.rules.diloco.streaming import StreamingDiLoCoRule, split_fragments
from lightning_mpi.rules.link.model import Link, exposed_seconds, hidden_schedule
from lightning_mpi.rules.powersgd.lowrank import compression_rank, matrix_shape

#: The share of a step's compute that is backward (forward : backward ≈ 1 : 2 for dense layers).
BACKWARD_SHARE = 2.0 / 3.0
#: The arm in use is kept while its exposed time is within tolerance · KEEP of a step ...
KEEP = 2.0
#: ... and a better arm is entered only when within tolerance · ENTER.
ENTER = 0.5
#: The every-step arms, in order of preference.
EVERY_STEP_ARMS = ("sync", "powersgd")
#: Streaming DiLoCo takes SparseLoCo's wire (1/18 of the 4-bit wire's bytes) where its 4-bit
#: fragments would need a period over this many times the default one to hide: a period that long
#: lets the replicas drift further than the sparse wire's loss at equal steps (about 4% on the
#: time-to-quality language model at period 10, docs/convergence.md). Measured at 10 Mbit/s and
#: 50 ms (docs/performance.md, one run each): SparseLoCo with ``period="auto"`` reached 3.175
#: nats/byte in T, the 4-bit wire with ``period="auto"`` 3.240.
SPARSE_WHEN = 2


@dataclass(frozen=True)
class Choice:
    """One arm and its settings (0 where they do not apply)."""

    arm: str
    wire: str = ""
    fragments: int = 0
    period: int = 0
    overlap_steps: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Choice:
        """The choice :meth:`as_dict` wrote (read back from a checkpoint: its values converted)."""
        return cls(
            arm=str(saved["arm"]),
            wire=str(saved["wire"]),
            fragments=int(saved["fragments"]),
            period=int(saved["period"]),
            overlap_steps=int(saved["overlap_steps"]),
        )

    def describe(self) -> str:
        plan = f"wire={self.wire}, fragments={self.fragments}, period={self.period}, overlap_steps={self.overlap_steps}"
        if self.arm == "streaming":
            return f"streaming DiLoCo ({plan})"
        if self.arm == "hybrid":
            return f"two levels: every step inside each host, streaming DiLoCo across hosts ({plan})"
        if self.arm == "sync":
            return f"every-step ASA (wire={self.wire})"
        return "PowerSGD (rank 1)"


@dataclass(frozen=True)
class Sizes:
    """What the arms send, from the model: ``numel`` trainable values, ``tensors`` trainable tensors,
    ``powersgd_bytes`` one rank sends per PowerSGD step, over ``world`` ranks; ``numels``, each
    tensor's values in model order (empty: fragments taken as equal shares of ``numel``); the
    ``world`` ranks sit on ``hosts`` hosts, at most ``per_host`` on one."""

    numel: int
    tensors: int
    powersgd_bytes: int
    world: int
    numels: tuple[int, ...] = ()
    hosts: int = 1
    per_host: int = 1

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], world: int, hosts: Sequence[int] = ()) -> Sizes:
        """``hosts``: the host of every rank (empty: one rank per host)."""
        numels = tuple(math.prod(s) for s in shapes)
        hosts = list(hosts) or list(range(world))
        per_host = max(hosts.count(h) for h in set(hosts))
        return cls(sum(numels), len(shapes), powersgd_bytes(shapes, world), world, numels, len(set(hosts)), per_host)

    @property
    def two_levels(self) -> bool:
        """Several hosts of several ranks: a run that ``mpi_hybrid`` can split into levels."""
        return self.hosts > 1 and self.per_host > 1

    def sync_bytes(self, wire: str = "fp16") -> int:
        return exchange_bytes(self.numel, self.world, get_codec(wire))

    def fragment_bytes(self, wire: str, fragments: int) -> int:
        """Bytes of the largest fragment's exchange, fragments cut as Streaming DiLoCo cuts them."""
        tensors = self.largest_fragment(fragments)
        padded = -(-sum(tensors) // self.world) * self.world  # as OuterFragment pads it
        return exchange_bytes(padded, self.world, _wire(wire), tensors)

    def piece_bytes(self, wire: str, fragments: int) -> int:
        """Bytes one rank sends across hosts per exchange of the largest fragment under ``mpi_hybrid``:
        its piece (1/``per_host`` of the fragment), averaged with one rank of each other host."""
        piece = -(-sum(self.largest_fragment(fragments)) // (self.per_host * self.hosts)) * self.hosts
        return exchange_bytes(piece, self.hosts, _wire(wire))

    def largest_fragment(self, fragments: int) -> list[int]:
        """The values of each tensor of the largest fragment, cut as Streaming DiLoCo cuts them
        (without the tensors' sizes: an equal share of ``numel``)."""
        if not self.numels or fragments > len(self.numels):
            return [math.ceil(self.numel / fragments)]
        groups: list[list[int]] = [[] for _ in range(fragments)]
        for numel, group in zip(self.numels, split_fragments(list(self.numels), fragments), strict=True):
            groups[group].append(numel)
        return max(groups, key=sum)


def _wire(name: str) -> Wire:
    return SparseLoCoWire() if name == "sparseloco" else get_codec(name)


def powersgd_bytes(
    shapes: Sequence[Sequence[int]], world: int, rank: int = 1, min_compression_rate: float = 2.0
) -> int:
    """Bytes one rank sends per step of PowerSGD (fp32 Allreduces of P, Q and the uncompressed tensors)."""
    values = 0
    for shape in shapes:
        matrix = matrix_shape(shape)
        r = compression_rank(shape, rank, min_compression_rate) if matrix is not None else 0
        values += (matrix[0] + matrix[1]) * r if matrix is not None and r else math.prod(shape)
    return int(2 * (world - 1) / max(1, world) * values * 4)


def default_plan(sizes: Sizes) -> Choice:
    """``mpi_streaming_diloco`` at its defaults (fragments at most one per tensor, as it binds):
    what ``mpi_auto`` trains with from its first step, before it has measured anything."""
    defaults = StreamingDiLoCoRule()
    fragments = max(1, min(defaults.fragments, sizes.tensors))
    return Choice("streaming", defaults.wire, fragments, int(defaults.inner_period()), defaults.overlap_steps)


def streaming_plan(step_seconds: float, link: Link, sizes: Sizes) -> Choice:
    """Streaming DiLoCo's plan: its defaults (:func:`default_plan`), with the period (and τ) that
    its own ``period="auto"`` picks for the largest fragment's exchange where that is longer
    than the default period, else the default period with τ raised to what one exchange needs.
    Where the 4-bit fragments would need more than :data:`SPARSE_WHEN` times the default period,
    SparseLoCo's wire instead, with the period and τ that hide its (18 times smaller) exchange.

    The default period is kept where a shorter one would hide: on 2 cores every exchange's
    encoding and sums take CPU from the steps, and ``mpi_streaming_diloco:period=auto`` (period
    8 at 1 Gbit/s, 16 at 100 Mbit/s) made fewer steps and a worse loss in T than its default 50
    in the same time-to-quality run (docs/performance.md)."""
    return _hiding(default_plan(sizes), sizes.fragment_bytes, step_seconds, link)


def hybrid_plan(step_seconds: float, link: Link, sizes: Sizes) -> Choice:
    """``mpi_hybrid``'s plan: as :func:`streaming_plan`, between the hosts, where each exchange is a
    rank's piece of its host's fragment (:meth:`Sizes.piece_bytes`: 1/``per_host`` of it, averaged
    over ``hosts`` carriers), so that the period that hides it is that much shorter."""
    return _hiding(replace(default_plan(sizes), arm="hybrid"), sizes.piece_bytes, step_seconds, link)


def _hiding(plan: Choice, exchange: Callable[[str, int], int], step_seconds: float, link: Link) -> Choice:
    """``plan`` (the defaults) with the period, τ and wire that hide an exchange of
    ``exchange(wire, fragments)`` bytes (:func:`streaming_plan`)."""
    seconds = link.seconds(exchange(plan.wire, plan.fragments))
    period, tau = hidden_schedule(seconds, step_seconds, plan.fragments, plan.overlap_steps)
    if period > SPARSE_WHEN * plan.period:  # too slow a link for dense fragments: SparseLoCo's wire
        seconds = link.seconds(exchange("sparseloco", plan.fragments))
        period, tau = hidden_schedule(seconds, step_seconds, plan.fragments, plan.overlap_steps)
        return replace(plan, wire="sparseloco", period=period, overlap_steps=tau)
    if period > plan.period:
        return replace(plan, period=period, overlap_steps=tau)
    return replace(plan, overlap_steps=max(plan.overlap_steps, min(tau, plan.period // plan.fragments - 1)))


def still_valid(seen_bandwidth: float, bandwidth: float) -> bool:
    """Whether an arm's cost observed on a link of ``seen_bandwidth`` still counts on one of
    ``bandwidth``: within a factor 2 (a link that moved more is timed again)."""
    return 0.5 <= bandwidth / max(seen_bandwidth, 1e-12) <= 2.0


def worth_timing(arm: str, step_seconds: float, link: Link, sizes: Sizes, tolerance: float) -> bool:
    """Whether the link leaves ``arm`` a chance: its predicted cost is within the band that
    :func:`choose` keeps (the link part is a lower bound of what it costs), so that a dry run
    of it is worth its time."""
    return predicted_exposed(arm, step_seconds, link, sizes) <= tolerance * KEEP * step_seconds


def dry_run_exposed(arm: str, real_seconds: float, step_seconds: float, link: Link, sizes: Sizes) -> float:
    """Seconds per step a dry run of ``arm``'s exchange that took ``real_seconds`` says it adds to a
    step: only its link part, at most the backward, can hide behind backward; its compute (casts,
    sums, PowerSGD's matrix products and orthogonalisation) adds to the step on a CPU."""
    if arm == "sync":
        link_seconds = link.seconds(sizes.sync_bytes())
    elif arm == "powersgd":
        link_seconds = link.latency + link.seconds(sizes.powersgd_bytes)  # two Allreduces
    else:
        raise ValueError(f"arm={arm!r} is not an every-step arm: choose 'sync' or 'powersgd'")
    return exposed_seconds(real_seconds, min(link_seconds, BACKWARD_SHARE * step_seconds))


def predicted_exposed(arm: str, step_seconds: float, link: Link, sizes: Sizes) -> float:
    """Seconds per step an every-step arm's exchange is predicted to add to a step's compute."""
    if arm == "sync":
        return exposed_seconds(link.seconds(sizes.sync_bytes()), BACKWARD_SHARE * step_seconds)
    if arm == "powersgd":  # two Allreduces (P's, then Q's), not overlapped in this model
        return link.latency + link.seconds(sizes.powersgd_bytes)
    raise ValueError(f"arm={arm!r} is not an every-step arm: choose 'sync' or 'powersgd'")


def choose(
    step_seconds: float,
    link: Link,
    sizes: Sizes,
    current: Choice | None = None,
    observed: Mapping[str, float] | None = None,
    tolerance: float = 0.1,
    first: bool = False,
) -> tuple[Choice, str]:
    """The arm to train with, and why (one line).

    ``current`` is the arm in use (None: none yet) and ``observed`` the exposed seconds per step
    seen for the every-step arms on this link, in a dry run or while they ran (see the module
    docstring); an arm observed is judged by that, not by the link; ``observed["inner"]``, on
    several hosts of several ranks, is the exchange inside a host (:func:`inner_hides`). At the
    ``first`` decision an every-step arm enters at ``tolerance`` and Streaming DiLoCo's plan is
    taken as computed (no arm was chosen yet, so no hysteresis).
    """
    observed = observed or {}
    if world_alone(sizes):
        return Choice("sync", "fp16"), "one rank: nothing to exchange"
    enter = tolerance * (1.0 if current is None or first else ENTER)
    keep = tolerance * KEEP
    costs = []
    for arm in EVERY_STEP_ARMS:
        seen = arm in observed
        exposed = observed[arm] if seen else predicted_exposed(arm, step_seconds, link, sizes)
        share = exposed / step_seconds
        costs.append(f"{arm} {share:.0%}{' (observed)' if seen else ''}")
        if current is not None and current.arm == arm and share <= keep:
            return current, f"{arm} still hides: exposed {', '.join(costs)} of a step (keep ≤ {keep:.0%})"
        if share <= enter:
            wire = "fp16" if arm == "sync" else ""
            return Choice(arm, wire), f"exposed {', '.join(costs)} of a step (enter ≤ {enter:.0%})"
    why = f"exposed {', '.join(costs)} of a step: too slow for every-step exchanges"
    inside = inner_hides(step_seconds, sizes, current, observed, tolerance, first)
    if inside is not None:
        why += f"; every step inside each host ({inside})"
    plan = (hybrid_plan if inside is not None else streaming_plan)(step_seconds, link, sizes)
    if current is not None and current.arm == plan.arm:
        if current == plan:
            return current, why + "; the plan in use hides its exchanges"
        # Not at the first decision: the defaults' plan was not chosen, and moving to one that
        # differs in period or τ alone costs nothing before its first exchange (it is rescheduled).
        if not first and _similar(current, plan):
            return current, why + f"; the plan in use is close to the new one ({plan.describe()})"
    return plan, why


def inner_hides(
    step_seconds: float,
    sizes: Sizes,
    current: Choice | None,
    observed: Mapping[str, float],
    tolerance: float,
    first: bool = False,
) -> str | None:
    """Where the run spans several hosts of several ranks, whether every step inside each host
    hides (what it exposes, as a phrase) or None (or not two levels): the exchange inside a host is
    judged by its dry run (``observed["inner"]``), with :func:`choose`'s hysteresis; not timed, it is
    taken to hide (a host's shared memory)."""
    if not sizes.two_levels:
        return None
    if "inner" not in observed:
        return "not timed: taken to hide"
    share = observed["inner"] / step_seconds
    keep = current is not None and current.arm == "hybrid" and not first
    limit = tolerance * (KEEP if keep else 1.0 if current is None or first else ENTER)
    return f"exposed {share:.0%} of a step (≤ {limit:.0%})" if share <= limit else None


def world_alone(sizes: Sizes) -> bool:
    return sizes.world <= 1


def _similar(a: Choice, b: Choice) -> bool:
    return a.wire == b.wire and a.fragments == b.fragments and 0.5 <= a.period / max(1, b.period) <= 2.0
