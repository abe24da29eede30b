"""What each rule keeps through a heal, and the rule's hooks as healing operations
(:mod:`.healing`): which rules heal, how their state is carried to the survivors' binding
(:mod:`.healing_state`), and how an interrupted exchange is put back and redone (here).

A rule that says itself what it keeps has a ``heal_state()`` (read on this rank alone; what
``load_state_dict`` of the new binding takes, with this rank's own part under ``"local"``) and a
``heal_snapshots`` flag, set here before every exchange: it then keeps, while an exchange is in
flight, the state that exchange started from. Its ``replicated_state()`` (what every rank holds
alike, changed only once an exchange completed) goes with the exchanged gradients to a survivor
that missed the exchange's completion.

=========================================  ================================================
rule (bound class)                          kept, and redone
=========================================  ================================================
synchronous, ``average="gradients"``,       its counters; ``before_step`` redone with this
any wire (:class:`~lightning_mpi.rules.     rank's own gradients put back
sync.BoundSync`)
synchronous, ``average="weights"`` or       its counters; ``after_step`` (the weight
``"weights+momentum"``                      average) redone from the weights (and moments)
                                            it started from, kept before it
compressed (top-k, int8, 1-bit:             ``heal_state()``: counters, the momentum
:class:`~lightning_mpi.rules.compressed.    hand-off (replicated); this rank's own residuals
BoundCompressedSync`)                       and DGC momenta as the last completed exchange
                                            left them (owned-chunk residuals dropped: chunks
                                            are cut anew); ``before_step`` redone as sync
PowerSGD (:class:`~lightning_mpi.rules.     ``heal_state()``: step counts and the warm Q's
powersgd.BoundPowerSGD`)                    (replicated: the averaged Q of the last exchange),
                                            this rank's residuals, all as before the
                                            exchange; ``before_step`` redone as sync
model averaging, EASGD                      ``state_dict()`` (counters; EASGD's replicated
                                            center); ``after_step`` redone with the state
                                            before it (weights change only once it completed)
DiLoCo, Streaming DiLoCo                    ``heal_state()``: the outer state (replicated:
(:class:`~lightning_mpi.rules.diloco.       θ_global, outer momentum, counters, schedule, an
BoundDiLoCo`)                               arrived mean Δ), this rank's residuals; an
                                            exchange in flight is kept as the Δ it started
                                            from and started again over the survivors;
                                            ``after_step`` redone with the state before it;
                                            ``on_train_end`` (the final average) redone over
                                            the survivors from the state and weights before
                                            it (:func:`heal_outer_end`)
GoSGD (:class:`~lightning_mpi.rules.        ``heal_state()``: this rank's mixing weight,
gossip.BoundGoSGD`)                         pushes, generator; messages in flight dropped, a
                                            new mailbox, the weights renormalised over the
                                            survivors (the lost rank's mass is gone); the
                                            final drain redone over the survivors
parameter server: DOWNPOUR, AGN, DynSGD,    ``heal_state()``: this rank's shard of the center
ADAG, AEASGD, EAMSGD (:class:`~lightning_   (read again once every survivor agreed to heal),
mpi.rules.server.base.BoundServerRule`)     the center it last pulled and the clock then, the
                                            clock on old rank 0, counters, momentum. The new
                                            binding rebuilds the center: surviving shards as
                                            kept, a lost shard from the freshest pull (the
                                            highest clock at pull, ties the lowest rank), cut
                                            anew (:mod:`~lightning_mpi.rules.server.heal`).
                                            Workers keep their weights; one whose commit was
                                            interrupted restarts from the center. Nothing is
                                            redone while training (a commit is one-sided);
                                            ``on_train_end`` (final commit, barrier) is redone
``mpi_auto`` (:class:`~lightning_mpi.rules.  its decisions' state (arm, counters, schedule,
auto.BoundAuto`)                            measurements; inside a decision, as it started)
                                            and its arm's, as that arm keeps it (above); the
                                            arm's exchanges redone as that arm's; a decision
                                            (probe, dry runs, agreement, switch) redone from
                                            the weights and optimizer state it started from,
                                            or its outcome taken. The survivors agree on the
                                            arm and re-decide over the new world size
                                            (:mod:`.healing_auto`, :mod:`~lightning_mpi.
                                            rules.auto.heal`); ``on_train_end`` on a
                                            Streaming DiLoCo arm redone as DiLoCo's
ZeRO: ``mpi_zero``, ``mpi_zero_bf16``,       ``heal_state()``: counters, this rank's optimizer
``shard_optimizer=True`` (:class:`~         shard and the mirror of its buddy's ((r + 1) % W,
lightning_mpi.rules.zero.BoundZeroRule`)    kept while ``heal`` is set: :mod:`~lightning_mpi.
                                            rules.zero.mirror`), each with its weights, and
                                            the optimizer steps taken. The new binding puts
                                            the weights back whole and rebuilds the whole
                                            optimizer state from them, resharded
                                            (:mod:`.optimizer_sharding`); a lost shard whose
                                            mirror was lost too, or survivors at different
                                            optimizer steps: ``RankFailedError``.
                                            ``before_step`` redone as sync; ``after_step``
                                            (the Allgather) and a lossy wire's final exact
                                            one (``on_train_end``) redone on the rebuilt
                                            weights
any other                                   ``LookupError``: the strategy fails the run
=========================================  ================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_mpi.rules.auto import BoundAuto
from lightning_mpi.rules.averaging import BoundModelAveraging, averages_at
from lightning_mpi.rules.diloco import BoundDiLoCo
from lightning_mpi.rules.gossip import BoundGoSGD
from lightning_mpi.rules.server import BoundServerRule
from lightning_mpi.rules.sync import BoundSync
from lightning_mpi.rules.zero import BoundZeroRule
from lightning_mpi.strategies.healing_state import LOCAL_STEP_RULES, local_state

#: Rules whose ranks are not in step while training (no collective): a loss they notice heals
#: between operations, and their ``on_train_end`` is a healing operation.
_ONE_SIDED = (BoundGoSGD, BoundServerRule)


def exchange_grads(healing: Any, runner: Any, optimizer: Any, module: torch.nn.Module | None) -> bool:
    """The bound rule's exchange of one optimizer step, as the Fabric and Trainer strategies run it
    (after backward, before the update): under ``heal`` (``healing.active``) a healing operation on
    ``module``'s gradients, redone on the healed run (:func:`heal_grads`); otherwise, or where no
    module is given, the rule's own ``before_step``. ``runner.bound`` must be a bound rule.

    Returns whether the update goes on (False: the exchange rejected this step, its gradients are
    not finite). ``module`` is the one the rule is bound to; a strategy binds its rule to a module,
    so ``None`` does not come with a bound rule (the fallback only keeps a missing module from
    reaching :func:`heal_grads`)."""
    bound = runner.bound
    assert bound is not None
    if not healing.active or module is None:
        return bound.before_step(optimizer)
    return heal_grads(healing, runner, optimizer, module)


def heal_grads(healing: Any, runner: Any, optimizer: Any, module: torch.nn.Module) -> bool:
    """The rule's exchange (``before_step``) as a healing operation: this rank's own gradients are
    kept before it, put back before a redo (an interrupted exchange may have averaged some
    buckets already), and the exchanged gradients are what a survivor that missed the exchange's
    completion takes (one copy of the gradients each, every step, while ``heal`` is set)."""
    if isinstance(runner.bound, BoundAuto):
        from lightning_mpi.strategies.healing_auto import auto_grads

        return auto_grads(healing, runner, optimizer, module)
    params = [p for p in module.parameters() if p.requires_grad]
    own = [None if p.grad is None else p.grad.detach().clone() for p in params]

    bound = runner.bound
    # the synchronous rules exchange here every step; of the local-step rules only model averaging
    # does, in its warm-up (gradients averaged)
    if isinstance(bound, BoundModelAveraging):
        exchanges = bound.transport.size > 1 and (
            averages_at(bound.steps + 1, bound.rule.period, bound.rule.sync_warmup_steps) == "gradients"
        )
    else:  # GoSGD's and the parameter server's before_step make no collective (ranks not in step)
        exchanges = type(bound) not in LOCAL_STEP_RULES and not isinstance(bound, _ONE_SIDED)

    def exchange() -> bool:
        bound = runner.bound
        assert bound is not None
        if hasattr(bound, "heal_snapshots"):
            bound.heal_snapshots = True  # keep what the exchange changes, for a redo (its heal_state)
        return bool(bound.before_step(optimizer))

    def put_back() -> None:
        for p, grad in zip(params, own, strict=True):
            p.grad = None if grad is None else grad.clone()

    def keep(accepted: bool) -> tuple[bool, list[torch.Tensor | None], dict[str, Any] | None]:
        # with the exchanged gradients, the state the exchange changes alike on every rank (counters,
        # warm starts): a survivor that takes this result takes that state too
        replicated = getattr(runner.bound, "replicated_state", None)
        grads = [None if p.grad is None else p.grad.detach().cpu().clone() for p in params]
        return accepted, grads, None if replicated is None else replicated()

    def take(kept: tuple[bool, list[torch.Tensor | None], dict[str, Any] | None]) -> bool:
        accepted, grads, replicated = kept
        for p, grad in zip(params, grads, strict=True):
            p.grad = None if grad is None else grad.to(p.device)
        if replicated is not None and runner.bound is not None:
            runner.bound.load_state_dict(replicated)
            took = getattr(runner.bound, "took_exchange", None)
            if took is not None:  # this rank's own feedback, as the exchange it missed leaves it
                took(own)
        return accepted

    return healing.operation("the exchange", exchange, keep, take, put_back, counted=lambda: exchanges)


def _moments(bound: Any, optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's per-parameter float state that ``average="weights+momentum"`` averages (as
    :meth:`~lightning_mpi.rules.sync.BoundSync._momentum_buckets` picks it)."""
    if bound.rule.average != "weights+momentum":
        return []
    found = []
    for p in bound.params:
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == p.shape:
                found.append(value)
    return found


def heal_after_step(healing: Any, runner: Any, optimizer: Any) -> None:
    """The rule's ``after_step`` as a healing operation where it may exchange (model averaging's
    weight average, EASGD's elastic exchange, every ``period`` steps; DiLoCo's outer exchange; the
    synchronous rule's weight average every step with ``average="weights"``): its state is put
    back before a redo, and a survivor that missed the exchange's completion takes the weights and
    state of one that has. The local-step rules change weights only once their exchange completed;
    the synchronous weight average writes them bucket by bucket, so the weights (and, with
    ``"weights+momentum"``, the optimizer's moments) it starts from are kept and put back too."""
    bound = runner.bound
    assert bound is not None
    if healing.active and isinstance(bound, BoundAuto):
        from lightning_mpi.strategies.healing_auto import auto_after_step

        auto_after_step(healing, runner, optimizer)
        return
    exchanged = LOCAL_STEP_RULES.get(type(bound))
    averages_weights = type(bound) is BoundSync and bound.rule.average != "gradients"
    if averages_weights:
        exchanged = lambda now, _before: now.transport.size > 1  # noqa: E731  (every step, once W > 1)
    if healing.active and isinstance(bound, BoundZeroRule):
        # the Allgather of the stepped chunks: redone on the healed run, whose weights and optimizer
        # state were rebuilt from the survivors' shards and mirrors as of this step (a survivor that
        # missed its completion has them so too: nothing to take)
        healing.operation(
            "the allgather",
            lambda: runner.bound.after_step(optimizer),
            lambda _: None,
            lambda _: None,
            counted=lambda: runner.bound.transport.size > 1,
        )
        return
    if healing.active and isinstance(bound, _ONE_SIDED):
        # gossip, a parameter server's commit: no collective, nothing to redo; a loss seen by the
        # mailbox or a window heals here (an interrupted commit is settled by the rebuild)
        where = "the gossip" if type(bound) is BoundGoSGD else "the commit"
        healing.between(where, lambda: bound.after_step(optimizer), None)
        return
    if not healing.active or exchanged is None:
        bound.after_step(optimizer)  # the synchronous rules exchange nothing here (average="gradients")
        return
    params = bound.params
    moving = [*params, *_moments(bound, optimizer)] if averages_weights else list(params)

    def average() -> None:
        if hasattr(runner.bound, "heal_snapshots"):
            runner.bound.heal_snapshots = True  # keep what an exchange starts from (its heal_state)
        runner.bound.after_step(optimizer)

    _redone_from_state(
        healing,
        runner,
        "the weight average",
        average,
        moving,
        restore=averages_weights,
        counted=lambda before: exchanged(runner.bound, before),
    )


def _redone_from_state(
    healing: Any,
    runner: Any,
    where: str,
    exchange: Callable[[], None],
    moving: list[torch.Tensor],
    restore: bool,
    counted: Callable[[dict[str, Any]], bool],
) -> None:
    """``exchange`` (a rule's hook that changes its state and the tensors ``moving``) as a healing
    operation: the rule's local state (:func:`~.healing_state.local_state`) is kept before it and put back
    before a redo, with ``moving`` as they were where ``restore`` (an exchange that may have
    written some of them already); a survivor that missed the completion takes the state and
    ``moving`` of one that completed it, keeping its own part (``"local"``: its residuals, as
    before the exchange: that exchange's compression error on this rank is not fed back).
    ``counted(before)``: whether the exchange went over the wire."""
    before = local_state(runner.bound)
    start = [t.detach().clone() for t in moving] if restore else []

    def keep(_: None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return local_state(runner.bound), [t.detach().cpu().clone() for t in moving]

    def take(kept: tuple[dict[str, Any], list[torch.Tensor]]) -> None:
        state, values = kept
        if "local" in state and "local" in before:
            state = {**state, "local": before["local"]}
        runner.bound.load_state_dict(state)
        with torch.no_grad():
            for t, value in zip(moving, values, strict=True):
                t.copy_(value)

    def put_back() -> None:
        runner.bound.load_state_dict(before)
        with torch.no_grad():
            for t, value in zip(moving if restore else [], start, strict=True):
                t.copy_(value)

    healing.operation(where, exchange, keep, take, put_back, counted=lambda: counted(before))


def heal_train_end(healing: Any, runner: Any) -> None:
    """The rule's ``on_train_end`` (collective for the asynchronous rules); for GoSGD under
    ``heal`` a healing operation: a loss in its drain heals, and the drain is redone over the
    survivors (every survivor's new binding started alike), or a survivor that missed its completion
    takes the consensus from one that completed it. The same for a parameter-server rule: its
    last commit, the barrier after it and the read of the center are redone over the survivors on
    the rebuilt center (a completed last commit is not made twice). DiLoCo's and Streaming
    DiLoCo's final average: :func:`heal_outer_end`; ``mpi_auto``'s, where its arm is Streaming
    DiLoCo, the same on that arm (:func:`~.healing_auto.auto_train_end`)."""
    bound = runner.bound
    if bound is None:
        return
    if healing.active and isinstance(bound, BoundAuto):
        from lightning_mpi.strategies.healing_auto import auto_train_end

        auto_train_end(healing, runner)
        return
    if healing.active and isinstance(bound, BoundDiLoCo):
        heal_outer_end(healing, runner)
        return
    if healing.active and isinstance(bound, BoundZeroRule):
        # a lossy wire's last exact Allgather of the master weights: redone on the healed run (whose
        # masters were rebuilt from the survivors' shards and copies)
        healing.operation(
            "the final allgather",
            lambda: runner.bound.on_train_end(),
            lambda _: None,
            lambda _: None,
            counted=lambda: runner.bound.codec.lossy and runner.bound.transport.size > 1,
        )
        return
    if not healing.active or not isinstance(bound, _ONE_SIDED):
        bound.on_train_end()
        return
    if isinstance(bound, BoundServerRule):
        healing.operation(
            "the final commit",
            lambda: runner.bound.on_train_end(),
            lambda _: runner.bound.flat.pull_host().clone(),
            lambda center: runner.bound.take_center(center),
            counted=lambda: runner.bound.transport.size > 1,
        )
        return

    def drain() -> None:
        runner.bound.on_train_end()

    def keep(_: None) -> torch.Tensor:
        consensus: torch.Tensor = runner.bound.consensus()
        return consensus

    healing.operation(
        "the gossip drain",
        drain,
        keep,
        lambda theta: runner.bound.take_consensus(theta),
        counted=lambda: runner.bound.drained and runner.bound.transport.size > 1,
    )


def heal_outer_end(healing: Any, runner: Any) -> None:
    """DiLoCo's and Streaming DiLoCo's ``on_train_end`` under ``heal`` as a healing operation: the
    final average of the replicas (an exchange in flight completed, the steps since each
    fragment's last exchange exchanged, both applied by averaging) is redone over the survivors
    when a rank is lost in it, so that the survivors end bitwise identical on the mean of *their*
    replicas (the lost rank's replica is left out of the mean).

    Before it, this rank keeps the rule's :meth:`~lightning_mpi.rules.diloco.BoundDiLoCo.heal_state`
    (with ``heal_snapshots`` on, an exchange in flight is kept as the Δ it started from) and its
    local weights; a redo puts both back into the healed run's binding (an interrupted average
    may have averaged and pushed some fragments already), which starts the exchange in flight
    again over the survivors. A survivor that missed the completion takes the averaged weights and
    the outer state from one that completed it (its own residuals as before the average)."""
    runner.bound.heal_snapshots = True  # keep what an exchange starts from (its heal_state)

    def average() -> None:
        runner.bound.heal_snapshots = True
        runner.bound.on_train_end()

    _redone_from_state(
        healing,
        runner,
        "the final average",
        average,
        list(runner.bound.params),
        # an interrupted average may have averaged and pushed some fragments into the weights
        restore=True,
        # every rank runs the same schedule: each averaged fragment is one outer step, and at W = 1
        # nothing went over the wire
        counted=lambda before: runner.bound.transport.size > 1 and runner.bound.outer_steps != before["outer_steps"],
    )
