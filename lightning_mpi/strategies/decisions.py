"""Stop decisions without per-step barriers, for the asynchronous Trainer strategies.

Lightning asks collective questions during training: ``Timer(max_time=...)`` broadcasts a stop
flag from rank 0 after every batch, and ``EarlyStopping`` reduces a stop decision. As collectives
they would make every fast rank wait for the slowest, every step, and the asynchronous rules
would lose their speed-up. While the rule trains, a *bool* broadcast and
``reduce_boolean_decision`` therefore go through the rule's one-sided
:class:`~lightning_mpi.comm.window.DecisionBoard` instead: the deciding rank raises a sticky flag,
the others see it the next time they ask. Every rank still stops (the flag never goes down), and
nobody waits for anybody, so nothing hangs; ranks may stop a few steps apart, and
``on_train_end`` then brings them to the center (or the gossip consensus).

Checkpoint callbacks also ask bool questions while training ("does this file exist on any rank?",
"skip this time-based save?", "is this the best score?"). They are not stop votes: a sticky flag
would answer every later question with its first True. Checkpoints are collective anyway (every
rank saves at the same step), so their questions stay collective. The protocol is explicit:
:meth:`StopDecisions.collective_decisions` is a scope in which every decision is a collective, and
while the rule trains every hook of the trainer's checkpoint callbacks runs inside it.
Non-bool broadcasts and calls outside training are always collective.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning_mpi.comm.window import DecisionBoard
from lightning_mpi.rules.base import BoundRule


class StopDecisions:
    """Where Lightning's bool decisions are answered while an asynchronous rule trains (module docstring).

    Args:
        callback_class: the Lightning package's ``Callback`` (its hook names are the ones scoped).
    """

    def __init__(self, callback_class: type) -> None:
        self._callback_class = callback_class
        self._collective_depth = 0  # how deep the current call is in collective_decisions scopes
        self._scoped_hooks: list[tuple[Any, str]] = []

    @contextmanager
    def collective_decisions(self) -> Generator[None, None, None]:
        """Inside this scope, bool broadcasts and ``reduce_boolean_decision`` are collectives."""
        self._collective_depth += 1
        try:
            yield
        finally:
            self._collective_depth -= 1

    def board(self, bound: BoundRule | None) -> DecisionBoard | None:
        """The board for stop votes, or ``None`` when the answer must be a collective (in a
        collective scope, or when no rule with a board is training)."""
        if self._collective_depth or bound is None or not bound.training:
            return None
        return bound.board

    # -- the checkpoint callbacks' hooks run in a collective scope while the rule trains ------------
    def scope_checkpoint_hooks(self, trainer: Any) -> None:
        """Run each Lightning hook of the trainer's checkpoint callbacks inside
        :meth:`collective_decisions` (instance attributes over the class's methods;
        :meth:`unscope_hooks` removes them)."""
        for callback in getattr(trainer, "checkpoint_callbacks", []) if trainer is not None else []:
            for name in vars(self._callback_class):
                if not name.startswith("on_") or name in vars(callback):
                    continue
                method = getattr(callback, name)

                @functools.wraps(method)
                def in_collective_scope(*args: Any, _hook: Any = method, **kwargs: Any) -> Any:
                    with self.collective_decisions():
                        return _hook(*args, **kwargs)

                setattr(callback, name, in_collective_scope)
                self._scoped_hooks.append((callback, name))

    def unscope_hooks(self) -> None:
        for callback, name in self._scoped_hooks:
            callback.__dict__.pop(name, None)
        self._scoped_hooks = []
