"""Exchange rules: hyperparameters (a :class:`Rule`) bound to a communicator (a :class:`BoundRule`).

A :class:`Rule` holds validated hyperparameters and nothing else, so it can be built from the
command line and pickled. :meth:`Rule.bind` gives the running part, which owns buffers and state.
Rules know torch and the transport; they know nothing of Lightning: the strategy calls these
hooks, in this order, on every rank:

1. ``on_train_start()`` once, after all ranks hold rank 0's initial weights.
2. per updating step: ``before_step(optimizer)`` after backward; returns ``False`` when the step
   must be skipped (non-finite exchanged gradients), then ``after_step(optimizer)`` after it.
3. ``on_train_end()`` once: leave the rule's final consensus weights in the parameters.
4. ``close()``: release threads, windows and requests.

``state_dict()`` / ``load_state_dict()`` carry what a resumed run needs beyond the module and
optimizer states; ``stats()`` returns numbers worth logging for the last step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport


def check_range(name: str, value: float, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    """Raise ``ValueError`` naming ``name``, its value and the allowed range unless ``value`` is in it."""
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r} is out of range: it must be in {left}{low}, {high}{right}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise ``ValueError`` naming ``name``, its value and the allowed values unless it is one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed: choose one of {list(choices)}")


def trainable_parameters(optimizer: Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that need gradients, in param-group order, without duplicates."""
    seen: set[int] = set()
    params = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


class BoundRule:
    """The running part of a rule. The default hooks do nothing, so a rule overrides only what it uses."""

    def __init__(self, transport: Transport, params: Sequence[torch.Tensor]) -> None:
        self.transport = transport
        self.params = list(params)

    def on_train_start(self) -> None:
        """Called once when training starts, with identical weights on every rank."""

    def before_step(self, optimizer: Optimizer) -> bool:
        """Called after backward on a step that updates; return ``False`` to skip the update."""
        return True

    def after_step(self, optimizer: Optimizer) -> None:
        """Called after ``optimizer.step()``."""

    def on_train_end(self) -> None:
        """Called once when training ends; leaves the final consensus weights in ``params``."""

    def close(self) -> None:
        """Release background resources. Safe to call twice."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def stats(self) -> dict[str, float]:
        """Numbers about the last step (seconds, bytes, counts) for the logger."""
        return {}


class Rule(ABC):
    """Hyperparameters of an exchange rule. Subclasses validate them in ``__init__``."""

    #: Short name used in logs (``mpi/<name>/...``).
    name: str = "rule"

    @abstractmethod
    def bind(self, transport: Transport, params: Sequence[torch.Tensor]) -> BoundRule:
        """Create the running rule over ``params`` (the trainable parameters, in model order)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"
