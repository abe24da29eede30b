"""One optimizer step of the Trainer with the rule: backward, the exchange, the update, ``after_step``.

Lightning runs backward inside the optimizer's closure, so :meth:`TrainerStep.run` wraps the
closure: after backward the rule exchanges (``before_step``, as operations that a heal redoes on the healed run:
:meth:`~lightning_mpi.rules.base.BoundRule.healable_before_step`), and an exchange that rejects the step (non-finite
gradients) abandons it before the update on every rank, unless a GradScaler handles inf gradients
itself (it must see them). After the update, ``after_step`` (the same way).
Lightning calls it only on steps that update, so gradient accumulation exchanges once per update.

The convergence aids (``lr_scaling``, warm-up, implicit-momentum correction) wrap the whole
``optimizer.step`` (LBFGS reads its lr before it calls the closure) and are lifted while the closure
runs (SGD/Adam call it first, then read the lr), so only the update sees them; ``with`` puts the
user's values back on every exit: a finished step, a skipped one or an exception. Every step, skipped
or not, counts in :attr:`TrainerStep.steps_seen`. Without a bound rule the step is Lightning's own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpi.lr_scaling import StepOverrides
from lightning_mpi.strategies.convergence import ConvergenceAids
from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.rule_runner import RuleRunner

#: Lightning's ``optimizer_step`` with a given closure (the strategy's base class does the update).
LightningStep = Callable[[Callable[[], Any]], Any]


class _SkipStep(Exception):
    """Raised from inside the optimizer closure to abandon a step before the update runs."""


class TrainerStep:
    """The Trainer strategy's optimizer steps (see the module docstring)."""

    def __init__(self, runner: RuleRunner, healing: RunHealing, failures: RunFailures, aids: ConvergenceAids) -> None:
        self._runner = runner
        self._healing = healing
        self._failures = failures
        self._aids = aids
        #: optimizer steps taken (the step count where there is no trainer to count them)
        self.steps_seen = 0

    def run(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        lightning_step: LightningStep,
        module: Module | None,
        world_size: Callable[[], int],
        step: Callable[[], int],
        scaler_handles_inf: bool,
    ) -> Any:
        """Optimizer step ``step()`` of ``module`` (the one the rule is bound to) at ``world_size()``
        (both read after a heal here): returns what ``lightning_step`` returns, or ``None`` for a
        step the exchange rejected."""
        self._healing.between("the error channel", self._failures.check_peers, None)
        overrides = self._aids.overrides(optimizer, world_size(), step())
        try:
            with overrides if overrides is not None else nullcontext():
                output = self._exchange_and_step(
                    optimizer, closure, overrides, lightning_step, module, scaler_handles_inf
                )
        finally:
            self.steps_seen += 1
        if overrides is not None:
            self._aids.record(overrides)
        return output

    def _exchange_and_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        overrides: StepOverrides | None,
        lightning_step: LightningStep,
        module: Module | None,
        scaler_handles_inf: bool,
    ) -> Any:
        """Backward (the closure), the rule's exchange, the update, the rule's ``after_step``."""
        lift = overrides.wrap_closure if overrides is not None else (lambda f: f)
        if self._runner.bound is None:
            return lightning_step(lift(closure))

        def closure_then_exchange() -> Any:
            result = closure()
            accepted = self._healing.bound.healable_before_step(optimizer, self._healing)
            if not accepted and not scaler_handles_inf:
                raise _SkipStep
            return result

        try:
            # backward and the exchange see the user's values; the update sees the aids
            output = lightning_step(lift(closure_then_exchange))
        except _SkipStep:
            return None
        # the rule as bound now (a heal rebinds it)
        self._healing.bound.healable_after_step(optimizer, self._healing)
        return output
