"""What a sharded optimizer (``SyncStrategy(shard_optimizer=True)``, ``mpi_zero``) needs from a strategy.

The ZeRO rule (:mod:`lightning_mpi.rules.zero`) steps only this rank's shard of the parameters, so
the strategy must:

- hand it the user's optimizer once the rule is bound, to be rebuilt in place over the shard
  (:meth:`OptimizerSharding.attach`; one optimizer holding every trainable parameter);
- clip by the global norm over the shards, not by this rank's piece (:meth:`clip_grad_norm_`);
- save each rank's optimizer shard, every rank at once, into a sharded checkpoint directory
  (:mod:`lightning_mpi.checkpoint`), and load one at any world size (:meth:`optimizer_state`,
  :meth:`load_into`).

Under ``heal`` (``mirror=True``) every rank also keeps its buddy's shard
(:mod:`lightning_mpi.rules.zero.mirror`), and after a heal :meth:`OptimizerSharding.attach` rebuilds
the whole optimizer state from the survivors' shards and mirrors and reshards it for the new world
size (:meth:`OptimizerSharding.attach`).

Without a ZeRO rule every method leaves the usual path alone, except that a sharded checkpoint's
optimizer shards are consolidated into torch's format for a plain optimizer (:func:`plain_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_mpi.checkpoint.sharded import ShardFiles
from lightning_mpi.rules.base import BoundRule
from lightning_mpi.rules.zero import BoundZeroRule
from lightning_mpi.rules.zero.mirror import rebuild_shards, write_weights
from lightning_mpi.rules.zero.state import consolidate


def plain_state(saved: Any) -> Any:
    """``saved`` in torch's optimizer format: the shards of a sharded checkpoint consolidated, anything
    else as it is."""
    return consolidate(list(saved)) if isinstance(saved, ShardFiles) else saved


class OptimizerSharding:
    """The strategy's side of a ZeRO rule (module docstring); inactive until :meth:`attach` finds one.
    ``mirror``: keep the buddy copy of another rank's shard (the strategy's ``heal`` is set)."""

    def __init__(self, mirror: bool = False) -> None:
        self.bound: BoundZeroRule | None = None
        self.mirror = mirror
        #: a new rank let in (heal="replace") whose optimizer shard :meth:`attach` rebuilt from the
        #: survivors' shards: the handover's optimizer state (rank 0's own shard) is not loaded over it
        self.rebuilt_at_join = False

    @property
    def active(self) -> bool:
        """True while a ZeRO rule shards the optimizer."""
        return self.bound is not None

    def attach(self, bound: BoundRule | None, optimizers: Sequence[Optimizer]) -> None:
        """After the rule is bound and the optimizers exist: rebuild the one optimizer over this
        rank's shard when the rule is ZeRO's (a no-op for any other rule).

        After a heal (``bound`` holds what the survivors kept: its ``healed_from``), collectively
        over the survivors: the optimizer gets its whole parameters back from the binding before
        (``previous``), the weights are put back whole and the optimizer state is rebuilt from every
        survivor's own shard and mirror (:func:`~lightning_mpi.rules.zero.mirror.rebuild_shards`),
        then sharded for the new world size. When new ranks are let in (``heal="replace"``) the
        same collective runs over survivors and new ranks: a new rank's ``healed_from`` says it
        joined (it kept nothing, had no binding before, and holds rank 0's weights already); the
        survivors' shards, the whole state, are resharded over the grown run.

        Raises:
            ValueError: several optimizers, or one that is not element-wise (see
                :func:`lightning_mpi.rules.zero.optimizer.check_elementwise`).
            RankFailedError: after a heal, a lost shard has no mirror left, or the survivors are at
                different optimizer steps.
        """
        previous = self.bound
        self.bound = bound if isinstance(bound, BoundZeroRule) else None
        if self.bound is None:
            return
        inner = [getattr(opt, "_optimizer", opt) for opt in optimizers]  # Lightning wraps them
        if len(inner) != 1:
            raise ValueError(
                f"shard_optimizer=True shards one optimizer that holds every trainable parameter, but got "
                f"{len(inner)} optimizers: use one optimizer (its param groups may differ in lr and weight decay), "
                "or pass shard_optimizer=False"
            )
        healed, self.bound.healed_from = self.bound.healed_from, None
        if healed is None:
            self.bound.shard_optimizer(inner[0], mirror=self.mirror)
            return
        joined = bool(healed.get("joined"))  # a new rank let in (heal="replace"): it kept nothing
        assert joined or (previous is not None and previous.sharded is not None), "a heal rebinds a ZeRO rule"
        kept = [k for k in self.bound.transport.allgather_object(healed) if not k.get("joined")]
        shards, steps = rebuild_shards(kept)
        if previous is not None and previous.sharded is not None:
            previous.sharded.unshard()
            if not all(k.get("whole", True) for k in kept):
                # a step's Allgather was interrupted: every survivor's weights whole again from the pieces
                write_weights(shards, previous.sharded.originals)
        self.bound.shard_optimizer(inner[0], mirror=self.mirror)
        self.bound.load_optimizer_state(shards)  # resharded for the new world size, master weights included
        self.bound.optimizer_steps = steps
        self.rebuilt_at_join = joined

    def check_precision(self, precision: Any) -> None:
        """Under ``heal``: refuse a GradScaler (``16-mixed``), naming the fix. It unscales the owner's
        gradients in place after the buddy copy received them, so the copy would step scaled ones."""
        if self.bound is not None and self.mirror and getattr(precision, "scaler", None) is not None:
            raise ValueError(
                "heal='shrink' with a sharded optimizer (shard_optimizer=True, mpi_zero) cannot use a GradScaler "
                "(precision='16-mixed'): the buddy copy of each shard, which lets ZeRO heal, would step gradients the "
                "scaler has not unscaled. Use precision='bf16-mixed' (no scaler), or heal=None"
            )

    def detach(self) -> None:
        self.bound = None

    def owns(self, optimizer: Any) -> bool:
        """True when ``optimizer`` (or Lightning's wrapper of it) is the sharded one."""
        bound = self.bound
        inner = getattr(optimizer, "_optimizer", optimizer)
        return bound is not None and bound.sharded is not None and bound.sharded.optimizer is inner

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip by the norm of the whole model's gradients, over every rank's shard (collective)."""
        assert self.bound is not None, "clip_grad_norm_ needs a ZeRO rule (see active)"
        return self.bound.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer shard, for a sharded checkpoint (every rank writes its own)."""
        assert self.bound is not None, "optimizer_state needs a ZeRO rule (see active)"
        return self.bound.optimizer_state()

    def load_into(self, optimizer: Any, saved: Any) -> None:
        """Load ``saved`` (a sharded checkpoint's shards at any world size, or torch's format) into
        ``optimizer``: through the rule when it is the sharded one, else as a plain optimizer."""
        if self.owns(optimizer):
            assert self.bound is not None
            if self.rebuilt_at_join:  # the handover's is rank 0's own shard: this rank's is rebuilt already
                self.rebuilt_at_join = False
                return
            self.bound.load_optimizer_state(saved)
        else:
            getattr(optimizer, "_optimizer", optimizer).load_state_dict(plain_state(saved))
