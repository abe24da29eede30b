"""GoSGD: gossip stochastic gradient descent (Blot, Picard, Cord & Thome, "Gossip training for
deep learning", NIPS 2016 OPT workshop, arXiv:1611.09726).

Each worker i holds weights θᵢ and a mixing weight wᵢ (all start at 1/W, so Σ wᵢ = 1). After
every local step, with probability p, worker i picks a peer j uniformly among the others and

    wᵢ ← wᵢ / 2;  send (θᵢ, wᵢ) to j                            (push, non-blocking ``Isend``)

and a worker j that finds a message (``Iprobe``) merges it:

    θⱼ ← (wⱼ θⱼ + wᵢ θᵢ) / (wⱼ + wᵢ);  wⱼ ← wⱼ + wᵢ              (:func:`gossip_merge`)

There is no global synchronisation while training: nobody waits for anybody. Σ w stays 1
over workers plus messages in flight, so the weighted mean Σ wᵢθᵢ is the consensus the ranks
drift towards. At the end of ``fit`` every rank drains the messages addressed to it (counts are
known from one allreduce) and all take the weighted consensus Σ wᵢθᵢ / Σ wᵢ (one allreduce).

Healing (``heal="shrink"``): a lost rank takes its
mixing weight wₗ with it, and so do the messages in flight on the failed communicator (they can no
longer be received, from or to any rank). The survivors bind again on the healed communicator (a
new mailbox, nothing in flight, no counts) with the θᵢ and wᵢ they hold, and renormalise
wᵢ ← wᵢ / Σ_survivors wⱼ (:func:`renormalised`, one allreduce), so that Σ w = 1 again. The
consensus they then drift to is the weighted mean of the survivors only: the lost rank's
contribution since its last push that a survivor merged is lost (what it pushed before and a
survivor merged stays, mixed into that survivor's θ), and so is a survivor's push still in flight at
the heal. A loss noticed in the final drain (its count allreduce, or waiting for a message) heals
the same way (every survivor that started binds again and starts, whether it was training,
draining or had drained), then the drain is redone over the survivors: the messages already
merged stay merged, the expected counts are those sent on the new communicator, among survivors
only (a survivor still training pushes on), then the consensus allreduce Σ wᵢθᵢ / Σ wᵢ over the
survivors (a survivor that missed its completion takes its result from one that did). What a
survivor keeps (:meth:`BoundGoSGD.heal_state`): its mixing weight, pushes and generator; a push
is one-sided, never redone (:meth:`~BoundGoSGD.healable_after_step`); the drain is redone
(:meth:`~BoundGoSGD.healable_train_end`). A rank let in (``heal="replace"``) takes rank 0's θ and
an even share of rank 0's mixing weight (:meth:`~BoundGoSGD.hand_over`), so that Σw and the
consensus are unchanged.

Default, cited: Blot et al. study exchange probabilities between 0.01 and 0.4 and find that
rare exchanges already keep workers in consensus; we take p = 0.1.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.mailbox import Mailbox
from lightning_mpi.comm.transport import Transport
from lightning_mpi.comm.window import DecisionBoard
from lightning_mpi.options import integer, number, option, options_class
from lightning_mpi.rules.base import BoundLocalStepRule, Execute, Operation, Rule, one_sided
from lightning_mpi.rules.easgd import FlatParams

TAG = 7301


def gossip_merge(theta: Tensor, weight: float, theta_in: Tensor, weight_in: float) -> tuple[Tensor, float]:
    """Weighted merge of a received model: ``((w θ + w' θ') / (w + w'), w + w')``."""
    total = weight + weight_in
    return (theta * weight + theta_in * weight_in) / total, total


def gossip_push_weight(weight: float) -> float:
    """The weight a pushing worker keeps, and also the weight it sends: ``w / 2``."""
    return weight / 2.0


def renormalised(weights: Sequence[float]) -> list[float]:
    """``wᵢ / Σ wⱼ``: mixing weights that sum to 1 again (after a heal lost some of the mass)."""
    total = math.fsum(weights)
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"lightning_mpi: gossip weights {list(weights)} sum to {total}; expected a positive sum")
    return [w / total for w in weights]


def weighted_consensus(thetas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``Σ wᵢ θᵢ / Σ wᵢ``."""
    total = sum(weights)
    weighted = [w * t for w, t in zip(weights, thetas, strict=True)]
    return torch.stack(weighted).sum(dim=0) / total


@options_class
class GoSGDRule(Rule):
    """GoSGD gossip (Blot et al. 2016): after each step a rank pushes its weights to a random peer
    with probability ``p``; the peer merges them weighted. Registered as ``mpi_gosgd``.
    """

    name = "gosgd"
    asynchronous = True

    p: float = option(
        default=0.1,
        doc="probability of a push after each local step, in (0, 1].",
        check=number(0.0, 1.0, low_open=True),
    )
    seed: int = option(
        default=0,
        doc="seed of each rank's gossip generator (the rank is added), for reproducible gossip (≥ 0).",
        check=integer(0),
    )

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundGoSGD:
        return BoundGoSGD(self, transport, params)


class BoundGoSGD(BoundLocalStepRule):
    def __init__(self, rule: GoSGDRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params, rule.name)
        self.rule = rule
        self.flat = FlatParams(self.params, transport.size)
        n = self.flat.flat.numel()
        self.n = n + (n % 2)  # even, so the float64 weight that follows is 8-byte aligned
        self.weight = 1.0 / transport.size
        self.rng = random.Random(rule.seed * 100003 + transport.rank)
        self.sent_to = [0] * transport.size
        self.received = 0
        self.pushes = 0
        self.mailbox: Mailbox | None = None
        self.board: DecisionBoard | None = None
        self.training = False
        self.restored = False  # True once a checkpoint's θᵢ and wᵢ were applied
        self._restore: dict[str, Any] | None = None
        self._renormalise = False  # bound again after a heal: renormalise the weights in on_train_start
        self.started = False  # on_train_start ran: a heal binds again and starts the new binding
        self.drained = False  # the final drain completed
        #: after the final drain: the (θᵢ, wᵢ) this rank brought to the consensus allreduce, and the
        #: messages it expected and received in that drain
        self.last_drain: dict[str, Any] | None = None
        self._reset_stats()

    def on_train_start(self) -> None:
        # The mailbox and the board are made by blocking collectives: every rank must be here first.
        self.transport.barrier(agree=True)
        self.mailbox = Mailbox(self.transport, self.n + 2, TAG)
        self.board = DecisionBoard(self.transport.comm, resources=self.transport.resources)
        self.started = True
        self._apply_restore()
        if self._renormalise:
            self._renormalise = False
            total = torch.tensor([self.weight], dtype=torch.float64)
            self.transport.allreduce_(total, "sum")
            self.weight = renormalised([self.weight, float(total) - self.weight])[0]
        self.training = not self.drained  # bound again after the drain completed: nothing to train

    def _advance(self) -> None:
        """After a local step: merge what arrived, push with probability p, reap finished sends.
        A rejected (non-finite) step advances too, so no push ever carries inf/NaN weights."""
        if self.mailbox is None or self.transport.size == 1:
            return
        start = time.perf_counter()
        for message in self.mailbox.arrived():
            self._merge(message)
        if self.rng.random() < self.rule.p:
            self._push()
        self.mailbox.reap()
        self._wait += time.perf_counter() - start

    def _message(self) -> Tensor:
        msg = torch.empty(self.n + 2, dtype=torch.float32)
        msg[: self.flat.flat.numel()].copy_(self.flat.pull())  # from the device straight into the message
        msg[self.n :].view(torch.float64)[0] = self.weight
        return msg

    def _push(self) -> None:
        peers = [r for r in range(self.transport.size) if r != self.transport.rank]
        peer = self.rng.choice(peers)
        self.weight = gossip_push_weight(self.weight)
        msg = self._message()
        assert self.mailbox is not None  # made in on_train_start; _push runs only after it
        self.mailbox.send(peer, msg)
        self.sent_to[peer] += 1
        self.pushes += 1
        self._bytes += msg.numel() * 4

    def _merge(self, message: Tensor) -> None:
        """Merge a received ``(θ, w)`` message into this worker."""
        w_in = float(message[self.n :].view(torch.float64)[0])
        theta = self.flat.pull_host()
        merged, self.weight = gossip_merge(theta, self.weight, message[: theta.numel()], w_in)
        self.flat.push(merged)
        self.received += 1

    def on_train_end(self) -> None:
        """Drain every message in flight, then all ranks take the weighted consensus."""
        if self.mailbox is None or self.transport.size == 1:
            self.training = False
            return
        self.training = False
        counts = torch.tensor(self.sent_to, dtype=torch.int64)
        self.transport.allreduce_(counts, "sum")
        expected = int(counts[self.transport.rank])
        while self.received < expected:
            self._merge(self.mailbox.wait_for_one())
        self.mailbox.finish_sends()
        theta = self.flat.pull_host()
        self.last_drain = {
            "theta": theta.double().clone(),
            "weight": self.weight,
            "expected": expected,
            "received": self.received,
            "sent": sum(self.sent_to),
        }
        acc = torch.cat([theta.double() * self.weight, torch.tensor([self.weight], dtype=torch.float64)])
        self.transport.allreduce_(acc, "sum")
        self.take_consensus((acc[:-1] / acc[-1]).to(theta.dtype))

    def consensus(self) -> Tensor:
        """This rank's θ (after :meth:`on_train_end`: the consensus), a copy on the host."""
        return self.flat.pull_host().clone()

    def take_consensus(self, theta: Tensor) -> None:
        """Leave the consensus ``theta`` (a :meth:`consensus`) in the parameters, weight 1/W: the
        result of :meth:`on_train_end`, for a survivor that missed its completion."""
        self.flat.push(theta.to(self.flat.flat.dtype))
        self.weight = 1.0 / self.transport.size
        self.drained = True
        self.training = False

    # -- healing (module docstring) -------------------------------------------------------------------
    def healable_after_step(self, optimizer: Any, execute: Execute) -> None:
        # a push is one-sided: a loss seen by the mailbox heals here, and nothing is redone
        execute(one_sided("the gossip", lambda bound: bound.after_step(optimizer)))

    def healable_train_end(self, execute: Execute) -> None:
        # redone over the survivors (every survivor's new binding started alike), or the consensus
        # taken from a survivor that completed it
        execute(
            Operation(
                "the gossip drain",
                lambda bound: bound.on_train_end(),
                result=lambda bound, _: bound.consensus(),
                take=lambda bound, theta, _: bound.take_consensus(theta),
                collective=lambda bound, _: bound.drained and bound.transport.size > 1,
            )
        )

    def hand_over(self, kept: dict[str, Any], joining: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Rank 0's mixing weight split evenly between itself and the ``joining`` ranks, which hold
        its θ, so that Σw and the consensus Σwθ/Σw are unchanged; a new rank keeps its own generator."""
        healed = kept["healed"]
        share = float(healed["weight"]) / (joining + 1)
        return {**kept, "healed": {**healed, "weight": share}}, {
            "healed": {"weight": share, "pushes": 0, "drained": bool(healed["drained"])}
        }

    @property
    def restart_after_heal(self) -> bool:
        """Whether a heal starts the new binding (``on_train_start``, collective): once this one
        started, on every survivor alike, whether it was training, draining or had drained."""
        return self.started

    def heal_state(self) -> dict[str, Any]:
        """What a heal keeps (read on this rank alone): this rank's mixing weight, push count and
        generator, and whether the final drain completed; θᵢ is the module's own. The new
        binding renormalises the weight over the survivors (module docstring)."""
        return {
            "healed": {
                "weight": self.weight,
                "pushes": self.pushes,
                "rng": self.rng.getstate(),
                "drained": self.drained,
            }
        }

    def close(self) -> None:
        if self.training and not self.transport.abandoned:  # closed mid-fit without a failure
            self.board = None  # handler: the board's collective free could hang, skip it
        # After a failed run the frees below are no-ops: the next run settles and reclaims them.
        self.training = False
        if self.board is not None:
            self.board.free()
            self.board = None
        if self.mailbox is not None:  # cancels sends left in flight by an aborted fit
            self.mailbox.close()
            self.mailbox = None

    def state_dict(self) -> dict[str, Any]:
        """Collective (the strategy calls it on every rank): every rank's mixing weight, its own
        weights θᵢ, push count and generator state under ``"ranks"`` (the module state in the
        checkpoint is rank 0's θ only, and gossip ranks differ); the top-level ``weight``/``pushes``
        are this rank's. Models in flight at that moment are not in it: on restore the weights are
        renormalised to sum to 1."""
        local = {
            "weight": self.weight,
            "pushes": self.pushes,
            "rng": self.rng.getstate(),
            "theta": self.flat.pull_host()[: self.flat.bucket.numel].clone(),
        }
        ranks = self.transport.allgather_object(local) if self.transport.size > 1 else [local]
        return {
            "weight": self.weight,
            "pushes": self.pushes,
            "rng": self.rng.getstate(),
            "world_size": self.transport.size,
            "ranks": ranks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Applied in ``on_train_start`` (after Lightning has put rank 0's weights in every module):
        same world size: rank r takes back its own θᵣ and wᵣ / Σw. Another world size: every rank
        starts from the saved weighted consensus Σwθ / Σw with weight 1/W. A :meth:`heal_state`
        is taken at once (the weight is renormalised in ``on_train_start``, a collective)."""
        if "healed" in state:
            healed = state["healed"]
            self.weight = float(healed["weight"])
            self.pushes = int(healed["pushes"])
            if "rng" in healed:  # a new rank (heal="replace") keeps its own generator
                self.rng.setstate(healed["rng"])
            self.drained = bool(healed["drained"])
            self._renormalise = True  # in on_train_start, over the survivors
            return
        self._restore = dict(state)
        if self.mailbox is not None:  # already training: apply now
            self._apply_restore()

    def _apply_restore(self) -> None:
        state, self._restore = self._restore, None
        if state is None:
            return
        ranks = state.get("ranks")
        n = self.flat.bucket.numel
        theta = self.flat.pull_host()
        if not ranks:  # an old checkpoint: only rank 0's weight, no θs
            self.weight = float(state["weight"]) if self.transport.size == 1 else 1.0 / self.transport.size
        elif len(ranks) == self.transport.size:
            mine = ranks[self.transport.rank]
            total = sum(float(r["weight"]) for r in ranks)
            self.weight = float(mine["weight"]) / total
            self.pushes = int(mine.get("pushes", 0))
            if "rng" in mine:
                self.rng.setstate(mine["rng"])
            theta[:n].copy_(mine["theta"].reshape(-1)[:n])
            self.flat.push(theta)
        else:
            consensus = weighted_consensus([r["theta"].double() for r in ranks], [float(r["weight"]) for r in ranks])
            theta[:n].copy_(consensus.reshape(-1)[:n].to(theta.dtype))
            self.flat.push(theta)
            self.weight = 1.0 / self.transport.size
        self.restored = True

    def _reset_stats(self) -> None:
        self._bytes = 0
        self._wait = 0.0
        self._pushes_at = self.pushes
        self._t0 = time.perf_counter()

    def stats(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        out = {
            "weight": self.weight,
            "pushes_per_s": (self.pushes - self._pushes_at) / elapsed,
            "bytes_sent": float(self._bytes),
            "wait_seconds": self._wait,
            "skipped_steps": float(self.guard.skipped_steps),
        }
        self._reset_stats()
        return out
