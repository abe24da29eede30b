"""Strategies for the elastic, model-averaging, parameter-server and gossip rules.

Each class is an :class:`~lightning_mpi.strategy.MPIStrategy` with typed, documented
constructor arguments (so ``LightningCLI`` can set them) that builds one rule.

The asynchronous strategies (parameter server, gossip) also answer Lightning's own per-step
collectives without a barrier. ``Timer(max_time=...)`` broadcasts a stop flag from rank 0 after
every batch and ``EarlyStopping`` reduces a stop decision; as collectives they would make every
fast rank wait for the slowest, every step. While training runs, a *bool* broadcast from rank 0
and ``reduce_boolean_decision`` go through a one-sided :class:`~lightning_mpi.comm.window.DecisionBoard`
instead: the deciding rank raises a sticky flag, the others see it the next time they ask.
Every rank still stops (the flag never goes down), and nobody waits for anybody, so nothing
hangs; ranks may stop a few steps apart, and ``on_train_end`` then brings them to the center
(or the gossip consensus). Non-bool broadcasts and calls outside training stay collective.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.plugins import CheckpointIO, Precision

from lightning_mpi.rules.averaging import ModelAveragingRule
from lightning_mpi.rules.base import Rule
from lightning_mpi.rules.easgd import EASGDRule
from lightning_mpi.rules.gossip import GoSGDRule
from lightning_mpi.rules.server import ADAGRule, AEASGDRule, AGNRule, DownpourRule, DynSGDRule, EAMSGDRule
from lightning_mpi.strategy import MPIStrategy


class _RuleStrategy(MPIStrategy):
    def __init__(self, rule: Rule, log_stats: bool, accelerator: Any, checkpoint_io: Any, precision_plugin: Any) -> None:
        super().__init__(rule=rule, log_stats=log_stats, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)


class AsyncMPIStrategy(_RuleStrategy):
    """Base of the asynchronous strategies: stop decisions without per-step barriers."""

    def _board(self) -> Any:
        bound = self._bound
        if bound is not None and getattr(bound, "training", False):
            return getattr(bound, "board", None)
        return None

    def _board_for(self, caller: Any) -> Any:
        """The board for stop decisions, or ``None`` for a collective answer.

        ``ModelCheckpoint`` also asks bool questions while training ("does this file exist on any
        rank?", "skip this time-based save?", "is this the best score?"). They are not stop votes:
        a sticky flag would answer every later question (and every later stop vote) with its
        first True. Checkpoints are collective anyway (every rank saves at the same step, and
        ``Trainer.save_checkpoint`` ends with a barrier), so those calls stay collective.
        """
        from pytorch_lightning.callbacks import ModelCheckpoint

        if isinstance(caller, ModelCheckpoint):
            return None
        return self._board()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        board = self._board_for(sys._getframe(1).f_locals.get("self")) if isinstance(obj, bool) else None
        if board is not None:
            return board.broadcast_flag(obj, src)
        return super().broadcast(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        board = self._board_for(sys._getframe(1).f_locals.get("self"))
        if board is not None:
            return board.reduce_flag(bool(decision), all)
        return super().reduce_boolean_decision(decision, all)


class EASGDStrategy(_RuleStrategy):
    """Synchronous EASGD (Zhang et al. 2015), center replicated on every rank: registered as ``mpi_easgd``.

    Args:
        period: τ, local steps between elastic exchanges (≥ 1); one allreduce per exchange.
        alpha: elastic moving rate α in (0, 1]; ``None`` = 0.9 / world size (Zhang et al.'s β = 0.9).
        log_stats: log exchange time and bytes under ``mpi/easgd/``.
    """

    def __init__(self, period: int = 4, alpha: Optional[float] = None, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(EASGDRule(period=period, alpha=alpha), log_stats, accelerator, checkpoint_io, precision_plugin)


class ModelAveragingStrategy(_RuleStrategy):
    """Periodic model averaging / local SGD: registered as ``mpi_model_avg``.

    Args:
        period: local steps between weight averages (≥ 1).
        warmup_steps: first steps with synchronous gradient averaging (≥ 0).
        log_stats: log exchange time under ``mpi/model_avg/``.
    """

    def __init__(self, period: int = 4, warmup_steps: int = 0, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(ModelAveragingRule(period=period, warmup_steps=warmup_steps), log_stats, accelerator, checkpoint_io, precision_plugin)


class DownpourStrategy(AsyncMPIStrategy):
    """DOWNPOUR against a center sharded over all ranks: registered as ``mpi_downpour``.

    Args:
        period: local steps between commits (≥ 1); default 5 (dist-keras).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        log_stats: log staleness, commits/s, bytes and RMA wait under ``mpi/downpour/``.
    """

    def __init__(self, period: int = 5, progress_interval: float = 5e-4, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(DownpourRule(period=period, progress_interval=progress_interval), log_stats, accelerator, checkpoint_io, precision_plugin)


class AGNStrategy(AsyncMPIStrategy):
    """Accumulated gradient normalization (Hermans 2017): commit delta / period. ``mpi_agn``.

    Args:
        period: local steps between commits (≥ 1); default 3 (AGN divides the delta by it).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        log_stats: log staleness, commits/s, bytes and RMA wait under ``mpi/agn/``.
    """

    def __init__(self, period: int = 3, progress_interval: float = 5e-4, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(AGNRule(period=period, progress_interval=progress_interval), log_stats, accelerator, checkpoint_io, precision_plugin)


class ADAGStrategy(AsyncMPIStrategy):
    """ADAG (Hermans 2017): commit delta / (‖θ̃ − θ̃_pulled‖²/η + 1), global norm. ``mpi_adag``.

    Args:
        period: local steps between commits (≥ 1); default 5 (dist-keras).
        eta: η > 0; default 0.1 (a commit is halved once the center moved by ‖·‖² = η since the pull).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        log_stats: log staleness, commits/s, bytes and RMA wait under ``mpi/adag/``.
    """

    def __init__(self, period: int = 5, eta: float = 0.1, progress_interval: float = 5e-4, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(ADAGRule(period=period, eta=eta, progress_interval=progress_interval), log_stats, accelerator, checkpoint_io, precision_plugin)


class DynSGDStrategy(AsyncMPIStrategy):
    """DynSGD: commit delta / (staleness + 1). ``mpi_dynsgd``.

    Args:
        period: local steps between commits (≥ 1); default 5.
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        log_stats: log staleness, commits/s, bytes and RMA wait under ``mpi/dynsgd/``.
    """

    def __init__(self, period: int = 5, progress_interval: float = 5e-4, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(DynSGDRule(period=period, progress_interval=progress_interval), log_stats, accelerator, checkpoint_io, precision_plugin)


class AEASGDStrategy(AsyncMPIStrategy):
    """Asynchronous EASGD (Zhang et al. 2015) against the sharded center. ``mpi_aeasgd``.

    Args:
        period: τ, local steps between elastic exchanges (≥ 1); default 8.
        alpha: α in (0, 1]; ``None`` = 0.9 / world size.
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        log_stats: log staleness, commits/s, bytes and RMA wait under ``mpi/aeasgd/``.
    """

    def __init__(self, period: int = 8, alpha: Optional[float] = None, progress_interval: float = 5e-4, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(AEASGDRule(period=period, alpha=alpha, progress_interval=progress_interval), log_stats, accelerator, checkpoint_io, precision_plugin)


class EAMSGDStrategy(AsyncMPIStrategy):
    """Asynchronous EASGD with Nesterov momentum (Zhang et al. 2015). ``mpi_eamsgd``.

    Use plain SGD without momentum in ``configure_optimizers``: the rule adds Nesterov momentum.

    Args:
        period: τ (≥ 1); default 8.
        alpha: α in (0, 1]; ``None`` = 0.9 / world size.
        momentum: δ in [0, 1); default 0.9 (dist-keras; Zhang et al. use 0.99).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        log_stats: log staleness, commits/s, bytes and RMA wait under ``mpi/eamsgd/``.
    """

    def __init__(self, period: int = 8, alpha: Optional[float] = None, momentum: float = 0.9, progress_interval: float = 5e-4,
                 log_stats: bool = True, accelerator: Optional["pl.accelerators.Accelerator"] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(EAMSGDRule(period=period, alpha=alpha, momentum=momentum, progress_interval=progress_interval), log_stats, accelerator, checkpoint_io, precision_plugin)


class GoSGDStrategy(AsyncMPIStrategy):
    """GoSGD gossip (Blot et al. 2016): push to a random peer with probability p. ``mpi_gosgd``.

    Args:
        p: probability of a push after each step, in (0, 1]; default 0.1.
        seed: seed of each rank's gossip generator (rank added).
        log_stats: log weight, pushes/s, bytes and time under ``mpi/gosgd/``.
    """

    def __init__(self, p: float = 0.1, seed: int = 0, log_stats: bool = True,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(GoSGDRule(p=p, seed=seed), log_stats, accelerator, checkpoint_io, precision_plugin)
