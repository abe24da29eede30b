"""One optimizer step of a Fabric loop with the rule: ``optimizer.step()`` and the clipping before it.

The Fabric strategy's ``optimizer_step`` calls :meth:`FabricStep.run`, which:

1. looks for another rank's failure first (under ``heal``: heals here);
2. applies the convergence aids' param-group overrides (``lr_scaling``, warm-up) around the
   update, and records what they applied;
3. runs the rule's exchange (``before_step``, as the operations of
   :meth:`~lightning_mpi.rules.base.BoundRule.healable_before_step`, which a heal redoes on the
   healed run), unless clipping already ran it this step
   (:meth:`FabricStep.exchange_before_clipping`: clipping must see the averaged gradients, as under
   ``ddp``);
4. skips the update when the exchange rejected it (non-finite gradients), unless a GradScaler
   handles inf gradients itself; else updates and runs ``after_step``
   (the same way);
5. counts the step in :attr:`FabricStep.steps_seen` on every exit (the aids' schedule and a new
   rank's handover read it).

Without a bound rule the update is Fabric's own, with the aids around it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpi.strategies.convergence import ConvergenceAids
from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.rule_runner import RuleRunner


class FabricStep:
    """The Fabric strategy's optimizer steps (see the module docstring)."""

    def __init__(self, runner: RuleRunner, healing: RunHealing, failures: RunFailures, aids: ConvergenceAids) -> None:
        self._runner = runner
        self._healing = healing
        self._failures = failures
        self._aids = aids
        #: optimizer steps this rank has taken part in (a new rank takes rank 0's count)
        self.steps_seen = 0
        self._exchanged: bool | None = None  # an exchange run early, for clipping (sharded optimizer)

    def run(
        self,
        optimizer: Optimizer,
        module: Module | None,
        world_size: Callable[[], int],
        update: Callable[[], Any],
        scaler_handles_inf: bool,
    ) -> Any:
        """The rule's exchange, ``update()`` (Fabric's ``optimizer_step``), then ``after_step``;
        ``module`` is the one the rule is bound to; ``world_size()`` is read after a heal here.
        Returns ``update()``'s result, or ``None`` for a skipped update."""
        self._healing.between("the error channel", self._failures.check_peers, None)
        overrides = self._aids.overrides(optimizer, world_size(), self.steps_seen)
        bound = self._runner.bound
        try:
            with overrides if overrides is not None else nullcontext():
                if bound is None:
                    return update()
                accepted = self._exchanged
                if accepted is None:
                    accepted = self._healing.bound.healable_before_step(optimizer, self._healing)
                self._exchanged = None
                if not accepted and not scaler_handles_inf:
                    return None
                output = update()
                # the rule as bound now (a heal rebinds it)
                self._healing.bound.healable_after_step(optimizer, self._healing)
                return output
        finally:
            self.steps_seen += 1
            if overrides is not None:
                self._aids.record(overrides)

    def exchange_before_clipping(self, optimizer: Optimizer, module: Module | None) -> None:
        """Run the rule's exchange (``before_step``) now, once, so that clipping sees what the
        update will use, the averaged gradients, as under ``ddp``; :meth:`run` then takes its
        result instead of exchanging again."""
        if self._runner.bound is not None and self._exchanged is None:
            self._exchanged = self._healing.bound.healable_before_step(optimizer, self._healing)
