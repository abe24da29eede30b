"""Opt-in convergence aids for every frontend: learning-rate scaling and momentum correction.

Nothing happens with their defaults. When switched on they change the optimizer's param groups
for the update only (see :mod:`lightning_mpi.lr_scaling`), and rank 0 says once per fit what they do.
:class:`ConvergenceAids` is on every strategy (``lr_scaling``, ``warmup_steps``);
:class:`MomentumCorrection` on the asynchronous ones (``momentum_correction``).
"""
from __future__ import annotations

import copy
from typing import Any, Literal, Optional

from torch.optim import Optimizer

from lightning_mpi.lr_scaling import (
    StepOverrides,
    check_lr_scaling,
    check_warmup_steps,
    corrected_momentum,
    describe_lr_scaling,
    get_momentum,
    implicit_momentum,
    lr_factor,
)
from lightning_mpi.rules.base import Rule


class ConvergenceAids:
    """``lr_scaling`` and ``warmup_steps`` (documented on the strategies).

    Needs ``world_size``, ``rule``, ``optimizers`` and ``_fabric_api`` (rank-zero printing) from the
    strategy; :meth:`_optimizer_step_count` is the frontend's count of optimizer steps.
    """

    world_size: int
    rule: Rule
    _fabric_api: Any

    def _init_aids(self, lr_scaling: Optional[Literal["linear", "sqrt"]], warmup_steps: int) -> None:
        check_lr_scaling(lr_scaling)
        check_warmup_steps(warmup_steps)
        self.lr_scaling = lr_scaling
        self.warmup_steps = warmup_steps
        self._aid_stats: dict[str, float] = {}
        if warmup_steps and lr_scaling is None:
            self._fabric_api.rank_zero_warn(
                f"lightning_mpi: warmup_steps={warmup_steps} has no effect with lr_scaling=None (there is no factor "
                "to warm up to); set lr_scaling='linear' or 'sqrt'. ModelAveragingStrategy's synchronous warm-up is "
                "sync_warmup_steps.",
                category=UserWarning,
            )

    def _optimizer_step_count(self) -> int:
        raise NotImplementedError

    def _announce_convergence_aids(self) -> None:
        """Rank 0 says, once per fit, what the aids do; they never act silently."""
        if self.lr_scaling is not None:
            self._fabric_api.rank_zero_info(
                f"lightning_mpi: {describe_lr_scaling(self.lr_scaling, self.world_size, self.warmup_steps)}"
            )

    def _implicit_momentum(self) -> Optional[float]:
        """Momentum to take off the optimizer's explicit momentum in each update, or None for no
        correction; :class:`MomentumCorrection` sets it."""
        return None

    def _step_overrides(self, optimizer: Optimizer) -> Optional[StepOverrides]:
        """What to change in the param groups for this update, or None when nothing is opted in."""
        implicit = self._implicit_momentum()
        if self.lr_scaling is None and implicit is None:
            return None
        factor = lr_factor(self.lr_scaling, self.world_size, self._optimizer_step_count(), self.warmup_steps)
        return StepOverrides(optimizer, lr_factor=factor, implicit=implicit or 0.0, correct_momentum=implicit is not None)

    def _record_aid_stats(self, overrides: StepOverrides) -> None:
        if self.lr_scaling is not None:
            self._aid_stats["mpi/lr_scale"] = overrides.lr_factor
        if overrides.correct_momentum and overrides.momentum_used is not None:
            self._aid_stats["mpi/momentum_explicit"] = overrides.momentum_used[1]
            self._aid_stats["mpi/momentum_implicit"] = overrides.implicit


class MomentumCorrection(ConvergenceAids):
    """``momentum_correction`` of the asynchronous strategies (documented on ``AsyncMPIStrategy``)."""

    optimizers: Any

    def _init_momentum_correction(self, momentum_correction: bool) -> None:
        if not isinstance(momentum_correction, bool):
            raise ValueError(f"momentum_correction={momentum_correction!r} is not allowed: choose one of [True, False]")
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
        info, warn = self._fabric_api.rank_zero_info, self._fabric_api.rank_zero_warn
        if not values:
            warn(f"{head}, but {owner} has no momentum to correct: nothing changed.", category=UserWarning)
            return
        corrected = [corrected_momentum(mu, self.world_size) for mu in values]
        pairs = ", ".join(f"{mu:.4g} -> {c:.4g}" for mu, c in sorted(set(zip(values, corrected))))
        info(f"{head}; {owner} momentum {pairs} (logged as mpi/momentum_explicit, mpi/momentum_implicit)")
        if self._rule_has_momentum():  # fixed for the whole fit; the optimizer's is recorded per update
            self._aid_stats["mpi/momentum_explicit"] = corrected[0]
            self._aid_stats["mpi/momentum_implicit"] = implicit
        if any(c == 0.0 for c in corrected):
            warn(
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
        optimizers = list(self.optimizers or [])
        owner = "/".join(sorted({type(opt).__name__ for opt in optimizers})) or "the optimizer"
        values = [mu for opt in optimizers for group in opt.param_groups if (mu := get_momentum(group))]
        return owner, values
