"""What a rule that shards the optimizer (``SyncStrategy(shard_optimizer=True)``, ``mpi_zero``) needs
from a strategy, through the rule contract's :class:`~lightning_mpi.rules.base.OptimizerShards`.

Such a rule steps only this rank's shard of the parameters, so the strategy must:

- hand it the user's optimizer once the rule is bound, to be rebuilt in place over the shard
  (:meth:`OptimizerSharding.attach`; one optimizer holding every trainable parameter); after a
  heal the rule rebuilds it from the survivors' shards;
- clip by the global norm over the shards, not by this rank's piece (:meth:`clip_grad_norm_`);
- save each rank's optimizer shard, every rank at once, into a sharded checkpoint directory
  (:mod:`lightning_mpi.checkpoint`), and load one at any world size (:meth:`optimizer_state`,
  :meth:`load_into`).

The optimizer stays sharded after training (the end of ``fit``, Fabric's ``finish_training``), and
so do saves: one after ``fit`` is the same sharded directory as one during it. Each rank still holds
only its shard, and nothing is gathered. Gathering the shards into every rank's optimizer at the end
of ``fit``, as DDP leaves it, would put the whole optimizer state on every rank, which is the
memory that ZeRO exists to save, just before the final save.

Without such a rule every method leaves the usual path alone, except that a sharded checkpoint's
optimizer shards are consolidated into torch's format for a plain optimizer
(:func:`~lightning_mpi.checkpoint.consolidate.plain_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_mpi.checkpoint.consolidate import plain_state
from lightning_mpi.rules.base import BoundRule, OptimizerShards


class OptimizerSharding:
    """The strategy's side of a rule that shards the optimizer (module docstring); inactive until
    :meth:`attach` finds one. ``mirror``: the strategy heals (``heal`` is set): the rule keeps a
    copy of another rank's shard, which a GradScaler would corrupt (:meth:`check_precision`)."""

    def __init__(self, mirror: bool = False) -> None:
        self.shards: OptimizerShards | None = None
        self.mirror = mirror
        self._bound: BoundRule | None = None
        #: a new rank let in (heal="replace") whose optimizer shard :meth:`attach` rebuilt from the
        #: survivors' shards: the handover's optimizer state (rank 0's own shard) is not loaded over it
        self.rebuilt_at_join = False

    @property
    def active(self) -> bool:
        """True once a rule that shards the optimizer took it, until the next :meth:`attach` (after
        training too: the optimizer keeps only this rank's shard, so saves stay sharded)."""
        return self.shards is not None

    def attach(self, bound: BoundRule | None, optimizers: Sequence[Optimizer]) -> None:
        """After the rule is bound and the optimizers exist: hand the one optimizer to the rule when it
        shards it (:meth:`~lightning_mpi.rules.base.OptimizerShards.take_optimizer`; after a heal,
        collective: the rule rebuilds the optimizer state from the survivors'); a no-op for any
        other rule.

        Raises:
            ValueError: several optimizers, or one the rule cannot shard (it says why).
            RankFailedError: after a heal, the survivors' shards cannot be put together.
        """
        previous, self._bound = self._bound, bound
        self.shards = None if bound is None else bound.optimizer_shards
        if self.shards is None:
            return
        inner = [getattr(opt, "_optimizer", opt) for opt in optimizers]  # Lightning wraps them
        if len(inner) != 1:
            raise ValueError(
                f"shard_optimizer=True shards one optimizer that holds every trainable parameter, but got "
                f"{len(inner)} optimizers: use one optimizer (its param groups may differ in lr and weight decay), "
                "or pass shard_optimizer=False"
            )
        self.rebuilt_at_join = self.shards.take_optimizer(inner[0], previous)

    def check_precision(self, precision: Any) -> None:
        """Under ``heal``: refuse a GradScaler (``16-mixed``), naming the fix. It unscales the owner's
        gradients in place after the buddy copy received them, so the copy would step scaled ones."""
        if self.shards is not None and self.mirror and getattr(precision, "scaler", None) is not None:
            raise ValueError(
                "heal='shrink' with a sharded optimizer (shard_optimizer=True, mpi_zero) cannot use a GradScaler "
                "(precision='16-mixed'): the buddy copy of each shard, which lets ZeRO heal, would step gradients the "
                "scaler has not unscaled. Use precision='bf16-mixed' (no scaler), or heal=None"
            )

    @property
    def spreads_weights(self) -> bool:
        """Whether a sharded save may spread the weights over the ranks' files: every rank holds the
        same ones (else rank 0 writes its own, as a one-process save would)."""
        return self.shards is not None and self.shards.same_weights

    def owns(self, optimizer: Any) -> bool:
        """True when ``optimizer`` (or Lightning's wrapper of it) is the sharded one."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        return self.shards is not None and self.shards.optimizer is not None and self.shards.optimizer is inner

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip by the norm of the whole model's gradients, over every rank's shard (collective)."""
        assert self.shards is not None, "clip_grad_norm_ needs a rule that shards the optimizer (see active)"
        return self.shards.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer shard, for a sharded checkpoint (every rank writes its own)."""
        assert self.shards is not None, "optimizer_state needs a rule that shards the optimizer (see active)"
        return self.shards.optimizer_state()

    def load_into(self, optimizer: Any, saved: Any) -> None:
        """Load ``saved`` (a sharded checkpoint's shards at any world size, or torch's format) into
        ``optimizer``: through the rule when it is the sharded one, else as a plain optimizer."""
        if self.owns(optimizer):
            assert self.shards is not None
            if self.rebuilt_at_join:  # the handover's is rank 0's own shard: this rank's is rebuilt already
                self.rebuilt_at_join = False
                return
            self.shards.load_optimizer_state(saved)
        else:
            getattr(optimizer, "_optimizer", optimizer).load_state_dict(plain_state(saved))
