"""What a strategy is apart from its Lightning frontend, built once for the Trainer and for Fabric.

Each frontend's ``MPIStrategy`` (:mod:`.trainer`, :mod:`.fabric`) holds one :class:`StrategyCore`
as ``_core`` and keeps Lightning's lifecycle methods, each with one job, calling it. The core is
built before Lightning's ``__init__`` runs, in this order: the checks (the rule, the common options,
whether ``heal`` can work under this MPI, the convergence aids), so that every fix is named before
the first collective; the MPI cluster environment (its construction splits ``COMM_WORLD``); then,
over its communicator, the collaborators both frontends share:

- :class:`~.rule_runner.RuleRunner`: bind, pause, checkpoint and close the rule;
- :class:`~.failures.RunFailures`: each run's transport; one rank's exception on every rank;
- :class:`~.healing.RunHealing`: ``heal``; it calls the strategy's ``adopt(state)`` after a heal;
- :class:`~.optimizer_sharding.OptimizerSharding`: ZeRO's optimizer shard, global-norm clipping;
- :class:`~.replacement.RunReplacing`: ``heal="replace"``, with the frontend's loaders and loop;
- :class:`~.run_collectives.RunCollectives`: Lightning's collectives over MPI, through a heal.

What the user reads and sets on either strategy (``rule``, ``collective_timeout``, ...) is the
core's: each strategy class names it as a :class:`CoreAttribute`, defined and documented once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import check_one
from lightning_mpi.rules.base import BoundRule, Rule
from lightning_mpi.rules.catalog import DEFAULT_RULE
from lightning_mpi.strategies.checkpoint_io import save_through_heals
from lightning_mpi.strategies.collectives import barrier
from lightning_mpi.strategies.common_options import CommonOptions
from lightning_mpi.strategies.convergence import ConvergenceAids
from lightning_mpi.strategies.environment import device_local_rank, rank_device
from lightning_mpi.strategies.failures import RunFailures, install_abort_hook
from lightning_mpi.strategies.flags import check_num_nodes, checked_parallel_devices
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.lightning_api import FabricAPI
from lightning_mpi.strategies.optimizer_sharding import OptimizerSharding
from lightning_mpi.strategies.replacement import LoopAccess, RunReplacing
from lightning_mpi.strategies.rule_runner import CHECKPOINT_KEY, RuleRunner
from lightning_mpi.strategies.run_collectives import RunCollectives
from lightning_mpi.strategies.signatures import check_rule


class StrategyCore:
    """One strategy's options, rule, run and collaborators (see the module docstring).

    Args:
        rule: the strategy's ``rule`` argument.
        options: the common options, as passed (:class:`.common_options.CommonOptions`).
        fabric: the Fabric package's names (its rank-zero printers).
        environment_class: the MPI cluster environment of that package.
        adopt: the strategy's own step after a heal, given the state the rule kept.
        loop: how :class:`~.replacement.RunReplacing` reads the frontend's loop at a let-in.
        loaders: the strategy's :class:`~.sharding.LoaderSharding` (``None``: the loaders are the
            user's, as under Fabric).
    """

    def __init__(
        self,
        rule: Rule | None,
        options: dict[str, Any],
        fabric: FabricAPI,
        environment_class: Callable[[], Any],
        adopt: Callable[[dict[str, Any] | None], None],
        loop: LoopAccess,
        loaders: Any | None = None,
    ) -> None:
        rule = check_rule(rule) or DEFAULT_RULE()
        self._options = CommonOptions(**options)
        RunHealing.require(self.options.heal)  # the fix named before any collective
        self.aids = ConvergenceAids(
            self.options.lr_scaling,
            self.options.warmup_steps,
            self.options.implicit_momentum_correction,
            rule,
            fabric.rank_zero_info,
            fabric.rank_zero_warn,
        )
        self.environment = environment_class()  # the first collective: every argument is checked above
        self.runner = RuleRunner(rule, healing=self.options.heal is not None)
        self.failures = RunFailures(
            self.environment.comm,
            self.global_rank,
            self.world_size,
            self.options.collective_timeout,
            self.options.abort_on_exception,
            on_abandon=self.runner.abandon,
        )
        self.healing = RunHealing(
            self.options.heal,
            self.options.min_ranks,
            self.failures,
            self.environment,
            bound=lambda: self.runner.bound if self.runner.live else None,
            adopt=adopt,
            abandon=self.runner.abandon,
            rule_name=rule.name,
        )
        self.optimizer_sharding = OptimizerSharding(mirror=self.healing.active)
        self.replacing = RunReplacing(
            self.healing, self.failures, self.environment, self.runner, loaders, adopt, CHECKPOINT_KEY, loop
        )
        self.collectives = RunCollectives(self.failures, self.healing, self.replacing)

    # -- what the user reads and sets on the strategy (its CoreAttributes) ---------------------------------
    @property
    def options(self) -> CommonOptions:
        """The options every strategy takes, as checked (:class:`.common_options.CommonOptions`)."""
        return self._options

    @property
    def rule(self) -> Rule:
        """The rule's hyperparameters."""
        return self.runner.rule

    @property
    def bound_rule(self) -> BoundRule | None:
        """The running rule while training (None before it is bound; after training, the closed one
        under the Trainer, None after Fabric's ``finish_training``)."""
        return self.runner.bound

    @property
    def transport(self) -> Transport:
        """The current run's MPI transport (a fresh one after a failed run)."""
        return self.failures.transport

    @property
    def collective_timeout(self) -> float | None:
        """Seconds any collective may wait (``None``: forever); setting it applies to the current run."""
        return self.failures.timeout

    @collective_timeout.setter
    def collective_timeout(self, value: float | None) -> None:
        self.failures.timeout = check_one(CommonOptions, "collective_timeout", value)

    @property
    def abort_on_exception(self) -> bool:
        """``True``: a failing rank calls ``MPI_Abort`` at once (see :mod:`.failures`)."""
        return self.failures.abort_on_exception

    # the convergence aids' options (:mod:`.convergence`)
    lr_scaling = property(lambda self: self.options.lr_scaling, doc="The ``lr_scaling`` option.")
    warmup_steps = property(lambda self: self.options.warmup_steps, doc="The ``warmup_steps`` option.")
    implicit_momentum_correction = property(
        lambda self: self.options.implicit_momentum_correction, doc="The ``implicit_momentum_correction`` option."
    )

    def stats(self) -> dict[str, float]:
        """The rule's numbers for the last step (``mpi/<rule>/...``, world size > 1), the convergence
        aids' values and the heals' (``mpi/heal/...``)."""
        return {**self.runner.stats(self.world_size), **self.aids.stats, **self.healing.stats}

    def propagate_errors(self) -> AbstractContextManager[None]:
        """A block whose exceptions fail the run on every rank (see :mod:`.failures`)."""
        return self.failures.propagate_errors()

    def check_peers(self) -> None:
        """Raise another rank's failure here (one ``Iprobe``; under ``heal``, heal here)."""
        self.healing.between("the error channel", self.failures.check_peers, None)

    # -- where this rank lives -----------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return int(self.environment.global_rank())

    @property
    def world_size(self) -> int:
        return int(self.environment.world_size())

    @property
    def num_nodes(self) -> int:
        return int(self.environment.num_nodes)

    def refuse_num_nodes(self, value: int) -> None:
        """A ``num_nodes`` flag that MPI's node count contradicts raises ``ValueError``."""
        check_num_nodes(value, self.environment)

    def devices(self, parallel_devices: Sequence[torch.device] | None, accelerator: Any) -> list[Any] | None:
        """The frontend's ``parallel_devices`` (from ``devices=``), refused where MPI contradicts it,
        one device per rank on this host."""
        return checked_parallel_devices(parallel_devices, accelerator, self.environment)

    def device(self, parallel_devices: Sequence[torch.device] | None, local_rank: int) -> torch.device:
        """Rank ``r``'s device: ``local_rank % devices_on_this_host`` (the CPU without devices); after a
        heal, the one it had."""
        return rank_device(parallel_devices, device_local_rank(self.environment, local_rank))

    def abort_when_uncaught(self) -> None:
        """With other ranks, an exception nobody catches aborts them all (:func:`.failures.install_abort_hook`)."""
        if self.world_size > 1:
            install_abort_hook(self.global_rank, self.world_size)

    # -- the rule --------------------------------------------------------------------------------------------
    def bind(self, module: torch.nn.Module) -> BoundRule:
        """The rule (as the aids correct it) bound to ``module``'s trainable parameters on this run."""
        return self.runner.bind(self.transport, module, self.aids.rule_to_bind(self.world_size))

    def rebind(
        self, state: dict[str, Any] | None, module: torch.nn.Module | None, optimizers: Sequence[Optimizer]
    ) -> None:
        """After a heal (the strategy's ``adopt``): the rule bound again to ``module`` on the healed
        run with the kept ``state``, and a sharded optimizer rebuilt on it (nothing without a state
        or a module)."""
        if state is None or module is None:
            return
        bound = self.runner.rebind(self.transport, module, self.aids.rule_to_bind(self.world_size), state)
        if self.optimizer_sharding.active:  # ZeRO: the optimizer state rebuilt from shards and mirrors
            self.optimizer_sharding.attach(bound, optimizers)

    def end_training(self) -> None:
        """The rule's ``on_train_end``: its consensus weights in the module (collective for the
        asynchronous rules; under ``heal`` redone over the survivors of a loss there), after a spawn
        still in flight (``heal="replace"``) was given up."""
        self.replacing.end()
        if self.runner.bound is not None:
            self.runner.bound.healable_train_end(self.healing)

    def optimizer_state(self, optimizer: Optimizer, lightnings: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """This rank's shard when ``optimizer`` is sharded, else ``lightnings()`` (the frontend's)."""
        if self.optimizer_sharding.owns(optimizer):
            return self.optimizer_sharding.optimizer_state()
        return lightnings()

    def save_through_heals(self, target: Any, save: Callable[[dict[str, Any] | None], None]) -> None:
        """A checkpoint save (:func:`.checkpoint_io.save_through_heals`): ``save(rule_state)`` on
        every rank with the rule's state as bound now (a heal rebinds it; ``None``: no rule bound), then
        a barrier, local while a replacement catches up."""
        save_through_heals(
            self.healing,
            lambda: save(self.runner.checkpoint(self.world_size)),
            self._save_barrier,
            target,
            lambda: self.global_rank == 0,
        )

    def _save_barrier(self) -> None:
        if not self.replacing.catching_up:  # a replacement's start-up: the survivors are past it
            barrier(self.transport)


class CoreAttribute:
    """A strategy attribute that is its :class:`StrategyCore`'s attribute of the same name, with its
    docstring, settable where the core's is. The strategy holds its core as ``_core``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._settable = getattr(getattr(StrategyCore, name), "fset", None) is not None
        self.__doc__ = getattr(StrategyCore, name).__doc__

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        if strategy is None:
            return self
        return getattr(strategy._core, self._name)

    def __set__(self, strategy: Any, value: Any) -> None:
        if not self._settable:
            raise AttributeError(f"property {self._name!r} of {type(strategy).__name__!r} object has no setter")
        setattr(strategy._core, self._name, value)
