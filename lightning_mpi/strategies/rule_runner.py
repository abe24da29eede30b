"""The rule's lifecycle on this rank: its hyperparameters, the running (bound) rule, its saved state.

A strategy holds one :class:`RuleRunner`. The rule is bound to the trainable parameters when
training starts (a state restored from a checkpoint before that is kept and loaded then), paused
while gradients accumulate, closed at teardown, and dropped without a collective when a run is
abandoned after a failure. A checkpoint saved after training ended (after ``fit``, after Fabric's
``finish_training``) holds the state the rule ended with, as one saved during training does, until
the rule is bound again.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_mpi.comm.resources import keep_pending
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.base import BoundRule, Rule

#: Key of the rule's state in a checkpoint dictionary (what :meth:`RuleRunner.checkpoint` returns).
CHECKPOINT_KEY = "lightning_mpi"


class RuleRunner:
    """Binds, pauses, checkpoints and closes one rule (module docstring).

    Args:
        rule: the hyperparameters; :attr:`bound` is their running part while it exists.
        healing: the strategy heals lost ranks (``heal``): every binding is told so
            (:attr:`~lightning_mpi.rules.base.BoundRule.healing`).
    """

    def __init__(self, rule: Rule, healing: bool = False) -> None:
        self.rule = rule
        self.healing = healing
        self.bound: BoundRule | None = None
        self.live = False  # bound and not closed since
        self._pending_state: dict[str, Any] | None = None
        self._ended: BoundRule | None = None  # :meth:`end`'s binding, for checkpoints until the next bind

    def bind(self, transport: Transport, module: torch.nn.Module, rule: Rule | None = None) -> BoundRule:
        """Bind ``rule`` (default: :attr:`rule`) to the module's trainable parameters, closing a
        previous binding first, and load a state restored before it was bound."""
        self.close()
        self._ended = None
        params = [p for p in module.parameters() if p.requires_grad]
        self.bound = (rule or self.rule).bind(transport, params)
        self.bound.healing = self.healing
        self.live = True
        if self._pending_state is not None:
            self.bound.load_state_dict(self._pending_state)
            self._pending_state = None
        return self.bound

    def rebind(
        self, transport: Transport, module: torch.nn.Module, rule: Rule | None, state: dict[str, Any]
    ) -> BoundRule:
        """After a heal: bind again on the healed run's ``transport`` and load ``state`` (what the
        abandoned binding kept: its :meth:`~lightning_mpi.rules.base.BoundRule.heal_state`); a rule that
        was training starts again (``on_train_start``), since the survivors hold the same weights
        where it keeps them so."""
        # the rule says when (GoSGD: wherever its fit was, so that its survivors agree)
        training = self.bound is not None and self.bound.restart_after_heal
        self.bound = None  # abandoned already: nothing to close
        self._pending_state = state
        bound = self.bind(transport, module, rule)
        if training:
            bound.on_train_start()
        return bound

    def close(self) -> None:
        """Release the bound rule's threads, windows and requests (safe to call twice, or when none
        is bound). The closed rule stays readable as :attr:`bound` (its ``stats()``) until the next
        :meth:`bind`."""
        if self.bound is not None:
            self.bound.close()
        self.live = False

    def end(self) -> None:
        """Close the binding and stop running it (Fabric's ``finish_training``): :attr:`bound` is
        None from now on, but :meth:`checkpoint` still saves the state the rule ended with (the
        center, the clocks, the outer momentum), until the next :meth:`bind`."""
        self.close()
        if self.bound is not None:
            self._ended, self.bound = self.bound, None

    def abandon(self) -> None:
        """Drop the bound rule of a failed run without a collective.

        Its buffers may be the targets of operations still in flight (a one-sided get, a posted
        receive) that MPI can complete at any later progress: they are kept for the life of the
        process, or MPI would write into freed memory.
        """
        if self.bound is not None:
            keep_pending(self.bound)
        self._ended = None  # its state reads the failed run's transport
        self.close()

    @contextmanager
    def paused(self) -> Generator[None, None, None]:
        """While gradients accumulate without an update, the rule's gradient hooks start no exchange
        (``sync_enabled`` off); the backward of the step that updates exchanges."""
        bound = self.bound
        if bound is None:
            yield
            return
        previous, bound.sync_enabled = bound.sync_enabled, False
        try:
            yield
        finally:
            bound.sync_enabled = previous

    def stats(self, world_size: int) -> dict[str, float]:
        """The bound rule's numbers for the last step as ``mpi/<rule>/<name>`` (none at world size 1,
        where nothing is exchanged)."""
        if self.bound is None or world_size == 1:
            return {}
        return {f"mpi/{self.rule.name}/{key}": value for key, value in self.bound.stats().items()}

    def checkpoint(self, world_size: int) -> dict[str, Any] | None:
        """The rule's state for a checkpoint (after training: the state it ended with, see
        :meth:`end`), or None when no rule was bound. Called on every rank: a rule with sharded
        state gathers it here."""
        bound = self.bound if self.bound is not None else self._ended
        if bound is None:
            return None
        return {"rule": type(self.rule).__name__, "state": bound.state_dict(), "world_size": world_size}

    def restore(self, saved: dict[str, Any] | None, world_size: int) -> None:
        """Load what :meth:`checkpoint` saved: now if the rule is bound, else when it is bound."""
        if saved is None:
            return
        if saved.get("world_size") != world_size:
            warnings.warn(
                f"lightning_mpi: checkpoint was written at world size {saved.get('world_size')}, "
                f"resuming at {world_size}; sharded rule state is re-sharded.",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.bound is not None:
            self.bound.load_state_dict(saved["state"])
        else:
            self._pending_state = saved["state"]
