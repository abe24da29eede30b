"""Convergence aids, as pure functions: learning-rate scaling with warm-up, and implicit-momentum correction.

Nothing here knows Lightning; the strategies
(:class:`~lightning_mpi.strategies.convergence.ConvergenceAids`) call it around each optimizer
update. Both aids are opt-in and announced: Horovod's Lightning strategy scaled the learning rate
silently (Lightning issue #2574), ours never does.

Learning-rate scaling (Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
2017): W ranks averaging their gradients take one step for W·B samples, so the step should grow
with W: ``"linear"`` multiplies the learning rate by W (Goyal et al.'s rule), ``"sqrt"`` by √W (the
variance-preserving rule, gentler, often better for adaptive optimizers). *Gradual warm-up*: the
factor ramps linearly from 1 at optimizer step 0 to the full factor at step ``warmup_steps`` and
stays there:

    factor(s) = 1 + (F − 1) · min(s / warmup_steps, 1)

Implicit-momentum correction (``implicit_momentum_correction``; Mitliagkas, Zhang, Hadjis, Ré,
"Asynchrony begets momentum, with an application to deep learning", 2016): W asynchronous workers
behave like one worker with an *implicit* momentum of about 1 − 1/W on top of the optimizer's
explicit momentum μ. To keep the total where the user tuned it, the explicit momentum is lowered
to ``max(0, μ − (1 − 1/W))``.

Both are applied by :class:`StepOverrides` for the duration of one update only, so the optimizer's
``param_groups`` hold the user's values everywhere else: LR schedulers (and momentum-cycling ones
like ``OneCycleLR``) keep working on them, and checkpoints store them (a resume at another world
size scales and corrects afresh).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

#: Allowed values of ``lr_scaling``.
LR_SCALINGS: tuple[str | None, ...] = ("linear", "sqrt", None)


# -- validation -------------------------------------------------------------------------------------
def check_lr_scaling(lr_scaling: Any) -> None:
    """Raise ``ValueError`` naming the argument, its value and the allowed values."""
    if lr_scaling not in LR_SCALINGS or isinstance(lr_scaling, bool):
        raise ValueError(f"lr_scaling={lr_scaling!r} is not allowed: choose one of {list(LR_SCALINGS)}")


# -- learning rate ----------------------------------------------------------------------------------
def scale_factor(lr_scaling: str | None, world_size: int) -> float:
    """The full learning-rate factor for ``world_size`` ranks: W (linear), √W (sqrt) or 1 (None)."""
    check_lr_scaling(lr_scaling)
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is out of range: it must be >= 1")
    if lr_scaling == "linear":
        return float(world_size)
    if lr_scaling == "sqrt":
        return math.sqrt(world_size)
    return 1.0


def warmup_factor(full: float, step: int, warmup_steps: int) -> float:
    """Goyal et al.'s gradual warm-up: 1 at ``step`` 0, ``full`` from ``step == warmup_steps`` on."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return float(full)
    return 1.0 + (full - 1.0) * max(step, 0) / warmup_steps


def lr_factor(lr_scaling: str | None, world_size: int, step: int, warmup_steps: int = 0) -> float:
    """The factor applied to every learning rate at optimizer step ``step`` (0-based)."""
    return warmup_factor(scale_factor(lr_scaling, world_size), step, warmup_steps)


def describe_lr_scaling(lr_scaling: str | None, world_size: int, warmup_steps: int) -> str:
    """The line rank 0 prints at train start, e.g. ``lr_scaling='linear': learning rates x4
    (world size 4), reached after 100 warm-up steps``."""
    full = scale_factor(lr_scaling, world_size)
    rule = "√W" if lr_scaling == "sqrt" else "W"
    text = f"lr_scaling={lr_scaling!r}: learning rates x{full:.4g} ({rule}, world size {world_size})"
    if full == 1.0:
        return text + ": nothing to scale"
    if warmup_steps:
        return text + f", reached after {warmup_steps} warm-up steps (linear ramp from x1, Goyal et al. 2017)"
    return text + ", from the first step (no warm-up)"


# -- momentum ---------------------------------------------------------------------------------------
def implicit_momentum(world_size: int) -> float:
    """Momentum that asynchrony adds with ``world_size`` workers: 1 − 1/W (Mitliagkas et al. 2016)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is out of range: it must be >= 1")
    return 1.0 - 1.0 / world_size


def corrected_momentum(momentum: float, world_size: int) -> float:
    """The explicit momentum to use so that explicit + implicit stays at ``momentum``: max(0, μ − (1 − 1/W))."""
    return max(0.0, float(momentum) - implicit_momentum(world_size))


def momentum_key(group: dict[str, Any]) -> str | None:
    """Where a param group keeps its momentum: ``"betas"`` (Adam family: β₁), ``"momentum"`` (SGD,
    RMSprop), or ``None`` (no momentum at all, e.g. Adagrad)."""
    if isinstance(group.get("betas"), (tuple, list)) and len(group["betas"]) >= 1:
        return "betas"
    if "momentum" in group:
        return "momentum"
    return None


def get_momentum(group: dict[str, Any]) -> float | None:
    """The group's explicit momentum (SGD ``momentum``, Adam ``betas[0]``), ``None`` when it has none."""
    key = momentum_key(group)
    if key is None:
        return None
    value = group["betas"][0] if key == "betas" else group["momentum"]
    return float(value)


def set_momentum(group: dict[str, Any], value: float) -> None:
    key = momentum_key(group)
    if key == "betas":
        betas = group["betas"]
        group["betas"] = type(betas)((value, *betas[1:])) if isinstance(betas, tuple) else [value, *betas[1:]]
    elif key == "momentum":
        group["momentum"] = value


# -- applying both around one update ------------------------------------------------------------------
class StepOverrides:
    """Set every param group's lr to ``lr × lr_factor`` and, with ``correct_momentum``, its explicit
    momentum to ``max(0, μ − implicit)`` for one optimizer update; put the user's values back after.

    Usage around ``optimizer.step(closure)``::

        overrides = StepOverrides(optimizer, lr_factor=3.0)
        with overrides:                                   # applied here ...
            optimizer.step(overrides.wrap_closure(closure))
        # ... and the user's values are back, also when the step raised or was abandoned

    The optimizer may call the closure (forward and backward) from inside ``step``: SGD and Adam do
    it before they read the learning rate, LBFGS after. :meth:`wrap_closure` therefore shows the
    closure the user's values and re-applies the overrides when it returns, so whichever moment the
    optimizer reads them, the *update* sees the overridden values and user code does not. Values
    the user (or a scheduler) sets inside the closure are the ones overridden afterwards.
    """

    def __init__(
        self, optimizer: Any, lr_factor: float = 1.0, implicit: float = 0.0, correct_momentum: bool = False
    ) -> None:
        self.optimizer = optimizer
        self.lr_factor = float(lr_factor)
        self.implicit = float(implicit)
        self.correct_momentum = correct_momentum
        # (group, its lr, where it keeps its momentum, that momentum) as the user set them
        self._saved: list[tuple[dict[str, Any], Any, str | None, Any]] | None = None
        #: The first momentum-carrying group's (user value, value used) in the last application.
        self.momentum_used: tuple[float, float] | None = None
        #: True when some group's momentum was clamped to 0 in the last application.
        self.clamped = False

    @property
    def active(self) -> bool:
        return self._saved is not None

    def apply(self) -> None:
        if self._saved is not None:
            return
        saved = []
        self.clamped = False
        self.momentum_used = None
        for group in self.optimizer.param_groups:
            key = momentum_key(group) if self.correct_momentum else None
            saved.append((group, group.get("lr"), key, group[key] if key else None))
            if self.lr_factor != 1.0 and "lr" in group:
                group["lr"] = group["lr"] * self.lr_factor
            if key is not None:
                mu = get_momentum(group)
                assert mu is not None
                if mu == 0.0:
                    continue
                used = max(0.0, mu - self.implicit)
                self.clamped = self.clamped or used == 0.0
                if self.momentum_used is None:
                    self.momentum_used = (mu, used)
                set_momentum(group, used)
        self._saved = saved

    def restore(self) -> None:
        if self._saved is None:
            return
        for group, lr, key, momentum in self._saved:
            if lr is not None:
                group["lr"] = lr
            if key is not None:
                group[key] = momentum
        self._saved = None

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def unscaled_closure(*args: Any, **kwargs: Any) -> Any:
            self.restore()
            result = closure(*args, **kwargs)
            self.apply()  # not on an exception: the step is abandoned and __exit__ has nothing to undo
            return result

        return unscaled_closure

    def __enter__(self) -> StepOverrides:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()
