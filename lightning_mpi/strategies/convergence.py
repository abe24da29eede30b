"""Opt-in convergence aids: learning-rate scaling with warm-up, and implicit-momentum correction.

Nothing happens with their defaults. When switched on they change the optimizer's param groups
for the update only (see :mod:`lightning_mpi.lr_scaling`), and rank 0 says once per fit what they
do. ``lr_scaling`` and ``warmup_steps`` are on every strategy; ``implicit_momentum_correction`` on the
asynchronous ones. A strategy holds one :class:`ConvergenceAids` and asks it, around each update,
for the :class:`~lightning_mpi.lr_scaling.StepOverrides` to apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_mpi.lr_scaling import (
    StepOverrides,
    corrected_momentum,
    describe_lr_scaling,
    get_momentum,
    implicit_momentum,
    lr_factor,
)
from lightning_mpi.rules.base import Rule


class ConvergenceAids:
    """``lr_scaling``, ``warmup_steps`` and ``implicit_momentum_correction`` (documented on the strategies).

    Args:
        lr_scaling, warmup_steps, implicit_momentum_correction: the strategy's options (already checked).
        rule: the strategy's rule; ``implicit_momentum_correction`` needs an asynchronous one, and corrects
            the rule's own momentum when it has one (EAMSGD's δ).
        info, warn: rank-zero printers of the Lightning package in use.

    Raises:
        ValueError: ``implicit_momentum_correction=True`` with a synchronous rule.
    """

    def __init__(
        self,
        lr_scaling: str | None,
        warmup_steps: int,
        implicit_momentum_correction: bool,
        rule: Rule,
        info: Callable[..., Any],
        warn: Callable[..., Any],
    ) -> None:
        if implicit_momentum_correction and not rule.asynchronous:
            raise ValueError(
                f"implicit_momentum_correction=True needs an asynchronous rule (it removes the implicit momentum that "
                f"asynchrony adds), but {type(rule).__name__} is synchronous: pass implicit_momentum_correction=False"
            )
        self.lr_scaling = lr_scaling
        self.warmup_steps = warmup_steps
        self.implicit_momentum_correction = implicit_momentum_correction
        self.rule = rule
        self._info, self._warn = info, warn
        #: what the aids did in the last update, for the logger (``mpi/lr_scale``, ``mpi/momentum_*``)
        self.stats: dict[str, float] = {}
        if warmup_steps and lr_scaling is None:
            warn(
                f"lightning_mpi: warmup_steps={warmup_steps} has no effect with lr_scaling=None (there is no factor "
                "to warm up to); set lr_scaling='linear' or 'sqrt'. ModelAveragingStrategy's synchronous warm-up is "
                "sync_warmup_steps.",
                category=UserWarning,
            )

    def _rule_momentum(self) -> float | None:
        """The asynchronous rule's own momentum (EAMSGD's δ: the rule contract's ``own_momentum``),
        or None when it has none."""
        return self.rule.own_momentum if self.rule.asynchronous else None

    def _rule_has_momentum(self) -> bool:
        return self._rule_momentum() is not None

    def rule_to_bind(self, world_size: int) -> Rule:
        """The rule to train with: with ``implicit_momentum_correction``, a rule with its own momentum runs on
        a corrected copy; :attr:`rule` keeps the user's value (a later fit, or a resume at another
        W, starts from it)."""
        momentum = self._rule_momentum()
        if not self.implicit_momentum_correction or momentum is None:
            return self.rule
        return self.rule.with_momentum(corrected_momentum(momentum, world_size))

    def overrides(self, optimizer: Optimizer, world_size: int, step: int) -> StepOverrides | None:
        """What to change in the param groups for this update (optimizer step ``step``), or None
        when nothing is opted in."""
        implicit = None
        if self.implicit_momentum_correction and not self._rule_has_momentum():
            # a rule with its own momentum (EAMSGD's δ) is corrected at bind time instead
            implicit = implicit_momentum(world_size)
        if self.lr_scaling is None and implicit is None:
            return None
        factor = lr_factor(self.lr_scaling, world_size, step, self.warmup_steps)
        return StepOverrides(
            optimizer, lr_factor=factor, implicit=implicit or 0.0, correct_momentum=implicit is not None
        )

    def record(self, overrides: StepOverrides) -> None:
        """Keep what ``overrides`` applied in :attr:`stats`."""
        if self.lr_scaling is not None:
            self.stats["mpi/lr_scale"] = overrides.lr_factor
        if overrides.correct_momentum and overrides.momentum_used is not None:
            self.stats["mpi/momentum_explicit"] = overrides.momentum_used[1]
            self.stats["mpi/momentum_implicit"] = overrides.implicit

    def announce(self, world_size: int, optimizers: Sequence[Optimizer]) -> None:
        """Rank 0 says, once per fit, what the aids do; they never act silently."""
        if self.lr_scaling is not None:
            self._info(f"lightning_mpi: {describe_lr_scaling(self.lr_scaling, world_size, self.warmup_steps)}")
        if self.implicit_momentum_correction:
            self._announce_momentum(world_size, optimizers)

    def _announce_momentum(self, world_size: int, optimizers: Sequence[Optimizer]) -> None:
        implicit = implicit_momentum(world_size)
        owner, values = self._momentum_values(optimizers)
        head = (
            f"lightning_mpi: implicit_momentum_correction: {world_size} asynchronous workers add an implicit momentum "
            f"of 1 - 1/W = {implicit:.4g} (Mitliagkas et al. 2016)"
        )
        if not values:
            self._warn(f"{head}, but {owner} has no momentum to correct: nothing changed.", category=UserWarning)
            return
        corrected = [corrected_momentum(mu, world_size) for mu in values]
        pairs = ", ".join(f"{mu:.4g} -> {c:.4g}" for mu, c in sorted(set(zip(values, corrected, strict=True))))
        self._info(f"{head}; {owner} momentum {pairs} (logged as mpi/momentum_explicit, mpi/momentum_implicit)")
        if self._rule_has_momentum():  # fixed for the whole fit; the optimizer's is recorded per update
            self.stats["mpi/momentum_explicit"] = corrected[0]
            self.stats["mpi/momentum_implicit"] = implicit
        if any(c == 0.0 for c in corrected):
            self._warn(
                f"lightning_mpi: implicit_momentum_correction clamped the explicit momentum to 0: {owner} momentum "
                f"{min(values):.4g} is below the implicit momentum {implicit:.4g} of {world_size} asynchronous "
                "workers, so asynchrony alone already supplies more momentum than asked for. Use fewer workers, a "
                "higher momentum, or implicit_momentum_correction=False.",
                category=UserWarning,
            )

    def _momentum_values(self, optimizers: Sequence[Optimizer]) -> tuple[str, list[float]]:
        """Who owns the corrected momentum (``"SGD"``, ``"EAMSGDRule"``), and its nonzero values at train start."""
        rule_momentum = self._rule_momentum()
        if rule_momentum is not None:
            return type(self.rule).__name__, [rule_momentum] if rule_momentum > 0 else []
        owner = "/".join(sorted({type(opt).__name__ for opt in optimizers})) or "the optimizer"
        values = [
            mu for opt in optimizers for group in opt.param_groups if (mu := get_momentum(group)) is not None and mu
        ]
        return owner, values
