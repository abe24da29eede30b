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
from typing import Any, Optional


class StopDecisions:
    """Answers Lightning's bool decisions from the rule's board while it trains (module docstring)."""

    _api: Any
    _bound: Any

    #: how deep the current call is in :meth:`collective_decisions` scopes
    _collective_depth = 0

    @contextmanager
    def collective_decisions(self) -> Generator[None, None, None]:
        """Inside this scope, bool broadcasts and ``reduce_boolean_decision`` are collectives."""
        self._collective_depth += 1
        try:
            yield
        finally:
            self._collective_depth -= 1

    def _decision_board(self) -> Optional[Any]:
        """The board for stop votes, or ``None`` when the answer must be a collective. A board
        read waits for no rank, so it checks first whether another rank failed."""
        bound = self._bound
        if self._collective_depth or bound is None or not bound.training:
            return None
        self.check_peers()  # type: ignore[attr-defined]
        return bound.board

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        board = self._decision_board() if isinstance(obj, bool) else None
        if board is not None:
            return board.broadcast_flag(obj, src)
        return super().broadcast(obj, src)  # type: ignore[misc]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        board = self._decision_board()
        if board is not None:
            return board.reduce_flag(bool(decision), all)
        return super().reduce_boolean_decision(decision, all)  # type: ignore[misc]

    # -- the checkpoint callbacks' hooks run in a collective scope while the rule trains ------------
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        for callback in getattr(trainer, "checkpoint_callbacks", []) if trainer is not None else []:
            self._scope_hooks(callback)

    def teardown(self) -> None:
        self._unscope_hooks()
        super().teardown()  # type: ignore[misc]

    def _scope_hooks(self, callback: Any) -> None:
        """Run each of ``callback``'s Lightning hooks inside :meth:`collective_decisions`
        (instance attributes over the class's methods; :meth:`_unscope_hooks` removes them)."""
        scoped: list[tuple[Any, str]] = getattr(self, "_scoped_hooks", [])
        for name in vars(self._api.Callback):
            if not name.startswith("on_") or name in vars(callback):
                continue
            method = getattr(callback, name)

            @functools.wraps(method)
            def in_collective_scope(*args: Any, _hook: Any = method, **kwargs: Any) -> Any:
                with self.collective_decisions():
                    return _hook(*args, **kwargs)

            setattr(callback, name, in_collective_scope)
            scoped.append((callback, name))
        self._scoped_hooks = scoped

    def _unscope_hooks(self) -> None:
        for callback, name in getattr(self, "_scoped_hooks", []):
            callback.__dict__.pop(name, None)
        self._scoped_hooks = []
