"""Stop decisions without per-step barriers, for the asynchronous Trainer strategies.

Lightning asks collective questions during training: ``Timer(max_time=...)`` broadcasts a stop
flag from rank 0 after every batch, and ``EarlyStopping`` reduces a stop decision. As collectives
they would make every fast rank wait for the slowest, every step, and the asynchronous rules
would lose their speed-up. While the rule trains, a *bool* broadcast and
``reduce_boolean_decision`` therefore go through the rule's one-sided
:class:`~lightning_mpi.comm.window.DecisionBoard` instead. The questions are numbered on every rank
alike (Lightning asks them at the same points of every rank's loop), and each comes with the number
of Lightning collectives the rank has run (:attr:`~.run_collectives.RunCollectives.count`). Every
rank stops with the same collectives behind it, so that no rank runs a validation or a metric's
sync that another does not (a rank that stopped earlier would meet another rank's collective with
one of its own), and nobody waits for anybody: the fastest rank runs up to
:data:`~lightning_mpi.comm.window.DecisionBoard.LEASE` questions past the decision, and a straggler
stops soon after it learns the decision, without catching up on the batches the fastest rank ran.

Checkpoint callbacks also ask bool questions while training ("does this file exist on any rank?",
"skip this time-based save?", "is this the best score?"). They are not stop votes: a sticky flag
would answer every later question with its first True. Checkpoints are collective anyway (every
rank saves at the same step), so their questions stay collective. The protocol is explicit:
:meth:`StopDecisions.collective_decisions` is a scope in which every decision is a collective, and
while the rule trains every hook of the trainer's checkpoint callbacks runs inside it.
Non-bool broadcasts and calls outside training are always collective.

After a heal the healed run's rule has a board of its own: if some survivor had learned of a stop,
every survivor stops at its next question (:meth:`StopDecisions.agree_after_heal`): they heal
between the same two collectives, so they stop with the same collectives behind them.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import zlib
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from lightning_mpi.comm.window import DecisionBoard
from lightning_mpi.rules.base import BoundRule

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _site() -> int:
    """Where in the training loop a question is asked: a code of the call path outside this package
    (each frame's file and line), the same at the same point of every rank's loop. A stop after a
    batch and one after an epoch differ there, and so do the collectives Lightning runs after them."""
    frame: types.FrameType | None = sys._getframe(1)
    path = []
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_PACKAGE):
            path.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        frame = frame.f_back
    return zlib.crc32(";".join(path).encode())


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
        self._stopping = False  # whether this rank learned of a stop (its board may have been replaced by a heal)
        self._counted_from = 0  # collectives this rank skipped (a rank let in) are counted as run
        #: this rank's training loop ended (set by the strategy from its ``on_train_end``)
        self.ended = False

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

    def broadcast(self, board: DecisionBoard, value: bool, src: int, collectives: int) -> bool:
        """Rank ``src``'s stop flag, answered on ``board`` after ``collectives`` Lightning
        collectives (module docstring)."""
        return self._answered(
            board, collectives, lambda index, count, site: board.broadcast_flag(value, src, index, count, site)
        )

    def reduce(self, board: DecisionBoard, decision: bool, all: bool, collectives: int) -> bool:
        """Every rank's (``all``) or any rank's stop decision, answered on ``board`` after
        ``collectives`` Lightning collectives."""
        return self._answered(
            board, collectives, lambda index, count, site: board.reduce_flag(decision, all, index, count, site)
        )

    def _answered(self, board: DecisionBoard, collectives: int, ask: Callable[[int, int, int], bool]) -> bool:
        if self._stopping and board.stop_at is None:  # a stop learned on the board before a heal's:
            board.stopped = True  # every survivor stops at its next question
        answer = ask(self._asked, collectives - self._counted_from, _site())
        self._asked += 1
        self._stopping = board.stop_at is not None or board.stopped
        return answer

    def agree_after_heal(self, transport: Any, collectives: int, joining: bool = False) -> bool:
        """After a heal (collective over the survivors, and the ranks let in: ``joining``), with
        ``collectives`` Lightning collectives run here: if some survivor had learned of a stop, every
        rank stops at its next question. A rank let in skipped the collectives the survivors ran:
        it counts on from theirs (questions too: Lightning numbers them alike). Returns whether some
        survivor's training loop had ended (:attr:`ended`): it runs no collective of the loop again."""
        mine = (self._stopping, self._asked, collectives - self._counted_from, joining, self.ended)
        known = transport.allgather_object(mine)
        self._stopping = any(entry[0] for entry in known)
        if joining:
            survivors = [(asked, count) for _, asked, count, joins, _ in known if not joins]
            self._asked = max(asked for asked, _ in survivors)
            self._counted_from = collectives - max(count for _, count in survivors)
        return any(entry[4] for entry in known)

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
