"""The collaborators that both strategies wire the same way: the rule, failures, healing, ZeRO.

:func:`wire_run` builds, for one strategy, after Lightning's ``__init__`` has set the cluster
environment (its communicator, ranks and world size):

- :class:`~.rule_runner.RuleRunner`: the rule's lifecycle; a failed run abandons it;
- :class:`~.failures.RunFailures`: each run's transport and the error channel (its first call is
  collective: every rank builds its strategy together), abandoning the rule when a run fails;
- :class:`~.healing.RunHealing`: ``heal``; it reads the rule as bound (while it is live), calls the
  strategy's ``adopt(state)`` after a heal, and abandons the rule of a failed run;
- :class:`~.optimizer_sharding.OptimizerSharding`: ZeRO's optimizer shard, with a buddy copy of
  another rank's shard while ``heal`` is set.

:meth:`RunParts.rebind` is the part of ``adopt`` both strategies share: the rule bound again on the
healed run's transport with the state the survivors kept, and a sharded optimizer rebuilt on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_mpi.rules.base import Rule
from lightning_mpi.strategies.common_options import CommonOptions
from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.optimizer_sharding import OptimizerSharding
from lightning_mpi.strategies.rule_runner import RuleRunner


@dataclass(frozen=True)
class RunParts:
    """One strategy's rule runner, failures, healing and optimizer sharding (module docstring)."""

    runner: RuleRunner
    failures: RunFailures
    healing: RunHealing
    optimizer_sharding: OptimizerSharding

    def rebind(
        self,
        state: dict[str, Any] | None,
        module: torch.nn.Module | None,
        rule: Rule,
        optimizers: Sequence[Optimizer],
    ) -> None:
        """After a heal: bind ``rule`` again to ``module`` on the current transport with the kept
        ``state``, and rebuild a sharded optimizer on it (nothing without a state or a module)."""
        if state is None or module is None:
            return
        bound = self.runner.rebind(self.failures.transport, module, rule, state)
        if self.optimizer_sharding.active:  # ZeRO: the optimizer state rebuilt from shards and mirrors
            self.optimizer_sharding.attach(bound, optimizers)


def wire_run(
    rule: Rule,
    options: CommonOptions,
    environment: Any,
    global_rank: int,
    world_size: int,
    adopt: Callable[[dict[str, Any] | None], None],
) -> RunParts:
    """The collaborators of one strategy (module docstring) over ``environment``'s communicator;
    ``adopt(state)`` is the strategy's own step after a heal."""
    runner = RuleRunner(rule)
    failures = RunFailures(
        environment.comm,
        global_rank,
        world_size,
        options.collective_timeout,
        options.abort_on_exception,
        on_abandon=runner.abandon,
    )
    healing = RunHealing(
        options.heal,
        options.min_ranks,
        failures,
        environment,
        bound=lambda: runner.bound if runner.live else None,
        adopt=adopt,
        abandon=runner.abandon,
        rule_name=rule.name,
    )
    return RunParts(runner, failures, healing, OptimizerSharding(mirror=healing.active))
