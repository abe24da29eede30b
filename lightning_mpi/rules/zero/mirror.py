"""A buddy copy of one other rank's ZeRO shard, so that a heal (``heal="shrink"``) loses no
optimizer state (:mod:`lightning_mpi.rules.zero.rule`).

While ``heal`` is set, rank ``r`` of ``W`` also keeps a **mirror** of the shard of its buddy
``(r + 1) % W``: the buddy's pieces of the weights (fp32 master values where a bucket keeps them)
and an optimizer of the same class and hyper-parameters over them. Every step:

1. after the reduce-scatter, each rank sends its averaged gradient chunks (1/W of the gradient's
   bytes) to the rank that mirrors it, ``(r - 1) % W``, and receives its buddy's into
   :attr:`MirrorShard.grads` (:meth:`MirrorShard.exchange`);
2. clipping scales them by the same (global) coefficient as the owner's (:meth:`MirrorShard.scale`);
3. once the owner's optimizer stepped (its step post-hook; a skipped step steps neither), the
   mirror steps with the owner's current hyper-parameters (a scheduler's ``lr``):
   :meth:`MirrorShard.step`. Same class, same inputs, same element-wise arithmetic: the mirror's
   state and weights equal the buddy's bit for bit.

The mirror is cut from what this rank holds whole where it can (:meth:`MirrorShard.load`): the
optimizer's state when it is sharded, torch's full format or all shards of a save when one is
loaded, and after a heal the whole rebuilt state. Only a save read as this rank's own shard leaves
it *stale*: the next exchange then sends each rank's shard state to the rank that mirrors it
(:meth:`MirrorShard.take`), once; a loss before that cannot heal (``LookupError``).

After a loss, every survivor holds its own shard and its buddy's mirror, both as of the same
number of optimizer steps (every rank steps both locally, between two collectives).
:func:`rebuild_shards` assembles the shard states of every rank of the lost world from them (a
lost rank's from the survivor that mirrored it), which
:meth:`~lightning_mpi.rules.zero.rule.BoundZeroRule.load_optimizer_state` reshards for the new world
size, and, where a survivor's step was interrupted in its Allgather, :func:`write_weights` puts
the weights back whole from the same pieces (that Allgather is completed this way; weights already
whole are left alone, so the fp32 weights are unchanged and a lossy wire's members keep their
values). Two adjacent ranks lost at once (a shard and its only mirror), or survivors that stepped a
different number of times (one completed the reduce-scatter that another did not), cannot be
rebuilt exactly: ``RankFailedError``.

Cost while nothing fails: 1/W of the gradient's bytes per step (point to point), 1/W more optimizer
state, weights and optimizer compute per rank. Nothing without ``heal``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.errors import RankFailedError
from lightning_mpi.rules.zero.layout import bucket_pieces
from lightning_mpi.rules.zero.state import (
    SHARD_FORMAT,
    check_shard_set,
    gather_range,
    index_sources,
    is_shard_state,
    slice_param_state,
)

_TAG = 7_411  # the mirror's messages (tag + bucket index % _SPAN), on the rule's own communicator
_SPAN = 20_000


def _place(value: Any, like: Tensor, key: str) -> Any:
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        return value.clone()
    return value.to(device=like.device, copy=True)


class MirrorShard:
    """The mirror of ``buddy``'s shard (module docstring), next to this rank's ``sharded`` optimizer.

    Args:
        sharded: this rank's :class:`~lightning_mpi.rules.zero.optimizer.ShardedOptimizer`.
        buckets: the rule's :class:`~lightning_mpi.rules.zero.bucket.ShardBucket` list.
        params: the rule's parameters (``Piece.param`` indexes them).
        own_masters: for each of ``sharded.tensors``, whether it is a master weight.
        rank, world: this rank and the world size (``world > 1``).
    """

    def __init__(
        self,
        sharded: Any,
        buckets: Sequence[Any],
        params: Sequence[Tensor],
        own_masters: Sequence[bool],
        rank: int,
        world: int,
    ) -> None:
        self.sharded = sharded
        self._own_masters = list(own_masters)
        self.rank, self.world = rank, world
        self.buddy = (rank + 1) % world
        self.mirrored_by = (rank - 1) % world
        position = {id(p): i for i, p in enumerate(sharded.originals)}
        self.grads = [torch.zeros(b.plan.chunk, dtype=b.plan.dtype, device=b.plan.device) for b in buckets]
        self._send = [torch.zeros(0)] * len(buckets)
        masters = []
        entries = []  # (group, slot, tensor, grad view, has master)
        for bucket, buffer in zip(buckets, self.grads, strict=True):
            for piece in bucket_pieces(bucket.plan, self.buddy):
                param = params[piece.param]
                index = position[id(param)]
                flat = param.detach().reshape(-1)[piece.start : piece.start + piece.length]
                tensor = flat.to(dtype=bucket.plan.dtype, copy=True)
                view = buffer[piece.offset : piece.offset + piece.length]
                entries.append((sharded.group_of[index], (index, piece.start, piece.length), tensor, view))
                masters.append(bucket.master is not None)
        order = sorted(range(len(entries)), key=lambda k: entries[k][0])  # group by group, layout order within
        self.slots = [entries[k][1] for k in order]
        self.tensors = [entries[k][2] for k in order]
        self.grad_views = [entries[k][3] for k in order]
        self._masters = [masters[k] for k in order]
        owner = sharded.optimizer
        groups = []
        for g, group in enumerate(owner.param_groups):
            members = [entries[k][2] for k in order if entries[k][0] == g]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
        # the owner's class, defaults and group hyper-parameters, without its __init__ (whose
        # arguments are not known here): its step() is what the owner runs
        cls: Any = type(owner)
        self.optimizer: Optimizer = cls.__new__(cls)
        Optimizer.__init__(self.optimizer, groups, dict(owner.defaults))
        #: the buddy's state is not here: the next exchange sends it (once)
        self.stale = False
        self._params, self._position = params, position

    # -- every step ------------------------------------------------------------------------------------
    def exchange(self, team: Any, own_grads: Sequence[Tensor]) -> None:
        """Send this rank's averaged gradient chunks (one per bucket) to the rank that mirrors it, and
        receive the buddy's (point to point on the rule's communicator ``team``, with its timeout);
        first, when :attr:`stale`, the whole shard states (:meth:`take`)."""
        comm = team.comm
        if self.stale:
            theirs = comm.sendrecv(
                self.sharded_state(), dest=self.mirrored_by, sendtag=_TAG - 1, source=self.buddy, recvtag=_TAG - 1
            )
            self.take(theirs)
        requests = []
        hosts = []
        for i, (grad, buffer) in enumerate(zip(own_grads, self.grads, strict=True)):
            send = grad.detach().cpu().contiguous()
            recv = buffer if buffer.device.type == "cpu" else torch.empty_like(buffer, device="cpu")
            self._send[i] = send  # alive until the send completed
            hosts.append(recv)
            tag = _TAG + i % _SPAN
            # as bytes: numpy has no bfloat16
            requests.append(comm.Irecv(recv.view(torch.uint8).numpy(), source=self.buddy, tag=tag))
            requests.append(comm.Isend(send.contiguous().view(torch.uint8).numpy(), dest=self.mirrored_by, tag=tag))
        for request in requests:
            team._wait(request, "the mirror's gradients")
        for host, buffer in zip(hosts, self.grads, strict=True):
            if host is not buffer:
                buffer.copy_(host)

    def scale(self, coefficient: float) -> None:
        """Clipping: the owner's gradients were multiplied by ``coefficient``; so are the buddy's."""
        for buffer in self.grads:
            buffer.mul_(coefficient)

    def step(self) -> None:
        """The owner stepped: step the mirror with the owner's current hyper-parameters."""
        for mine, owner in zip(self.optimizer.param_groups, self.sharded.optimizer.param_groups, strict=True):
            for key, value in owner.items():
                if key != "params":
                    mine[key] = value
        for tensor, grad in zip(self.tensors, self.grad_views, strict=True):
            tensor.grad = grad
        self.optimizer.step()

    # -- state -----------------------------------------------------------------------------------------
    def sharded_state(self) -> dict[str, Any]:
        """This rank's own shard state with its weights (``_weights``) and master weights
        (``_master``), detached copies: what the mirror of it takes, and what a heal keeps."""
        return with_weights(self.sharded.shard_state(), self.sharded.tensors, self._own_masters)

    def state(self) -> dict[str, Any]:
        """The mirror as the buddy's shard state (copies), with its weights (``_weights``, ``_master``)."""
        shard = self.sharded.shard_state()
        shard = {
            **shard,
            "rank": self.buddy,
            "pieces": [list(slot) for slot in self.slots],
            "state": [dict(self.optimizer.state.get(t, {})) for t in self.tensors],
        }
        return with_weights(shard, self.tensors, self._masters)

    def load(self, saved: Any) -> None:
        """Cut the mirror from ``saved`` as this rank holds it: torch's full format (``{"state":
        {index: state}, ...}``, the optimizer's own state at sharding), or all shards of a save;
        anything else (this rank's own shard) makes it :attr:`stale`. The weights come from a
        saved ``_master`` where every piece has one, else from the parameters (load them first)."""
        if isinstance(saved, Mapping) and not is_shard_state(saved):
            full = {int(k): v for k, v in saved["state"].items()}
            states = [
                slice_param_state(full[i], s, n, t) if full.get(i) else {}
                for (i, s, n), t in zip(self.slots, self.tensors, strict=True)
            ]
        elif not isinstance(saved, Mapping) and _all_shards(saved):
            sources = index_sources(list(saved))
            states = [
                gather_range(sources.get(i, []), s, n, t, what=f"parameter {i}")
                for (i, s, n), t in zip(self.slots, self.tensors, strict=True)
            ]
        else:
            self.stale = True
            return
        originals = self.sharded.originals
        state = self.optimizer.state
        state.clear()
        with torch.no_grad():
            for (index, start, length), tensor, saved_state in zip(self.slots, self.tensors, states, strict=True):
                master = saved_state.get("_master")
                if master is not None:
                    tensor.copy_(master)
                else:
                    tensor.copy_(originals[index].detach().reshape(-1)[start : start + length])
                own = {k: v for k, v in saved_state.items() if not k.startswith("_")}
                if own:
                    state[tensor] = own
        self.stale = False

    def take(self, shard: Mapping[str, Any]) -> None:
        """Become the mirror of the buddy's ``shard`` (its :meth:`sharded_state`)."""
        by_slot = {tuple(piece): state for piece, state in zip(shard["pieces"], shard["state"], strict=True)}
        state = self.optimizer.state
        state.clear()
        with torch.no_grad():
            for slot, tensor in zip(self.slots, self.tensors, strict=True):
                saved = by_slot[slot]
                tensor.copy_(saved["_weights"])
                own = {k: _place(v, tensor, k) for k, v in saved.items() if not k.startswith("_")}
                if own:
                    state[tensor] = own
        self.stale = False


def _all_shards(saved: Any) -> bool:
    try:
        shards = list(saved)
        check_shard_set(shards)
    except (TypeError, ValueError, KeyError, AttributeError):
        return False
    return True


def with_weights(shard: dict[str, Any], tensors: Sequence[Tensor], masters: Sequence[bool]) -> dict[str, Any]:
    """``shard`` with detached copies of its state and ``_weights`` (and ``_master`` where the bucket
    keeps master weights) from ``tensors``, the pieces it steps."""
    states = []
    for tensor, state, master in zip(tensors, shard["state"], masters, strict=True):
        entry = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
        entry["_weights"] = tensor.detach().clone()
        if master:
            entry["_master"] = entry["_weights"]
        states.append(entry)
    return {**shard, "state": states}


def rebuild_shards(kept: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The shard states of every rank of the world that lost ranks, and the optimizer steps they are
    at, from what each survivor kept (``{"steps": n, "own": shard, "mirror": shard}``, in any
    order): a surviving rank's own shard, a lost rank's from the survivor that mirrored it.

    Raises:
        RankFailedError: the survivors stepped a different number of times, or a lost rank's
            shard has no mirror among them (its mirror was lost too).
    """
    steps = sorted({int(k["steps"]) for k in kept})
    if len(steps) != 1:
        raise _stop(
            -1,
            f"after a heal the survivors' ZeRO shards are at different optimizer steps ({steps}): a rank was "
            "lost between the reduce-scatter that some completed and others did not; the shards cannot be put "
            "together exactly",
        )
    world = int(kept[0]["own"]["world_size"])
    own = {int(k["own"]["rank"]): k["own"] for k in kept}
    mirrors = {int(k["mirror"]["rank"]): k["mirror"] for k in kept if k.get("mirror") is not None}
    lost = [r for r in range(world) if r not in own]
    orphans = [r for r in lost if r not in mirrors]
    if orphans:
        holders = ", ".join(f"{r} (mirrored by rank {(r - 1) % world})" for r in orphans)
        raise _stop(
            orphans[0],
            f"rank(s) {holders} of {world} were lost together with the rank that mirrored their ZeRO shard: "
            "that shard of the optimizer state has no copy left, and a fresh one would change the training "
            "silently; the run stops (`lightning-mpi --max-restarts` resumes from the last sharded checkpoint)",
        )
    shards = [dict(own[r]) if r in own else dict(mirrors[r]) for r in range(world)]
    for shard in shards:
        if shard.get("format") != SHARD_FORMAT:
            raise ValueError(f"not a lightning_mpi shard state: {shard.get('format')!r}")
    return shards, steps[0]


def write_weights(shards: Sequence[Mapping[str, Any]], originals: Sequence[Tensor]) -> None:
    """Put every parameter's values back whole from the pieces' ``_weights`` (``originals``: the
    parameters in the optimizer's numbering). A piece that holds these values already is not
    written: a heal inside the forward pass (Lightning's ``reduce`` in ``training_step``) must
    leave the tensors that backward saved unchanged."""
    with torch.no_grad():
        for shard in shards:
            for (index, start, length), state in zip(shard["pieces"], shard["state"], strict=True):
                param = originals[int(index)]
                values = state["_weights"].reshape(-1)
                now = param.detach().reshape(-1)[int(start) : int(start) + int(length)]
                if torch.equal(now, values.to(device=now.device, dtype=now.dtype)):
                    continue
                if param.is_contiguous():
                    param.view(-1)[int(start) : int(start) + int(length)].copy_(values)
                else:
                    flat = param.detach().reshape(-1).clone()
                    flat[int(start) : int(start) + int(length)] = values.to(flat.dtype)
                    param.copy_(flat.view_as(param))


def _stop(rank: int, message: str) -> RankFailedError:
    error = RankFailedError(rank, message)
    error.args = (f"lightning_mpi: {message}",)
    return error
