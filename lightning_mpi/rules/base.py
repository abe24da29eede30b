"""Exchange rules: hyperparameters (a :class:`Rule`) bound to a communicator (a :class:`BoundRule`).

A :class:`Rule` holds validated hyperparameters and nothing else, so it can be built from the
command line and pickled. :meth:`Rule.bind` gives the running part, which owns buffers and state.
Rules know torch and the transport; they know nothing of Lightning: the strategy calls these
hooks, in this order, on every rank:

1. ``on_train_start()`` once, after all ranks hold rank 0's initial weights.
2. per updating step: ``before_step(optimizer)`` after backward; returns ``False`` when the step
   must be skipped (non-finite exchanged gradients), then ``after_step(optimizer)`` after it.
3. ``on_train_end()`` once: leave the rule's final consensus weights in the parameters.
4. ``close()``: release threads, windows and requests.

``state_dict()`` / ``load_state_dict()`` carry what a resumed run needs beyond the module and
optimizer states; ``stats()`` returns numbers worth logging for the last step.

Every bound rule checks at bind time that its parameters sit on one device
(:func:`check_single_device`). Rules whose ranks step on their own gradients (elastic, model
averaging, parameter server, gossip) reject a step whose local gradients hold inf or NaN with a
:class:`LocalStepGuard`, so that a NaN loss on one rank never reaches the weights, the center or
the other ranks.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import validate


def check_single_device(params: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless every parameter sits on one device.

    Every rule refuses a model spread over several devices inside one rank (model parallelism):
    the elastic, server and gossip rules keep all parameters in one flat buffer on one device,
    and although the synchronous rules bucket per device, the strategy places the whole model on
    one device per rank (``root_device``), so a second device can only come from parameters that
    were never placed (e.g. left on ``meta``): a mistake to report early, not a layout to serve.
    """
    devices = sorted({str(p.device) for p in params})
    if len(devices) <= 1:
        return
    hint = ""
    if "meta" in devices:
        hint = (
            " Parameters on 'meta' hold no data yet: materialise them first (e.g. module.to_empty(device=...) "
            "and initialise them) before training."
        )
    raise ValueError(
        f"lightning_mpi: the trainable parameters sit on {len(devices)} devices ({', '.join(devices)}), but an "
        "exchange rule needs every one of them on one device per rank. Keep the model on one device "
        "(e.g. model.to(device); MPIStrategy puts rank r on device local_rank % devices_per_host) and "
        f"run one rank per device instead of spreading one model over several.{hint}"
    )


def grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """True when no parameter's gradient holds inf or NaN (a missing gradient counts as finite).

    One sum per gradient (inf or NaN anywhere makes it non-finite), then a single check of all
    of them, so that a GPU synchronises once per step, not once per parameter.
    """
    # 16-bit gradients are summed in float32: a finite fp16 gradient can sum past 65504
    sums = [
        p.grad.sum(dtype=torch.float64 if p.grad.dtype == torch.float64 else torch.float32)
        for p in params
        if p.grad is not None
    ]
    if not sums:
        return True
    return bool(torch.isfinite(torch.stack([s.double() for s in sums])).all())


def all_finite(buffers: Sequence[torch.Tensor]) -> bool:
    """True when no buffer holds inf or NaN.

    One vectorised float32 sum per buffer: inf or NaN anywhere makes the sum non-finite. (A
    float64 sum would also rule out overflow of the sum itself, but costs ~30x more; a finite
    gradient whose sum overflows float32 needs entries near 1e38, which is no usable step either.)
    """
    return all(bool(torch.isfinite(b.sum())) for b in buffers)


class LocalStepGuard:
    """Rejects a rank's own step when its local gradients hold inf or NaN.

    For rules whose ranks step on their own gradients (elastic and model averaging, parameter
    server, gossip): no exchange sees the gradients before the optimizer does, so without this a
    NaN loss on one rank would make that rank's weights NaN, and the next exchange would carry
    them into the center, the average or a peer. A rejected step skips the optimizer update on
    this rank only (no collective: asynchronous rules must not wait) and is counted in
    :attr:`skipped_steps`, with one warning per run.

    The rejected step still counts as a step of the rule: collective exchanges (EASGD, model
    averaging) happen every ``period`` steps on every rank, so a rank that stopped counting would
    call them at other steps than the rest and mix up or hang the job.
    :class:`BoundLocalStepRule` holds the protocol.
    """

    def __init__(self, rule_name: str) -> None:
        self.rule_name = rule_name
        self.skipped_steps = 0
        self._counted = False

    def accept(self, params: Sequence[torch.Tensor]) -> bool:
        """True when this rank's gradients are finite; else count, warn once and return False."""
        self._counted = False
        if grads_finite(params):
            return True
        self.skipped_steps += 1
        self._counted = True
        if self.skipped_steps == 1:
            warnings.warn(
                f"lightning_mpi: non-finite local gradients (inf/NaN loss?) on this rank; rule {self.rule_name!r} "
                "skips this rank's update and keeps counting the step. Further skips are counted in "
                "stats()['skipped_steps'] without a warning.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False

    def already_counted(self) -> bool:
        """True (once) when ``before_step`` rejected and counted this step itself."""
        counted, self._counted = self._counted, False
        return counted


class BoundRule:
    """The running part of a rule. The default hooks do nothing, so a rule overrides only what it uses.

    Besides the hooks, three attributes are part of the contract that the strategies rely on
    (a rule that has no use for one keeps the default):

    - ``sync_enabled``: the strategy sets it to ``False`` while gradients accumulate without an
      update (Lightning's accumulation, Fabric's ``no_backward_sync``); a rule whose gradient
      hooks start exchanges during backward must not start them then.
    - ``training``: ``True`` from ``on_train_start`` until ``on_train_end`` (or an aborted fit).
    - ``restart_after_heal``: whether a heal starts the new binding (``on_train_start``); by
      default while ``training``.
    - ``board``: a :class:`~lightning_mpi.comm.window.DecisionBoard` on which stop decisions are
      published one-sidedly while ``training``, or ``None`` when decisions must be collectives.

    Raises:
        ValueError: the parameters sit on more than one device (see :func:`check_single_device`).
    """

    sync_enabled: bool = True
    training: bool = False
    board: Any | None = None

    def __init__(self, transport: Transport, params: Sequence[torch.Tensor]) -> None:
        self.transport = transport
        self.params = list(params)
        check_single_device(self.params)

    @property
    def restart_after_heal(self) -> bool:
        """Whether a heal starts the new binding (``on_train_start``, collective): while training."""
        return self.training

    def on_train_start(self) -> None:
        """Called once when training starts, with identical weights on every rank."""

    def before_step(self, optimizer: Optimizer) -> bool:
        """Called after backward on a step that updates; return ``False`` to skip the update."""
        return True

    def after_step(self, optimizer: Optimizer) -> None:
        """Called after ``optimizer.step()``."""

    def on_train_end(self) -> None:
        """Called once when training ends; leaves the final consensus weights in ``params``."""

    def close(self) -> None:
        """Release background resources. Safe to call twice."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def stats(self) -> dict[str, float]:
        """Numbers about the last step (seconds, bytes, counts) for the logger."""
        return {}


class BoundLocalStepRule(BoundRule):
    """A running rule whose ranks step on their own gradients, guarded by a :class:`LocalStepGuard`.

    Subclasses implement :meth:`_advance` (count one step, and exchange when one is due). A step
    whose local gradients are non-finite is rejected in :meth:`before_step` and advanced there;
    any other step is advanced in :meth:`after_step`. Advancing a rejected step from
    ``before_step`` keeps the exchange at the same point relative to any other collective of the
    step (nothing else runs between ``before_step`` and ``after_step``), and ``after_step`` does
    not count it twice when a GradScaler makes the strategy call it anyway.
    """

    def __init__(self, transport: Transport, params: Sequence[torch.Tensor], rule_name: str) -> None:
        super().__init__(transport, params)
        self.guard = LocalStepGuard(rule_name)

    def before_step(self, optimizer: Optimizer) -> bool:
        """Reject this rank's step when its own gradients are non-finite (the step still counts)."""
        if self.guard.accept(self.params):
            return True
        self._advance()
        return False

    def after_step(self, optimizer: Optimizer) -> None:
        if not self.guard.already_counted():
            self._advance()

    def _advance(self) -> None:
        """Count one local step; exchange when one is due."""
        raise NotImplementedError


class Rule(ABC):
    """Hyperparameters of an exchange rule: a keyword-only dataclass of options.

    Subclasses are made with :func:`~lightning_mpi.options.options_class` and declare each
    hyperparameter once, with :func:`~lightning_mpi.options.option` (type, default, one line of
    doc, check). Construction runs every option's check, then :meth:`check_together`, so a bad
    value raises ``ValueError`` naming it, its value and the fix.
    """

    #: Short name used in logs (``mpi/<name>/...``).
    name: ClassVar[str] = "rule"
    #: Whether ranks step without waiting for each other. The strategies then answer Lightning's
    #: stop decisions one-sidedly, vote on preemption without lockstep, and offer
    #: ``momentum_correction``.
    asynchronous: ClassVar[bool] = False

    def __post_init__(self) -> None:
        validate(self)
        self.check_together()

    def check_together(self) -> None:  # noqa: B027  (a hook: most rules have nothing to check together)
        """Checks that involve several options (each option's own check has run already)."""

    @abstractmethod
    def bind(self, transport: Transport, params: Sequence[torch.Tensor]) -> BoundRule:
        """Create the running rule over ``params`` (the trainable parameters, in model order)."""
