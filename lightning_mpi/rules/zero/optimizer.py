"""The user's optimizer, rebuilt in place over the pieces of parameters that one rank owns.

:func:`check_elementwise` decides whether an optimizer may be sharded: stepping a slice of a
parameter must give the same numbers as stepping the whole parameter and slicing, which holds for
optimizers whose update and state act element by element (:data:`ELEMENTWISE_OPTIMIZERS`). LBFGS
(a line search over all parameters), Adafactor (factored row/column moments), Muon (an
orthogonalised matrix update) and any optimizer that is not known to be element-wise are refused.

:class:`ShardedOptimizer` rebuilds the optimizer **in place**: the same object (LR schedulers,
Lightning's wrappers and the user's references keep working), the same class, defaults and param
group dicts (per-group ``lr``, ``weight_decay``, ``initial_lr``, ... untouched), each group's
``params`` replaced by the pieces of its parameters that this rank owns, and its state cut down to
those pieces. State that existed already (Adagrad's accumulator is made at construction; a
resumed optimizer) is sliced, not dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.rules.zero.layout import Piece
from lightning_mpi.rules.zero.state import (
    SHARD_FORMAT,
    check_shard_set,
    copies,
    gather_range,
    index_sources,
    is_shard_state,
    slice_param_state,
)

#: optimizers whose update and state are element-wise (a subclass qualifies if it keeps their ``step``)
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def check_elementwise(optimizer: Any) -> None:
    """Raise ``ValueError`` naming the optimizer's class unless it may be sharded element-wise."""
    cls = type(optimizer)
    if any(isinstance(optimizer, base) and cls.step is base.step for base in ELEMENTWISE_OPTIMIZERS):
        return
    names = ", ".join(base.__name__ for base in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"optimizer={cls.__module__}.{cls.__qualname__} cannot be sharded: ZeRO steps each rank's slices of the "
        "parameters, which gives the unsharded result only for optimizers whose update and state act element by "
        "element, and this one is not known to (LBFGS, Adafactor, Muon and other whole-tensor or matrix optimizers "
        f"need whole parameters; a subclass that overrides step() is not trusted). Use one of {names}, or train "
        "without sharding the optimizer (strategy 'mpi_asa', or shard_optimizer=False)."
    )


class ShardedOptimizer:
    """``optimizer`` stepping only ``piece_tensors``, the pieces of ``params`` this rank owns.

    Args:
        optimizer: the user's optimizer over (a superset of) ``params``; rebuilt in place.
        params: the rule's parameters (the trainable ones), indexed by ``Piece.param``.
        pieces: this rank's pieces, and ``piece_tensors`` the 1-D tensors the optimizer steps for
            them (views of the parameters or of fp32 master weights; see
            :mod:`lightning_mpi.rules.zero.rule`).

    Raises:
        ValueError: a trainable parameter is missing from the optimizer, or listed twice, or the
            optimizer holds a parameter that requires grad but is not one of ``params``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        params: Sequence[Tensor],
        pieces: Sequence[Piece],
        piece_tensors: Sequence[Tensor],
        world_size: int,
        rank: int,
    ) -> None:
        check_elementwise(optimizer)
        self.optimizer = optimizer
        self.world_size, self.rank = world_size, rank
        originals = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_shapes = [list(p.shape) for p in originals]
        position = {id(p): i for i, p in enumerate(originals)}
        if len(position) != len(originals):
            raise ValueError("optimizer lists a parameter twice; ZeRO needs each parameter in exactly one group")
        group_of = [g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]]
        #: the parameters in the optimizer's numbering, and each one's group (for :meth:`unshard`)
        self.originals, self.group_of = list(originals), group_of
        self._check_coverage(params, originals, position)
        #: optimizer-order slots: (parameter index in the optimizer's numbering, start, length)
        self.slots = [(position[id(params[p.param])], p.start, p.length) for p in pieces]
        self.tensors = list(piece_tensors)
        self.group_sizes = [len(group["params"]) for group in optimizer.param_groups]
        self.param_names = [group.pop("param_names", None) for group in optimizer.param_groups]
        old_state = {position[id(p)]: s for p, s in optimizer.state.items() if id(p) in position}
        grouped: list[list[Tensor]] = [[] for _ in optimizer.param_groups]
        new_state: dict[Tensor, dict[str, Any]] = {}
        order: list[int] = []
        for g in range(len(grouped)):
            for k, (index, start, length) in enumerate(self.slots):
                if group_of[index] != g:
                    continue
                grouped[g].append(self.tensors[k])
                order.append(k)
                if old_state.get(index):
                    new_state[self.tensors[k]] = slice_param_state(old_state[index], start, length, self.tensors[k])
        # the optimizer steps pieces group by group: keep slots in that order
        self.slots = [self.slots[k] for k in order]
        self.tensors = [self.tensors[k] for k in order]
        for group, members in zip(optimizer.param_groups, grouped, strict=True):
            group["params"] = members  # the same dicts: schedulers and Lightning hold them
        optimizer.state.clear()  # the same mapping object: LightningOptimizer shares it
        optimizer.state.update(new_state)

    def unshard(self) -> None:
        """Give the optimizer its whole parameters back (each group's own, and its ``param_names``),
        with no state: what a new binding shards again after a heal (its state is loaded then)."""
        first = 0
        for group, size, names in zip(self.optimizer.param_groups, self.group_sizes, self.param_names, strict=True):
            group["params"] = list(self.originals[first : first + size])
            if names is not None:
                group["param_names"] = list(names)
            first += size
        self.optimizer.state.clear()

    @staticmethod
    def _check_coverage(params: Sequence[Tensor], originals: Sequence[Tensor], position: Mapping[int, int]) -> None:
        missing = [i for i, p in enumerate(params) if id(p) not in position]
        if missing:
            raise ValueError(
                f"optimizer does not hold {len(missing)} of the model's {len(params)} trainable parameters (the first "
                f"has shape {tuple(params[missing[0]].shape)}); a sharded optimizer must step every trainable "
                "parameter: pass all of them to the optimizer, or set requires_grad=False on the ones it should "
                "not train"
            )
        ours = {id(p) for p in params}
        extra = [p for p in originals if id(p) not in ours and p.requires_grad]
        if extra:
            raise ValueError(
                f"optimizer holds {len(extra)} parameter(s) that require grad but are not the model's (the first has "
                f"shape {tuple(extra[0].shape)}); a sharded optimizer can step only the model's trainable parameters"
            )

    # -- state ---------------------------------------------------------------------------------
    def shard_state(self) -> dict[str, Any]:
        """This rank's optimizer state in the shard format (:mod:`lightning_mpi.rules.zero.state`).

        Tensors are the live state (as ``Optimizer.state_dict()`` gives them): save them before the
        next step."""
        groups = []
        first = 0
        for group, size, names in zip(self.optimizer.param_groups, self.group_sizes, self.param_names, strict=True):
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(first, first + size))
            if names is not None:
                saved["param_names"] = list(names)
            groups.append(saved)
            first += size
        state = self.optimizer.state
        return {
            "format": SHARD_FORMAT,
            "world_size": self.world_size,
            "rank": self.rank,
            "param_groups": groups,
            "param_shapes": [list(s) for s in self.param_shapes],
            "pieces": [list(slot) for slot in self.slots],
            "state": [dict(state.get(t, {})) for t in self.tensors],
        }

    def load(self, saved: Any) -> list[dict[str, Any]]:
        """Restore the state from torch's full format, one shard state, or all shard states of a
        save (any world size: the pieces are cut again for this layout). Group hyperparameters are
        restored as torch's ``load_state_dict`` does.

        Returns each piece's loaded state in optimizer order (``_``-keys included, for the caller).
        """
        if isinstance(saved, Mapping) and not is_shard_state(saved):
            self._load_groups(saved["param_groups"])
            full = {int(k): v for k, v in saved["state"].items()}
            loaded = [
                slice_param_state(full[i], s, n, t) if full.get(i) else {}
                for (i, s, n), t in zip(self.slots, self.tensors, strict=True)
            ]
        else:
            own = saved if is_shard_state(saved) else None
            if own is None and len(saved) == self.world_size and self._same_layout(saved[self.rank]):
                own = saved[self.rank]  # the same layout: this rank's own file is all it reads
            if own is not None and self._same_layout(own):
                loaded = [
                    {k: _placed(v, t, k) for k, v in st.items()}
                    for st, t in zip(own["state"], self.tensors, strict=True)
                ]
                groups = own["param_groups"]
            elif own is not None:
                raise ValueError(
                    "this shard state was saved with another layout (world size or bucket size); resharding needs "
                    "the shard states of every rank of that save"
                )
            else:
                shards = copies(list(saved))[0]  # several copies (mpi_hybrid's replicas): the run's rank 0's
                check_shard_set(shards)
                sources = index_sources(shards)
                loaded = [
                    gather_range(sources.get(i, []), s, n, t, what=f"parameter {i}")
                    for (i, s, n), t in zip(self.slots, self.tensors, strict=True)
                ]
                groups = shards[0]["param_groups"]
            self._load_groups(groups)
        state = self.optimizer.state
        state.clear()
        for tensor, piece_state in zip(self.tensors, loaded, strict=True):
            own = {k: v for k, v in piece_state.items() if not k.startswith("_")}
            if own:
                state[tensor] = own
        return loaded

    def _same_layout(self, shard: Mapping[str, Any]) -> bool:
        return [tuple(p) for p in shard["pieces"]] == [tuple(s) for s in self.slots]

    def _load_groups(self, groups: Sequence[Mapping[str, Any]]) -> None:
        sizes = [len(g["params"]) for g in groups]
        if sizes != self.group_sizes:
            raise ValueError(
                f"the saved optimizer has param groups of sizes {sizes}, this one {self.group_sizes}: "
                "the checkpoint was written for another model or optimizer"
            )
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = value


def _placed(value: Any, like: Tensor, key: str) -> Any:
    """A loaded value as the optimizer's own (a copy: a memory-mapped file's pages are read now)."""
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        return value.clone()
    return value.to(device=like.device, copy=True)
