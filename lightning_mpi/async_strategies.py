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

They also take ``momentum_correction``: asynchrony with W workers acts like an implicit momentum
of 1 − 1/W (Mitliagkas et al. 2016), so the explicit momentum is lowered by that much for each
update (see :mod:`lightning_mpi.lr_scaling`).

Every class takes the options of :class:`~lightning_mpi.strategy.MPIStrategy` (``log_stats``,
``abort_on_exception``, ``collective_timeout``, ``lr_scaling``, ``warmup_steps``) as keyword
arguments; they are passed on with ``**kwargs``, which ``LightningCLI`` (jsonargparse) resolves, so
``--trainer.strategy.lr_scaling=sqrt`` and ``--print_config`` see them.
"""
from __future__ import annotations

import copy
import sys
from typing import Any, Optional

from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mpi.lr_scaling import corrected_momentum, get_momentum, implicit_momentum
from lightning_mpi.rules.averaging import ModelAveragingRule
from lightning_mpi.rules.base import Rule
from lightning_mpi.rules.easgd import EASGDRule
from lightning_mpi.rules.gossip import GoSGDRule
from lightning_mpi.rules.server import ADAGRule, AEASGDRule, AGNRule, DownpourRule, DynSGDRule, EAMSGDRule
from lightning_mpi.strategy import MPIStrategy


class AsyncMPIStrategy(MPIStrategy):
    """Base of the asynchronous strategies: stop decisions without per-step barriers, and
    optional momentum correction.

    Args:
        rule: the asynchronous rule (the subclasses build it from their arguments).
        momentum_correction: lower the explicit momentum by the implicit momentum 1 − 1/W that W
            asynchronous workers add (Mitliagkas et al. 2016): μ → max(0, μ − (1 − 1/W)). It
            corrects the optimizer's momentum (SGD ``momentum``, Adam-family ``betas[0]``) for each
            update, so schedulers and checkpoints keep your value and a resume at another W
            corrects afresh; for ``mpi_eamsgd`` it corrects the rule's Nesterov momentum δ instead.
            Rank 0 prints both values at train start and logs them as ``mpi/momentum_explicit`` and
            ``mpi/momentum_implicit``; it warns when the correction clamps to 0 or there is no
            momentum to correct.
        **kwargs: the options every strategy takes (see :class:`~lightning_mpi.strategy.MPIStrategy`).
    """

    def __init__(self, rule: Rule, momentum_correction: bool = False, **kwargs: Any) -> None:
        if not isinstance(momentum_correction, bool):
            raise ValueError(f"momentum_correction={momentum_correction!r} is not allowed: choose one of [True, False]")
        super().__init__(rule=rule, **kwargs)
        self.momentum_correction = momentum_correction

    def _rule_has_momentum(self) -> bool:
        return isinstance(getattr(self.rule, "momentum", None), float)

    def _implicit_momentum(self) -> Optional[float]:
        # A rule with its own momentum (EAMSGD's δ) is corrected at bind time instead (_rule_to_bind).
        if self.momentum_correction and not self._rule_has_momentum():
            return implicit_momentum(self.world_size)
        return None

    def _rule_to_bind(self) -> Rule:
        """With ``momentum_correction``, a rule with its own momentum runs on a corrected copy;
        ``self.rule`` keeps the user's value (a later fit, or a resume at another W, starts from it)."""
        if not (self.momentum_correction and self._rule_has_momentum()):
            return self.rule
        rule = copy.copy(self.rule)
        rule.momentum = corrected_momentum(self.rule.momentum, self.world_size)  # type: ignore[attr-defined]
        return rule

    def _announce_convergence_aids(self) -> None:
        super()._announce_convergence_aids()
        if not self.momentum_correction:
            return
        implicit = implicit_momentum(self.world_size)
        owner, values = self._momentum_values()
        head = (f"lightning_mpi: momentum_correction: {self.world_size} asynchronous workers add an implicit momentum "
                f"of 1 - 1/W = {implicit:.4g} (Mitliagkas et al. 2016)")
        if not values:
            rank_zero_warn(f"{head}, but {owner} has no momentum to correct: nothing changed.", category=UserWarning)
            return
        corrected = [corrected_momentum(mu, self.world_size) for mu in values]
        pairs = ", ".join(f"{mu:.4g} -> {c:.4g}" for mu, c in sorted(set(zip(values, corrected))))
        rank_zero_info(f"{head}; {owner} momentum {pairs} (logged as mpi/momentum_explicit, mpi/momentum_implicit)")
        if self._rule_has_momentum():  # fixed for the whole fit; the optimizer's is recorded per update
            self._aid_stats["mpi/momentum_explicit"] = corrected[0]
            self._aid_stats["mpi/momentum_implicit"] = implicit
        if any(c == 0.0 for c in corrected):
            rank_zero_warn(
                f"lightning_mpi: momentum_correction clamped the explicit momentum to 0: {owner} momentum "
                f"{min(values):.4g} is below the implicit momentum {implicit:.4g} of {self.world_size} asynchronous "
                "workers, so asynchrony alone already supplies more momentum than asked for. Use fewer workers, a "
                "higher momentum, or momentum_correction=False.",
                category=UserWarning,
            )

    def _momentum_values(self) -> tuple[str, list[float]]:
        """Who owns the corrected momentum (``"SGD"``, ``"EAMSGDRule"``), and its nonzero values at train start."""
        if self._rule_has_momentum():
            mu = float(self.rule.momentum)  # type: ignore[attr-defined]
            return type(self.rule).__name__, [mu] if mu > 0 else []
        optimizers = self.optimizers or []
        owner = "/".join(sorted({type(opt).__name__ for opt in optimizers})) or "the optimizer"
        values = [mu for opt in optimizers for group in opt.param_groups if (mu := get_momentum(group))]
        return owner, values

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


class EASGDStrategy(MPIStrategy):
    """Synchronous EASGD (Zhang et al. 2015), center replicated on every rank: registered as ``mpi_easgd``.

    Args:
        period: τ, local steps between elastic exchanges (≥ 1); one allreduce per exchange.
        alpha: elastic moving rate α in (0, 1]; ``None`` = 0.9 / world size (Zhang et al.'s β = 0.9).
        **kwargs: the options every strategy takes (see :class:`~lightning_mpi.strategy.MPIStrategy`);
            ``log_stats`` logs exchange time and bytes under ``mpi/easgd/``.
    """

    def __init__(self, period: int = 4, alpha: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(rule=EASGDRule(period=period, alpha=alpha), **kwargs)


class ModelAveragingStrategy(MPIStrategy):
    """Periodic model averaging / local SGD: registered as ``mpi_model_avg``.

    Args:
        period: local steps between weight averages (≥ 1).
        sync_warmup_steps: first steps with synchronous gradient averaging (≥ 0). (Formerly
            ``warmup_steps``, which now means the learning-rate warm-up, as on every strategy.)
        **kwargs: the options every strategy takes (see :class:`~lightning_mpi.strategy.MPIStrategy`);
            ``log_stats`` logs exchange time under ``mpi/model_avg/``.
    """

    def __init__(self, period: int = 4, sync_warmup_steps: int = 0, **kwargs: Any) -> None:
        super().__init__(rule=ModelAveragingRule(period=period, sync_warmup_steps=sync_warmup_steps), **kwargs)


class DownpourStrategy(AsyncMPIStrategy):
    """DOWNPOUR against a center sharded over all ranks: registered as ``mpi_downpour``.

    Args:
        period: local steps between commits (≥ 1); default 5 (dist-keras).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/downpour/``.
    """

    def __init__(self, period: int = 5, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=DownpourRule(period=period, progress_interval=progress_interval), **kwargs)


class AGNStrategy(AsyncMPIStrategy):
    """Accumulated gradient normalization (Hermans 2017): commit delta / period. ``mpi_agn``.

    Args:
        period: local steps between commits (≥ 1); default 3 (AGN divides the delta by it).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/agn/``.
    """

    def __init__(self, period: int = 3, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=AGNRule(period=period, progress_interval=progress_interval), **kwargs)


class ADAGStrategy(AsyncMPIStrategy):
    """ADAG (Hermans 2017): commit delta / (‖θ̃ − θ̃_pulled‖²/η + 1), global norm. ``mpi_adag``.

    Args:
        period: local steps between commits (≥ 1); default 5 (dist-keras).
        eta: η > 0; default 0.1 (a commit is halved once the center moved by ‖·‖² = η since the pull).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/adag/``.
    """

    def __init__(self, period: int = 5, eta: float = 0.1, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=ADAGRule(period=period, eta=eta, progress_interval=progress_interval), **kwargs)


class DynSGDStrategy(AsyncMPIStrategy):
    """DynSGD: commit delta / (staleness + 1). ``mpi_dynsgd``.

    Args:
        period: local steps between commits (≥ 1); default 5.
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/dynsgd/``.
    """

    def __init__(self, period: int = 5, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=DynSGDRule(period=period, progress_interval=progress_interval), **kwargs)


class AEASGDStrategy(AsyncMPIStrategy):
    """Asynchronous EASGD (Zhang et al. 2015) against the sharded center. ``mpi_aeasgd``.

    Args:
        period: τ, local steps between elastic exchanges (≥ 1); default 8.
        alpha: α in (0, 1]; ``None`` = 0.9 / world size.
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/aeasgd/``.
    """

    def __init__(self, period: int = 8, alpha: Optional[float] = None, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=AEASGDRule(period=period, alpha=alpha, progress_interval=progress_interval), **kwargs)


class EAMSGDStrategy(AsyncMPIStrategy):
    """Asynchronous EASGD with Nesterov momentum (Zhang et al. 2015). ``mpi_eamsgd``.

    Use plain SGD without momentum in ``configure_optimizers``: the rule adds Nesterov momentum.

    Args:
        period: τ (≥ 1); default 8.
        alpha: α in (0, 1]; ``None`` = 0.9 / world size.
        momentum: δ in [0, 1); default 0.9 (dist-keras; Zhang et al. use 0.99). With
            ``momentum_correction=True`` the rule runs with max(0, δ − (1 − 1/W)).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/eamsgd/``.
    """

    def __init__(self, period: int = 8, alpha: Optional[float] = None, momentum: float = 0.9,
                 progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=EAMSGDRule(period=period, alpha=alpha, momentum=momentum, progress_interval=progress_interval), **kwargs)


class GoSGDStrategy(AsyncMPIStrategy):
    """GoSGD gossip (Blot et al. 2016): push to a random peer with probability p. ``mpi_gosgd``.

    Args:
        p: probability of a push after each step, in (0, 1]; default 0.1.
        seed: seed of each rank's gossip generator (rank added).
        **kwargs: ``momentum_correction`` (see :class:`AsyncMPIStrategy`) and the options every
            strategy takes; ``log_stats`` logs weight, pushes/s, bytes and time under ``mpi/gosgd/``.
    """

    def __init__(self, p: float = 0.1, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(rule=GoSGDRule(p=p, seed=seed), **kwargs)
