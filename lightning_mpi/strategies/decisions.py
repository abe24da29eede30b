"""Stop decisions without per-step barriers, for the asynchronous Trainer strategies.

Lightning asks collective questions during training: ``Timer(max_time=...)`` broadcasts a stop
flag from rank 0 after every batch, and ``EarlyStopping`` reduces a stop decision. As collectives
they would make every fast rank wait for the slowest, every step, and the asynchronous rules
would lose their speed-up. While the rule trains, a *bool* broadcast and
``reduce_boolean_decision`` therefore go through the rule's one-sided
:class:`~lightning_mpi.comm.window.DecisionBoard` instead. The questions are numbered on every rank
alike (Lightning asks them at the same points of every rank's loop), and every rank answers True
from the same question on: the stop is in lockstep, so that no rank runs a batch, a validation or a
metric's sync that another does not (a rank that stopped earlier would meet another rank's
collective with one of its own), and nobody waits for anybody. Ranks run up to
:data:`~lightning_mpi.comm.window.DecisionBoard.LEASE` questions past the decision.

Checkpoint callbacks also ask bool questions while training ("does this file exist on any rank?",
"skip this time-based save?", "is this the best score?"). They are not stop votes: a sticky flag
would answer every later question with its first True. Checkpoints are collective anyway (every
rank saves at the same step), so their questions stay collective. The protocol is explicit:
:meth:`StopDecisions.collective_decisions` is a scope in which every decision is a collective, and
while the rule trains every hook of the trainer's checkpoint callbacks runs inside it.
Non-bool broadcasts and calls outside training are always collective.

After a heal the healed run's rule has a board of its own: the survivors agree on a stop that some
of them had learned (:meth:`StopDecisions.agree_after_heal`), and go on numbering their questions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
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
        self._asked = 0  # questions answered on a board, the same count on every rank
        self._stop_at: int | None = None  # the question every rank stops at, once known

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

    def broadcast(self, board: DecisionBoard, value: bool, src: int) -> bool:
        """Rank ``src``'s stop flag, answered on ``board`` in lockstep (module docstring)."""
        return self._answered(board, lambda index: board.broadcast_flag(value, src, index))

    def reduce(self, board: DecisionBoard, decision: bool, all: bool) -> bool:
        """Every rank's (``all``) or any rank's stop decision, answered on ``board`` in lockstep."""
        return self._answered(board, lambda index: board.reduce_flag(decision, all, index))

    def _answered(self, board: DecisionBoard, ask: Callable[[int], bool]) -> bool:
        if board.stop_at is None and self._stop_at is not None:  # a healed run's board
            board.stop_at = self._stop_at
        answer = ask(self._asked)
        self._asked += 1
        self._stop_at = board.stop_at
        return answer

    def agree_after_heal(self, transport: Any) -> None:
        """After a heal (collective over the survivors): a stop that some survivor had learned holds
        for all of them (every survivor is still before it: nobody passes the stop unknowing)."""
        known = transport.allgather_object(self._stop_at)
        stops = {stop for stop in known if stop is not None}
        self._stop_at = min(stops) if stops else None

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
