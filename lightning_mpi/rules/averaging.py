"""Periodic model averaging ("local SGD", post-local SGD of Lin et al., "Don't use large
mini-batches, use local SGD", ICLR 2020; torch's ``PeriodicModelAverager``).

For the first ``sync_warmup_steps`` steps the ranks average gradients every step (synchronous SGD),
so the early, sharp part of training follows one trajectory. After that each rank steps on its
own gradients and every ``period`` (H) steps the weights are replaced by their mean:

    θᵢ ← (1/W) Σⱼ θⱼ

Defaults, cited: Lin et al. use H = 16 for CIFAR and report H ∈ {2..16}; torch's
``PeriodicModelAverager`` examples use ``period=4``. We take ``period=4`` (small models on few
steps drift quickly) and ``sync_warmup_steps=0``. (The name says "sync" because every strategy's
``warmup_steps`` is the learning-rate warm-up of ``lr_scaling``.)

Healing: a survivor keeps its counters (the checkpoint state); the weights are the module's. The
warm-up's gradient average is redone with this rank's own gradients put back, or taken from a
survivor that completed it; a weight average (``after_step``) is redone with the counters before
it (the weights change only once it completed), or its weights and counters taken.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_mpi.comm.collectives import allreduce_mean_
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, option, options_class
from lightning_mpi.rules.base import BoundLocalStepRule, Execute, Rule, gradient_exchange, redone_from_state
from lightning_mpi.rules.easgd import FlatParams


def averages_at(step: int, period: int, sync_warmup_steps: int) -> str:
    """What happens after update ``step`` (1-based): ``"gradients"`` (warm-up), ``"weights"`` or ``"none"``."""
    if step <= sync_warmup_steps:
        return "gradients"
    return "weights" if (step - sync_warmup_steps) % period == 0 else "none"


@options_class
class ModelAveragingRule(Rule):
    """Periodic model averaging (local SGD): every rank steps on its own gradients, and the ranks
    average their weights every ``period`` steps. Registered as ``mpi_model_avg``.
    """

    name = "model_avg"

    period: int = option(default=4, doc="H, local steps between weight averages (≥ 1).", check=integer(1))
    sync_warmup_steps: int = option(
        default=0, doc="first steps with synchronous gradient averaging (≥ 0).", check=integer(0)
    )

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundModelAveraging:
        return BoundModelAveraging(self, transport, params)


class BoundModelAveraging(BoundLocalStepRule):
    def __init__(self, rule: ModelAveragingRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params, rule.name)
        self.rule = rule
        self.flat = FlatParams(self.params, transport.size)
        self.steps = 0
        self.averages = 0
        self._seconds = 0.0

    def _mean_(self, flat: Tensor) -> None:
        start = time.perf_counter()
        allreduce_mean_(self.transport, flat)
        self._seconds += time.perf_counter() - start

    def before_step(self, optimizer: Any) -> bool:
        """Warm-up: average gradients (collective). Then reject the step if the gradients this rank
        is about to apply are non-finite: during warm-up they are the same on every rank, so every
        rank rejects together; after it, only the rank with the bad gradient skips its update."""
        self._seconds = 0.0
        if (
            self.transport.size > 1
            and averages_at(self.steps + 1, self.rule.period, self.rule.sync_warmup_steps) == "gradients"
        ):
            self.flat.bucket.pack_grads()
            self._mean_(self.flat.flat)
            self.flat.bucket.unpack_grads()
        return super().before_step(optimizer)

    def healable_before_step(self, optimizer: Any, execute: Execute) -> bool:
        warm_up = self.transport.size > 1 and (
            averages_at(self.steps + 1, self.rule.period, self.rule.sync_warmup_steps) == "gradients"
        )
        return execute(gradient_exchange(optimizer, collective=warm_up))

    def healable_after_step(self, optimizer: Any, execute: Execute) -> None:
        execute(
            redone_from_state(
                "the weight average",
                lambda bound: bound.after_step(optimizer),
                moving=lambda bound: list(bound.params),
                exchanged=lambda bound, before: bound.averages != before["averages"],
                restore=False,  # the weights change only once the average completed
            )
        )

    def _advance(self) -> None:
        """Count one step; every ``period`` steps after warm-up, average the weights (collective)."""
        self.steps += 1
        if (
            self.transport.size > 1
            and averages_at(self.steps, self.rule.period, self.rule.sync_warmup_steps) == "weights"
        ):
            self._mean_(self.flat.pull())
            self.flat.push()
            self.averages += 1

    def on_train_end(self) -> None:
        # Leave the consensus: one last average unless the last step just did one.
        if self.transport.size > 1 and averages_at(self.steps, self.rule.period, self.rule.sync_warmup_steps) == "none":
            self._mean_(self.flat.pull())
            self.flat.push()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "averages": self.averages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.averages = int(state.get("averages", 0))

    def stats(self) -> dict[str, float]:
        return {
            "exchange_seconds": self._seconds,
            "averages": float(self.averages),
            "skipped_steps": float(self.guard.skipped_steps),
        }
