"""``heal="shrink"``: the survivors of a dead rank go on training (lightning_mpi.strategies.healing).

The options, the reconciliation of survivors, what the rules keep and the refusals are checked
everywhere (cheap). The healing itself runs under Open MPI with ULFM
(``LIGHTNING_MPI_TEST_MPI=openmpi``, ``./run test-openmpi``), in one launch of
``tests/scripts/heal_train.py`` through ``lightning-mpi --heal -n 10``: first one Fabric run per
rule whose state a heal carries, each losing its last rank in the step of an exchange (top-k with
error feedback, PowerSGD, DiLoCo, Streaming DiLoCo with its exchange in flight, the synchronous
rule averaging weights: W 10 -> 5); then a Trainer run on ``SyncStrategy(exchange="asa")`` whose
rank 0 dies in the middle of writing a checkpoint (W 5 -> 4), with validation, checkpoints and
early stopping going on (outside CI, ``-n 12``: W 7 -> 4, losing rank 0 mid-epoch, a rank at the
end of its validation batch and the rank 0 of then in a checkpoint write); then
``heal="replace"`` on the four left; then Fabric runs built after those heals lose one rank
each: ``ModelAveragingStrategy`` (4 -> 3),
``EASGDStrategy`` (3 -> 2); then ``min_ranks=2`` stops the last two when one more dies. The
survivors must exit 0, finish every step, end bitwise identical, and equal a one-process replay
over the ranks alive at each step, with the same samples (for the compressed rules, a replay of
the compression with each rank's residual carried through the heal); the sampler shards over the
survivors from the next epoch. The asynchronous rules have their own 4-rank launch, outside the
Open MPI CI run: DOWNPOUR (its center rebuilt over the survivors, checked value by value), then
GoSGD. So has the ``outer`` launch (4 ranks, outside CI, ``-k outer``): ``heal="replace"`` under the
Trainer with top-k, DiLoCo and Streaming DiLoCo, then a rank lost inside DiLoCo's final average
(Fabric's ``finish_training``, the Trainer's ``on_train_end``).
So has ``mpi_auto`` (a loss in its Streaming DiLoCo arm's final average, one inside a decision, one in
its redo, one in its arm's exchange, then ``heal="replace"`` under the Trainer; ``-k mpi_auto``).
So has ZeRO (``shard_optimizer=True`` with Adam, Fabric 5 -> 4 -> 3 then the Trainer 3 -> 2, the lost
shards rebuilt from the survivors' buddy copies; ``-k zero``).
``heal="replace"`` with DOWNPOUR, PowerSGD, EASGD, GoSGD and ZeRO under the Trainer, and a Fabric
loop, has its own launch of 3 ranks and 3 spares, in the Open MPI CI run (``replace_rules``: each
phase loses its last rank and lets a replacement in, a spare in the first three, a spawned process
in the others; the center is re-cut over the grown run, GoSGD's rank 0 shares its weight, ZeRO's
optimizer state is resharded over the grown run and matches a one-process Adam, the Fabric loop
matches one too).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from lightning_mpi.comm.errors import RankFailedError
from lightning_mpi.comm.ulfm import FT_ENV
from lightning_mpi.strategies.common_options import CommonOptions
from tests.launcher.helpers import finish, launch
from tests.mpi_utils import REPO, mpi_env, mpi_flavor, require_ulfm

SCRIPT = REPO / "tests" / "scripts" / "heal_train.py"
#: ranks launched: the first Fabric phases (one rule each) lose one each, down to the Trainer's 5
LAUNCHED = 10
#: the launch outside CI whose Trainer phase loses three ranks (in training, validation, a save)
EVERYWHERE_LAUNCHED = 12
REPLACEMENT = 12  # the launch rank a replacement records under (tests/scripts/heal_train.py)
#: the Fabric phases before the Trainer's, in order, each on one more rank than the next
FIRST_PHASES = ("topk", "powersgd", "diloco", "streaming", "weights")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"heal": "grow"}, r"heal='grow' is not one of None, 'shrink', 'replace'"),
        ({"heal": "shrink", "min_ranks": 0}, r"min_ranks"),
        ({"min_ranks": 2}, r"min_ranks=2 is only read when the run heals: set heal='shrink'"),
    ],
)
def test_heal_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CommonOptions(**kwargs)
    assert CommonOptions(heal="shrink", min_ranks=2).heal == "shrink"
    assert CommonOptions(heal="replace", min_ranks=2).heal == "replace"
    assert CommonOptions().heal is None and CommonOptions().min_ranks is None


@pytest.mark.timeout(10)
def test_what_rules_keep_through_a_heal_and_those_that_cannot_say_so():
    from lightning_mpi.rules.base import BoundRule
    from lightning_mpi.rules.sync import BoundSync, SyncRule

    def bound(rule):  # what heal_state reads, without a transport
        sync = object.__new__(BoundSync)
        sync.rule, sync.skipped_steps = rule, 3
        return sync

    assert bound(SyncRule()).heal_state() == {"skipped_steps": 3}
    assert bound(SyncRule(average="weights")).heal_state() == {"skipped_steps": 3}
    assert object.__new__(BoundRule).heal_state() == {}  # by default: its checkpoint state
    # the parameter-server rules heal (test_parameter_server_*), but not outside training: their
    # center lives in windows that exist only while they train
    from lightning_mpi.rules.server import DownpourRule
    from lightning_mpi.rules.server.rules import BoundDownpour

    server = object.__new__(BoundDownpour)
    server.rule, server.center, server.clock, server.started = DownpourRule(), None, None, False
    assert server.heal_state() == {}  # not started yet: nothing to keep, it starts over the survivors
    server.started = True
    with pytest.raises(LookupError, match="downpour rule's center exists only while it trains"):
        server.heal_state()
    # ZeRO heals from the buddy copies it keeps only while heal is set (test_zero_heals_*)
    from lightning_mpi.rules.zero import BoundZeroRule

    zero = object.__new__(BoundZeroRule)
    zero.sharded, zero.mirror, zero.skipped_steps = None, None, 0
    with pytest.raises(LookupError, match="only copy of each rank's optimizer shard on that rank unless heal"):
        zero.heal_state()


@pytest.mark.timeout(10)
def test_a_lost_shard_of_the_center_is_rebuilt_from_the_freshest_pull_and_cut_anew():
    """The pure part of a parameter server's heal (lightning_mpi.rules.server.heal): the freshest
    pull (highest clock at pull, ties to the lowest rank), the center assembled from the surviving
    shards and the chosen pull, the clock, and the shards cut anew for the new world size."""
    from lightning_mpi.comm.window import shard_bounds
    from lightning_mpi.rules.server.heal import freshest, healed_clock, padded, rebuild_center

    # old W = 4, n = 10 padded to 12 (shards of 3); ranks 1 and 3 lost
    assert freshest({0: 7, 2: 9}, [3, 1]) == {1: 2, 3: 2}
    assert freshest({2: 9, 0: 9}, [1]) == {1: 0}  # a tie: the lowest old rank, whatever the order
    with pytest.raises(ValueError, match="no survivor"):
        freshest({}, [0])
    assert healed_clock({0: 7, 2: 9}, [11]) == 11  # old rank 0 (the clock's host) survived
    assert healed_clock({2: 9, 3: 8}, []) == 9  # it did not: the freshest pull's clock
    shards = {0: torch.tensor([0.0, 1, 2]), 2: torch.tensor([6.0, 7, 8])}
    pull = torch.arange(100.0, 112.0)  # rank 2's pulled center (old layout, padded)
    pulled = {1: pull[3:6], 3: pull[9:12]}
    center = rebuild_center(shards, pulled, 4, 10)
    assert center.tolist() == [0.0, 1, 2, 103, 104, 105, 6, 7, 8, 109]
    with pytest.raises(ValueError, match="shard 1 of 4 is in neither"):
        rebuild_center(shards, {3: pull[9:12]}, 4, 10)
    with pytest.raises(ValueError, match="shard 0 of 4 is in both"):
        rebuild_center(shards, {**pulled, 0: pull[:3]}, 4, 10)
    # two survivors: padded to 10 (a multiple of 2), each hosts half
    recut = padded(center, 10)
    (lo0, hi0), (lo1, hi1) = shard_bounds(10, 2, 0), shard_bounds(10, 2, 1)
    assert recut[lo0:hi0].tolist() == [0.0, 1, 2, 103, 104] and recut[lo1:hi1].tolist() == [105.0, 6, 7, 8, 109]
    assert padded(center, 12)[10:].tolist() == [0.0, 0.0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("interrupted", [False, True], ids=["between-commits", "commit-interrupted"])
@pytest.mark.parametrize("name", ["downpour", "eamsgd"])
def test_a_parameter_server_binding_rebuilt_from_its_heal_state_goes_on(name, interrupted):
    """On one rank (no MPI peers): a DOWNPOUR (EAMSGD) binding's heal_state(), its shard read again
    when the failed run is released (close() of an abandoned run), bound again: the new center is
    that shard, the counters go on, and the worker keeps its weights, pulled center (and momentum),
    or, when its commit was interrupted, restarts from the center (momentum zeroed)."""
    from mpi4py import MPI
    from torch import nn

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.server import DownpourRule, EAMSGDRule

    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(net.parameters())
    rule = DownpourRule(period=2) if name == "downpour" else EAMSGDRule(period=2)
    opt = torch.optim.SGD(params, lr=0.1)
    bound = rule.bind(Transport(MPI.COMM_SELF), params)
    bound.on_train_start()
    for _ in range(3):  # one commit (step 2), one step since
        opt.zero_grad()
        net(torch.randn(6, 3)).pow(2).mean().backward()
        assert bound.before_step(opt)
        opt.step()
        bound.after_step(opt)
    bound._exchanging = interrupted  # as if a loss had been noticed inside a commit
    state = bound.heal_state()
    center, _ = bound.windows()
    center.add(torch.full_like(bound.ref, 0.5))  # a commit that lands before every survivor stopped
    landed = bound.center.read(torch.empty_like(bound.ref))
    weights = torch.cat([p.detach().flatten() for p in params])
    momentum = [b.clone() for b in bound.momentum_bufs]
    assert len(momentum) == (2 * 2 if name == "eamsgd" else 0) and all(b.abs().sum() > 0 for b in momentum)
    bound.transport.resources.abandon()
    bound.close()  # as heal_run's before_release: the shard is read again here
    again = rule.bind(Transport(MPI.COMM_SELF), params)
    again.load_state_dict(state)
    again.on_train_start()
    bound.transport.resources.free_abandoned()  # as heal_run releases the failed run
    assert again.steps == 3 and again.commits == 1 and again.clock_at_pull == 1  # one commit so far
    assert again.last_heal["lost"] == [] and again.last_heal["clock"] == 1
    assert torch.equal(again.center.read(torch.empty_like(again.ref)), landed)
    now = torch.cat([p.detach().flatten() for p in params])
    if interrupted:  # from the center: the shards its commit reached keep it, it is not sent again
        assert torch.equal(now, landed[: now.numel()]) and torch.equal(again.ref, landed)
        assert all(b.abs().sum() == 0 for b in again.momentum_bufs)
    else:  # its own weights, against the center it pulled at its commit
        assert torch.equal(now, weights) and torch.equal(again.ref, bound.ref)
        assert all(torch.equal(a, b) for a, b in zip(again.momentum_bufs, momentum, strict=True))
    again.on_train_end()
    again.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("streaming", [False, True], ids=["diloco", "streaming"])
def test_diloco_heal_state_carries_the_outer_state_and_restarts_an_exchange_in_flight(streaming):
    """On one rank (no MPI peers): a DiLoCo run bound again mid-run from its ``heal_state()``
    continues exactly as the uninterrupted one, also while a Streaming DiLoCo exchange is in flight
    (kept as the Δ it started from, started again by the new binding)."""
    from mpi4py import MPI
    from torch import nn

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.diloco import DiLoCoRule, StreamingDiLoCoRule

    if streaming:
        rule = StreamingDiLoCoRule(period=4, fragments=2, overlap_steps=1, mix_alpha=0.5, wire="fp32")
    else:
        rule = DiLoCoRule(period=3)

    def run(cut: int | None) -> tuple[list[torch.Tensor], list]:
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        params = list(net.parameters())
        bound = rule.bind(Transport(MPI.COMM_SELF), params)
        bound.healing = True
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        bound.on_train_start()
        statuses = []
        for step in range(11):
            if step == cut:  # as a heal: the state read on this rank, a new binding
                state = bound.heal_state()
                bound.close()
                bound = rule.bind(Transport(MPI.COMM_SELF), params)
                bound.healing = True
                bound.load_state_dict(state)
                bound.on_train_start()
            opt.zero_grad()
            net(torch.randn(6, 3)).pow(2).mean().backward()
            assert bound.before_step(opt)
            opt.step()
            bound.after_step(opt)
            statuses.append([f.status for f in bound.fragments])
        bound.on_train_end()
        bound.close()
        return [p.detach().clone() for p in params], statuses

    whole, statuses = run(None)
    # cut after a Nesterov outer step (the first one only averages), while Streaming DiLoCo's
    # fragment 0 is in flight (its third exchange, started after step 10, used after step 11)
    cut = 10 if streaming else 7
    assert not streaming or statuses[cut - 1][0] == "running"
    healed, _ = run(cut)
    assert all(torch.equal(a, b) for a, b in zip(whole, healed, strict=True))


@pytest.mark.timeout(30)
def test_diloco_final_average_interrupted_midway_is_put_back_and_redone_or_taken():
    """On one rank (no MPI peers): Streaming DiLoCo's ``on_train_end`` (three fragments: one
    exchange in flight, two fragments' last steps) as a healing operation
    (:meth:`~lightning_mpi.rules.diloco.BoundDiLoCo.healable_train_end`). A loss at the third fragment's
    start, once the in-flight exchange and the second fragment were averaged and pushed into the
    weights: the new binding, loaded as a heal loads it, gets the state and weights from before the
    average back and redoes it, ending bitwise where an uninterrupted end does; a survivor that
    missed the completion takes the weights and outer state of one that completed it."""
    from types import SimpleNamespace

    from mpi4py import MPI
    from torch import nn

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.diloco import BoundDiLoCo, StreamingDiLoCoRule

    rule = StreamingDiLoCoRule(period=6, fragments=3, overlap_steps=1, mix_alpha=0.5, wire="fp32")

    class Lost(Exception):
        pass

    def trained():
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        runner = SimpleNamespace(bound=rule.bind(Transport(MPI.COMM_SELF), list(net.parameters())))
        runner.bound.healing = True
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        runner.bound.on_train_start()
        for _ in range(8):  # fragment 0 starts after step 8: in flight at the end; 1 and 2 have steps since
            opt.zero_grad()
            net(torch.randn(6, 3)).pow(2).mean().backward()
            assert runner.bound.before_step(opt)
            opt.step()
            runner.bound.after_step(opt)
        assert [f.status for f in runner.bound.fragments] == ["running", "idle", "idle"]
        return net, runner

    class Healing:  # the strategy's executor with one loss: the new binding loaded from heal_state, then the redo
        redone = 0

        def __init__(self, runner, taken=None):
            self.runner, self.taken = runner, taken

        @property
        def bound(self):
            return self.runner.bound

        def __call__(self, op):
            assert op.where == "the final average"
            started = op.start(self.bound)
            if self.taken is not None:  # a survivor behind: takes the result of one that completed
                return op.take(self.bound, self.taken, started)
            try:
                op.run(self.bound)
            except Lost:
                state = self.runner.bound.heal_state()
                self.runner.bound.close()
                self.runner.bound = rule.bind(Transport(MPI.COMM_SELF), self.runner.bound.params)
                self.runner.bound.healing = True
                self.runner.bound.load_state_dict(state)
                op.put_back(self.bound, started)
                self.put_back = [f.status for f in self.runner.bound.fragments], [p.clone() for p in net.parameters()]
                self.redone += 1
                op.run(self.bound)
            assert not op.collective(self.bound, started)  # one rank: nothing went over the wire
            self.kept = op.result(self.bound, None)

    net, runner = trained()
    runner.bound.healable_train_end(Healing(runner))
    whole = [p.detach().clone() for p in net.parameters()]

    net, runner = trained()
    starts = BoundDiLoCo._start

    def dies_at_the_second_start(self, index):
        if index == 2:
            BoundDiLoCo._start = starts  # the loss happens once
            raise Lost
        starts(self, index)

    healing = Healing(runner)
    before = [p.detach().clone() for p in net.parameters()]
    BoundDiLoCo._start = dies_at_the_second_start
    try:
        runner.bound.healable_train_end(healing)
    finally:
        BoundDiLoCo._start = starts
    assert healing.redone == 1
    # the redo starts from the state before the average: the exchange in flight to start again over
    # the survivors (the lost rank's Δ left out), the weights as training left them
    statuses, weights = healing.put_back
    assert statuses == ["restart", "idle", "idle"]
    assert all(torch.equal(a, b) for a, b in zip(before, weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(whole, net.parameters(), strict=True))
    assert all(f.status == "idle" for f in runner.bound.fragments)

    net, runner = trained()  # behind: takes the weights and the outer state of one that completed
    runner.bound.healable_train_end(Healing(runner, taken=healing.kept))
    assert all(torch.equal(a, b) for a, b in zip(whole, net.parameters(), strict=True))
    assert runner.bound.outer_steps == healing.runner.bound.outer_steps


@pytest.mark.timeout(10)
def test_a_powersgd_survivor_that_took_the_exchange_keeps_the_residual_it_would_have_left():
    """A survivor that missed the completion of a PowerSGD exchange takes the approximation M̂ (the
    gradient) from one that completed it; its residual, still as before that exchange, becomes
    M + e − M̂, what the exchange's commit would have left (no MPI: one bucket, no team)."""
    from types import SimpleNamespace

    from lightning_mpi.comm.buffers import make_buckets
    from lightning_mpi.rules.powersgd import BoundPowerSGD, PowerSGDRule
    from lightning_mpi.rules.powersgd.bucket import PowerSGDBucket
    from lightning_mpi.rules.powersgd.lowrank import compression_rank

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(8))]
    bound = object.__new__(BoundPowerSGD)
    bound.rule, bound.transport, bound.steps, bound.params = PowerSGDRule(), SimpleNamespace(size=2), 1, params
    bound._index = {id(p): i for i, p in enumerate(params)}
    (plain,) = make_buckets(params, 1, bucket_bytes=1 << 20)
    bound.buckets = [PowerSGDBucket(plain, None, lambda shape: compression_rank(shape, 1, 2.0), True)]
    (c,) = bound.buckets[0].compressed
    before = torch.randn(8, 6)
    bound.buckets[0].residual_of(c).copy_(before)
    own = [torch.randn(8, 6), torch.randn(8)]
    params[0].grad, params[1].grad = torch.randn(8, 6), torch.randn(8)  # taken: M̂ and the plain mean
    bound.took_exchange(own)
    assert torch.allclose(bound.buckets[0].residual_of(c), own[0] + before - params[0].grad)
    bound.rule, bound.steps = PowerSGDRule(start_step=5), 3  # the step taken averaged plainly: no feedback
    bound.buckets[0].residual_of(c).copy_(before)
    bound.took_exchange(own)
    assert torch.equal(bound.buckets[0].residual_of(c), before)


@pytest.mark.timeout(10)
def test_a_rule_that_cannot_heal_fails_the_run_naming_itself():
    from lightning_mpi.comm.errors import RankFailedError
    from lightning_mpi.comm.errors import ProcessFailed
    from lightning_mpi.rules.base import BoundRule
    from lightning_mpi.strategies.healing import HealNotSupported, RunHealing

    class CannotHeal(BoundRule):  # a rule that says it cannot heal (the contract's heal_state)
        def heal_state(self):
            raise LookupError("its state lives only on the lost rank")

    healing = RunHealing(None, None, None, None, lambda: object.__new__(CannotHeal), print, print, "gosgd")
    assert healing.operation("x", lambda: 5) == 5 and healing.stats == {}  # heal=None: inert
    healing.mode = "shrink"  # as if this MPI could heal

    def dies():
        raise ProcessFailed((2,), "allreduce")

    with pytest.raises(HealNotSupported, match=r"heal='shrink' is not supported for rule 'gosgd' yet") as caught:
        healing.operation("the exchange", dies)
    assert isinstance(caught.value, RankFailedError) and caught.value.rank == 2
    with pytest.raises(ValueError, match="not a failure"):  # anything else passes unchanged
        healing.operation("x", lambda: (_ for _ in ()).throw(ValueError("not a failure")))


@pytest.mark.timeout(180)
def test_heal_under_an_mpi_that_cannot_names_the_fix(tmp_path):
    # A singleton (no mpiexec): MPICH has no ULFM; Open MPI was not launched with --with-ft ulfm.
    code = (
        "from lightning_mpi.comm.ulfm import HealUnavailable\n"
        "from lightning_mpi.lightning import SyncStrategy\n"
        "try:\n"
        "    SyncStrategy(heal='shrink')\n"
        "except HealUnavailable as error:\n"
        "    print(error)\n"
        "SyncStrategy(heal=None)\n"
        "print('heal=None ok')\n"
    )
    env = mpi_env()
    env.pop(FT_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    assert "fix: run under Open MPI 5 with ULFM: launch with `lightning-mpi --heal" in out.stdout
    assert ("this MPI (MPICH" in out.stdout) == (mpi_flavor() == "mpich")
    assert "heal=None ok" in out.stdout


def _replay(initial: list, steps: list[list[list[int]]]) -> list:
    """One process: each step averages the MSE gradients of the batches that the ranks alive at
    that step trained on (``steps[s]``: one list of sample indices per rank), then SGD."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from heal_train import LR, Indexed, make_net
    finally:
        sys.path.pop(0)
    net = make_net()
    with torch.no_grad():
        for p, w in zip(net.parameters(), initial, strict=True):
            p.copy_(torch.tensor(w, dtype=torch.float64).view_as(p))
    data = Indexed()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for batches in steps:
        grads = []
        for index in batches:
            net.zero_grad()
            torch.nn.functional.mse_loss(net(data.x[index]), data.y[index]).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *per_rank in zip(net.parameters(), *grads, strict=True):
            p.grad = sum(per_rank) / len(per_rank)
        opt.step()
    return [p.detach().double().flatten().tolist() for p in net.parameters()]


def _replay_local_steps(start: list[torch.Tensor], steps: list[dict[int, list[int]]], period: int, combine) -> dict:
    """One process per rank from the flat weights ``start``: each rank alive at a step takes an SGD
    step on its own batch (``steps[s]``: launch rank -> sample indices), and every ``period`` steps
    ``combine(nets)`` runs on the nets of the ranks alive then."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from heal_train import LR, Indexed, make_net
    finally:
        sys.path.pop(0)
    data = Indexed()
    nets = {}
    for rank in steps[0]:
        nets[rank] = make_net()
        with torch.no_grad():
            for p, w in zip(nets[rank].parameters(), start, strict=True):
                p.copy_(w.view_as(p))
    opts = {rank: torch.optim.SGD(net.parameters(), lr=LR) for rank, net in nets.items()}
    for step, batches in enumerate(steps):
        for rank in [r for r in nets if r not in batches]:  # died
            del nets[rank]
        for rank, index in batches.items():
            opts[rank].zero_grad()
            torch.nn.functional.mse_loss(nets[rank](data.x[index]), data.y[index]).backward()
            opts[rank].step()
        if (step + 1) % period == 0:
            with torch.no_grad():
                combine(list(nets.values()))
    return nets


def _replay_model_averaging(initial: list, steps: list[dict[int, list[int]]], period: int) -> list:
    """Local SGD steps; every ``period`` steps the ranks alive then replace their weights by the mean."""

    def average(nets: list) -> None:
        for ps in zip(*(net.parameters() for net in nets), strict=True):
            mean = torch.stack([p.detach() for p in ps]).mean(0)
            for p in ps:
                p.copy_(mean)

    nets = _replay_local_steps([torch.tensor(w, dtype=torch.float64) for w in initial], steps, period, average)
    net = next(iter(nets.values()))
    return [p.detach().double().flatten().tolist() for p in net.parameters()]


def _replay_easgd(initial: list, steps: list[dict[int, list[int]]], period: int) -> list:
    """Synchronous EASGD: local SGD steps; every ``period`` steps, with the W ranks alive then and
    α = 0.9 / W, θᵢ ← θᵢ − α(θᵢ − c) and c ← c + α Σᵢ(θᵢ − c); the center at the end."""
    center = [torch.tensor(w, dtype=torch.float32) for w in initial]

    def elastic(nets: list) -> None:
        alpha = 0.9 / len(nets)
        for i, ps in enumerate(zip(*(net.parameters() for net in nets), strict=True)):
            total = sum(p.detach().flatten() - center[i] for p in ps)
            for p in ps:
                p.sub_(alpha * (p.detach() - center[i].view_as(p)))
            center[i] = center[i] + alpha * total

    _replay_local_steps(center, steps, period, elastic)
    return [c.double().tolist() for c in center]


def _script_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import heal_train
    finally:
        sys.path.pop(0)
    return heal_train


def _replay_compressed(initial: list, steps: list[dict[int, list[int]]], compress) -> list:
    """One process: at each step every rank alive then (``steps[s]``: launch rank -> sample indices)
    computes its gradients; ``compress(grads, residuals, step)`` turns them (launch rank -> list of
    gradients) into the step's gradient, updating ``residuals`` (launch rank -> its own state, kept
    through a heal; a dead rank's is never used again); then SGD."""
    script = _script_module()
    net = script.make_net()
    with torch.no_grad():
        for p, w in zip(net.parameters(), initial, strict=True):
            p.copy_(torch.tensor(w, dtype=torch.float64).view_as(p))
    data = script.Indexed()
    opt = torch.optim.SGD(net.parameters(), lr=script.LR)
    residuals: dict = {}
    for step, batches in enumerate(steps):
        grads = {}
        for rank, index in sorted(batches.items()):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(data.x[index]), data.y[index]).backward()
            grads[rank] = [p.grad.clone() for p in net.parameters()]
        for p, g in zip(net.parameters(), compress(grads, residuals, step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach().double().flatten().tolist() for p in net.parameters()]


def _topk(ratio: float):
    """Top-k with error feedback over the whole model (one bucket): each rank adds its gradient to
    its residual, sends its ⌈ratio·n⌉ largest-magnitude entries and keeps the rest; the mean of
    what was sent is the gradient."""
    from lightning_mpi.comm.sparse import topk_count

    def compress(grads: dict, residuals: dict, step: int) -> list:
        shapes = [g.shape for g in next(iter(grads.values()))]
        sent = []
        for rank, g in grads.items():
            acc = torch.cat([t.flatten() for t in g]) + residuals.get(rank, 0.0)
            top = acc.abs().topk(topk_count(acc.numel(), ratio)).indices
            s = torch.zeros_like(acc)
            s[top] = acc[top]
            residuals[rank] = acc - s
            sent.append(s)
        mean = torch.stack(sent).mean(0)
        sizes = [math.prod(shape) for shape in shapes]
        return [part.view(shape) for part, shape in zip(torch.split(mean, sizes), shapes, strict=True)]

    return compress


def _powersgd(grads: dict, residuals: dict, step: int) -> list:
    """PowerSGD at rank 1 (torch's defaults): the first layer's 8 x 6 weight is compressed (M + e,
    one power step from the warm Q, e <- M - M̂; the first Q drawn from seed 0, step 0, bucket 0),
    every other tensor averaged; the Q is kept under the key ``"q"``."""
    from lightning_mpi.rules.powersgd.lowrank import power_step, q_seed, random_qs

    ranks = sorted(grads)
    matrices = [grads[r][0] + residuals.get(r, 0.0) for r in ranks]
    q = residuals.get("q")
    if q is None:
        q = random_qs([(matrices[0].shape[1], 1)], q_seed(0, step, 0), matrices[0].dtype)[0]
    approx, residuals["q"] = power_step(matrices, q)
    for r, m in zip(ranks, matrices, strict=True):
        residuals[r] = m - approx
    rest = [torch.stack(per_rank).mean(0) for per_rank in zip(*(grads[r][1:] for r in ranks), strict=True)]
    return [approx, *rest]


def _replay_diloco(
    initial: list,
    steps: list[dict[int, list[int]]],
    period: int,
    fragments: int,
    overlap_steps: int,
    mix_alpha: float,
    lost_at_end: tuple[int, ...] = (),
) -> list:
    """(Streaming) DiLoCo in one process, outer lr 0.7, Nesterov momentum 0.9, one warm-up outer step,
    fp32: each rank alive at a step takes its own SGD step; fragment f starts an exchange after
    step t = offset_f + kH (Δᵢ = θ_global − θᵢ, kept per rank) and uses it τ steps later: the mean
    Δ over the ranks alive then (a rank lost in between took its Δ along), the outer step, then
    θᵢ ← α θᵢ + (1 − α) θ_global; at the end an exchange in flight and the fragments' last steps are
    applied by averaging (θ_global ← θ_global − mean Δ, no outer step), and every rank holds θ_global,
    the mean of the replicas, which is returned. A rank that first appears at a step (a replacement)
    starts its replica from θ_global then (fresh SGD) and takes part from the next exchange started;
    the ranks ``lost_at_end`` are left out of the final average (lost in it)."""
    from lightning_mpi.rules.diloco.outer import (
        averages_at,
        last_start,
        make_outer_optimizer,
        mix_,
        outer_step_,
        starts_at,
    )
    from lightning_mpi.rules.diloco.streaming import fragment_offsets, split_fragments

    script = _script_module()
    data = script.Indexed()
    nets = {}
    for rank in steps[0]:
        nets[rank] = script.make_net()
        with torch.no_grad():
            for p, w in zip(nets[rank].parameters(), initial, strict=True):
                p.copy_(torch.tensor(w, dtype=torch.float64).view_as(p))
    opts = {rank: torch.optim.SGD(net.parameters(), lr=script.LR) for rank, net in nets.items()}
    group = split_fragments([p.numel() for p in nets[0].parameters()], fragments)
    offsets = fragment_offsets(period, fragments)

    def local(net, f: int) -> list:
        return [p for p, g in zip(net.parameters(), group, strict=True) if g == f]

    theta = [torch.cat([p.detach().flatten() for p in local(nets[0], f)]) for f in range(fragments)]
    outer = make_outer_optimizer(theta, 0.7, 0.9)
    sent: dict[int, dict[int, torch.Tensor]] = {}  # fragment -> rank -> Δᵢ
    due: dict[int, int] = {}
    started: dict[int, int] = {}

    def start(f: int, step: int) -> None:
        sent[f] = {r: theta[f] - torch.cat([p.detach().flatten() for p in local(net, f)]) for r, net in nets.items()}
        started[f], due[f] = step, step + overlap_steps

    def finish(f: int, alpha: float, average: bool = False) -> None:
        mean = torch.stack([sent[f][r] for r in nets if r in sent[f]]).mean(0)
        if average or averages_at((started[f] - offsets[f]) // period + 1, 1):
            theta[f].sub_(mean)
        else:
            outer_step_(outer, theta[f], mean)
        if alpha == 1.0:  # the end: the local weights stay, their steps since the start are folded in next
            del due[f]
            return
        with torch.no_grad():
            for net in nets.values():
                flat = torch.cat([p.detach().flatten() for p in local(net, f)])
                mix_(flat, theta[f], alpha)
                torch.nn.utils.vector_to_parameters(flat, local(net, f))
        del due[f]

    for t, batches in enumerate(steps, start=1):
        for rank in [r for r in nets if r not in batches]:  # died
            del nets[rank]
        for rank in [r for r in batches if r not in nets]:  # a replacement: its replica from θ_global
            nets[rank] = script.make_net()
            for f in range(fragments):
                torch.nn.utils.vector_to_parameters(theta[f].clone(), local(nets[rank], f))
            opts[rank] = torch.optim.SGD(nets[rank].parameters(), lr=script.LR)
        for rank, index in batches.items():
            opts[rank].zero_grad()
            torch.nn.functional.mse_loss(nets[rank](data.x[index]), data.y[index]).backward()
            opts[rank].step()
        for f in [f for f in due if due[f] <= t]:
            finish(f, mix_alpha)
        for f, offset in enumerate(offsets):
            if starts_at(t, offset, period):
                start(f, t)
                if overlap_steps == 0:
                    finish(f, mix_alpha)
    end = len(steps)
    for rank in lost_at_end:
        del nets[rank]
    for f in list(due):
        finish(f, 1.0, average=True)
    for f, offset in enumerate(offsets):
        if last_start(end, offset, period) < end:
            start(f, end)
            finish(f, 0.0, average=True)
    out = [None] * len(group)
    cursor = [0] * fragments
    for i, (p, g) in enumerate(zip(nets[0].parameters(), group, strict=True)):
        out[i] = theta[g][cursor[g] : cursor[g] + p.numel()].double().tolist()
        cursor[g] += p.numel()
    return out


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    return all(torch.allclose(torch.tensor(x), torch.tensor(y), rtol=tol, atol=tol) for x, y in zip(a, b, strict=True))


def launch_outputs(out):
    """What a heal launch's ranks wrote under ``out``: phase -> launch rank -> final record, and
    phase -> step -> [(launch rank, step record)]."""
    finals = defaultdict(dict)
    for path in out.glob("*.*.json"):
        phase, rank, _ = path.name.split(".")
        finals[phase][int(rank)] = json.loads(path.read_text())
    records = defaultdict(lambda: defaultdict(list))
    for path in out.glob("steps.*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            records[entry["phase"]][entry["step"]].append((int(path.suffixes[0][1:]), entry))
    return finals, records


#: ``--hang-timeout`` of the launches that freeze no rank: many ranks starting on 2 cores stall for
#: several seconds (docs/faults.md, "Hung ranks"), and none of them is to be taken for a hung one
STARTUP_HANG_TIMEOUT = 120


def _heal_launch(
    tmp_path_factory, name: str, ranks: int, timeout: float, *script_args, spares: int = 0, hang_timeout: float = 0
) -> tuple[str, str, Path]:
    """``lightning-mpi --heal -n RANKS [--spares SPARES] heal_train.py OUT SCRIPT_ARGS`` under ULFM
    (skipped without it), which must exit 0: (its stdout, its stderr, OUT). ``hang_timeout``: the
    launcher's ``--hang-timeout`` (0: :data:`STARTUP_HANG_TIMEOUT`)."""
    require_ulfm()
    out = tmp_path_factory.mktemp(name)
    extra = ["--spares", spares] if spares else []
    extra += ["--hang-timeout", hang_timeout or STARTUP_HANG_TIMEOUT]
    args = [sys.executable, "-m", "lightning_mpi", "-n", ranks, "--heal", *extra, "--grace", 3, SCRIPT, out, *script_args]
    code, printed, err = finish(launch(args, REPO), timeout)
    assert code == 0, err[-6000:]
    return printed, err, out


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    # mostly start-up: 10 ranks importing Lightning on a loaded machine
    _, err, out = _heal_launch(tmp_path_factory, "heal", LAUNCHED, 420)
    return (err, *launch_outputs(out), out)


@pytest.fixture(scope="module")
def healed_everywhere(tmp_path_factory):
    """The same script on 12 ranks: its Trainer phase loses three (outside the Open MPI CI run,
    whose time is at its limit: two more ranks cost ~80 s of start-up on a 2-core machine; run it
    with ``LIGHTNING_MPI_TEST_MPI=openmpi python -m pytest -m mpi -k everywhere``)."""
    _, err, out = _heal_launch(tmp_path_factory, "heal_everywhere", EVERYWHERE_LAUNCHED, 540)
    return (err, *launch_outputs(out), out)


def _trainer_survivors_match_a_replay(finals: dict, steps: dict, survivors: list[int], heals: int) -> list[dict]:
    """The Trainer phase's survivors (launch ranks ``survivors``) after ``heals`` heals: bitwise
    identical, equal to a replay of the 12 steps' batches, ranked anew from 0, at step 12 on the
    world left, their ``mpi/heal/*`` stats those of the last heal. Returns their final records."""
    ours = [finals[r] for r in survivors]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # bitwise identical survivors
    replay = _replay(ours[0]["initial"], [[e["indices"] for _, e in sorted(steps[s])] for s in range(12)])
    assert _close(ours[0]["final"], replay)
    assert [result["rank"] for result in ours] == list(range(len(survivors)))
    for result in ours:
        assert result["global_step"] == 12 and result["world_size"] == len(survivors)
        assert result["stats"] == {
            "mpi/heal/events": float(heals),
            "mpi/heal/seconds": pytest.approx(result["history"][-1]["seconds"]),
            "mpi/heal/world_size": float(len(survivors)),
        }
    return ours


def _checkpoints_whole(directory: Path, names: list[str], redone: str, step: int, final: list) -> None:
    """Every epoch's checkpoint is there and nothing else (no temporary file left); the one whose
    writer died in it loads with its step; the last one holds the final weights."""
    assert sorted(p.name for p in directory.iterdir()) == names
    for name, at in ((redone, step), (names[-1], int(names[-1].split("step=")[1].split(".")[0]))):
        checkpoint = torch.load(directory / name, weights_only=False)
        assert checkpoint["global_step"] == at and any("EarlyStopping" in key for key in checkpoint["callbacks"])
    assert [p.detach().double().flatten().tolist() for p in checkpoint["state_dict"].values()] == final


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(480)
def test_trainer_survivors_heal_when_rank_0_dies_writing_a_checkpoint_and_match_a_replay(healed):
    """The trainer phase (W = 5 -> 4): rank 0 dies in the middle of writing the checkpoint of step 6
    (in the validation at the end of epoch 1). The survivors heal in the save and the new rank 0
    (launch rank 1) writes it; no half-written file is left; training finishes, every step once,
    the survivors bitwise identical and equal to a replay; the next validation is sharded over the
    four; one heal line, printed by the new rank 0 (the old one is dead)."""
    err, finals, records, out = healed
    assert sorted(finals["trainer"]) == [1, 2, 3, 4]  # launch rank 0 died
    steps = records["trainer"]
    assert sorted(steps) == list(range(12))  # no step lost, none repeated
    for step, entries in steps.items():
        assert sorted(rank for rank, _ in entries) == ([0, 1, 2, 3, 4] if step < 6 else [1, 2, 3, 4]), step
        assert {e["world"] for _, e in entries} == {len(entries)}, step
    for epoch, epoch_steps in enumerate(((0, 1, 2), (3, 4, 5), (6, 7, 8, 9))):  # 5, 5, then 4 ranks
        indices = sorted(i for s in epoch_steps for _, e in steps[s] for i in e["indices"])
        assert indices == list(range(60)) and all(e["epoch"] == epoch for s in epoch_steps for _, e in steps[s])
    ours = _trainer_survivors_match_a_replay(finals["trainer"], steps, [1, 2, 3, 4], heals=1)
    for result in ours:
        (event,) = result["history"]
        assert event["lost"] == [0] and event["old_world_size"] == 5 and event["world_size"] == 4
        assert event["where"] == "the checkpoint save" and event["seconds"] < 60  # heal_latency.py times
    # validation at the end of epochs 0 and 1 (5 ranks: the loss came after its batches) and 2 (4 ranks:
    # sharded anew after the heal, which happened while validating)
    validation = records["validation"]
    assert sorted(validation) == [3, 6, 10]
    for step, world in ((3, 5), (6, 5), (10, 4)):
        assert {e["world"] for _, e in validation[step]} == {world}, step
        assert len({rank for rank, _ in validation[step]}) == world, step
        assert sorted(i for _, e in validation[step] for i in e["indices"]) == list(range(20)), step
    names = ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=10.ckpt", "epoch=3-step=12.ckpt"]
    _checkpoints_whole(out / "checkpoints", names, "epoch=1-step=6.ckpt", 6, ours[0]["final"])
    line = [
        x for x in err.splitlines() if "lightning_mpi: healed: rank 0 of 5 lost (detected in the checkpoint save" in x
    ]
    assert len(line) == 1 and "training goes on at world size 4" in line[0], err[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_trainer_survivors_heal_everywhere_mid_epoch_in_validation_and_in_a_save(healed_everywhere):
    """The trainer phase (W = 7 -> 4): rank 0 dies mid-epoch at step 4, launch rank 6 at the end of
    its validation batch at step 6, launch rank 1 (rank 0 by then) in the middle of writing the
    checkpoint of step 9. Training finishes, every step once, the survivors bitwise identical and
    equal to a replay; the interrupted checkpoint is written by the new rank 0, no half-written
    file is left, the last one loads with the final weights; validation after the heal in
    validation is sharded over the survivors; one heal line each, printed by the rank 0 of then."""
    err, finals, records, out = healed_everywhere
    assert sorted(finals["trainer"]) == [2, 3, 4, 5]  # launch ranks 0, 6 and 1 died
    steps = records["trainer"]
    assert sorted(steps) == list(range(12))  # no step lost, none repeated
    alive = {s: [0, 1, 2, 3, 4, 5, 6] for s in range(4)} | {4: [1, 2, 3, 4, 5, 6], 5: [1, 2, 3, 4, 5, 6]}
    alive |= {s: [1, 2, 3, 4, 5] for s in (6, 7, 8)} | {s: [2, 3, 4, 5] for s in (9, 10, 11)}
    assert len(alive[0]) == EVERYWHERE_LAUNCHED - len(FIRST_PHASES)
    for step, entries in steps.items():
        assert sorted(rank for rank, _ in entries) == alive[step], step
        assert {e["world"] for _, e in entries} == {len(entries)}, step
    # epoch 0 over seven ranks (60 samples padded to 63); epoch 1 keeps those shards after the heal
    # at step 4 (the lost rank's last two batches are not seen); epoch 2 is sharded over the five
    # left (the heal in validation), epoch 3 over the four left (the heal in the save)
    assert {i for s in (0, 1, 2) for _, e in steps[s] for i in e["indices"]} == set(range(60))
    epoch2 = sorted(i for s in (6, 7, 8) for _, e in steps[s] for i in e["indices"])
    assert epoch2 == list(range(60)) and all(e["epoch"] == 2 for s in (6, 7, 8) for _, e in steps[s])
    assert all(e["epoch"] == 3 for s in (9, 10, 11) for _, e in steps[s])
    ours = _trainer_survivors_match_a_replay(finals["trainer"], steps, [2, 3, 4, 5], heals=3)
    for result in ours:
        lost = [(e["lost"], e["old_world_size"], e["world_size"]) for e in result["history"]]
        assert lost == [([0], 7, 6), ([5], 6, 5), ([0], 5, 4)]
        assert result["history"][2]["where"] == "the checkpoint save"
        assert all(event["seconds"] < 60 for event in result["history"])  # benchmarks/heal_latency.py times
    # validation at the end of epochs 0 (7 ranks), 1 (6: sharded anew after the heal at step 4; launch
    # rank 6 validated its batch, then died) and 2 (5: sharded anew after the heal in validation)
    validation = records["validation"]
    assert sorted(validation) == [3, 6, 9]
    for step, world in ((3, 7), (6, 6), (9, 5)):
        assert {e["world"] for _, e in validation[step]} == {world} and len(validation[step]) == world, step
        assert {i for _, e in validation[step] for i in e["indices"]} == set(range(20)), step
    # every epoch's checkpoint, the one whose writer died in it written by the next rank 0, whole
    names = ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=9.ckpt", "epoch=3-step=12.ckpt"]
    _checkpoints_whole(out / "checkpoints", names, "epoch=2-step=9.ckpt", 9, ours[0]["final"])
    for lost in ("rank 0 of 7 lost", "rank 5 of 6 lost", "rank 0 of 5 lost (detected in the checkpoint save"):
        line = [x for x in err.splitlines() if f"lightning_mpi: healed: {lost}" in x]
        assert len(line) == 1, (lost, err[-3000:])
    assert "training goes on at world size 4" in line[0]


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(480)
def test_fabric_model_averaging_built_after_a_heal_heals_again_then_min_ranks_stops(healed):
    err, finals, records, out = healed
    steps = records["fabric"]
    assert sorted(steps) == list(range(6))
    for step, entries in steps.items():
        assert len(entries) == (4 if step < 3 else 3), step
        assert all(e["world"] == len(entries) and e["ones"] == len(entries) for _, e in entries), step
    assert sorted(finals["fabric"]) == [0, 1, 2]  # rank 3 died
    ours = [finals["fabric"][r] for r in (0, 1, 2)]
    assert all(result["final"] == ours[0]["final"] for result in ours)
    replay = _replay_model_averaging(
        ours[0]["initial"], [{rank: e["indices"] for rank, e in steps[s]} for s in range(6)], period=2
    )
    assert _close(ours[0]["final"], replay)
    for result in ours:
        assert result["world_size"] == 3
        (event,) = result["history"]
        assert event["lost"] == [3] and event["world_size"] == 3
    # (the replace phase lost its rank 3 of 4 too)
    assert sum("lightning_mpi: healed: rank 3 of 4 lost" in x for x in err.splitlines()) == 2
    # then EASGD on the three left loses one in the step of an elastic exchange
    steps = records["easgd"]
    assert sorted(steps) == list(range(6))
    for step, entries in steps.items():
        assert len(entries) == (3 if step < 3 else 2) and all(e["world"] == len(entries) for _, e in entries), step
    ours = [finals["easgd"][r] for r in (0, 1)]
    assert ours[0]["final"] == ours[1]["final"]  # the center, the same on every survivor
    replay = _replay_easgd(ours[0]["initial"], [{rank: e["indices"] for rank, e in steps[s]} for s in range(6)], 2)
    assert _close(ours[0]["final"], replay)
    assert [e["lost"] for e in ours[0]["history"]] == [[2]]
    # then min_ranks=2 on the two left: the survivor of one more loss raises RankFailedError
    (survivor,) = finals["min_ranks"].values()
    assert survivor["caught"] == "RunStopped" and survivor["step"] == 1  # a RankFailedError that ends this side only
    assert "1 of the 2 ranks the run started with remain here, fewer than min_ranks=2" in survivor["message"]


# -- heal="replace" -----------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_a_new_zero_rank_is_handed_no_shard_and_joins_the_rebuild():
    """rank 0 hands a new ZeRO rank no optimizer shard of its own (it keeps its own for the
    rebuild); the rebuild over survivors and new ranks leaves the new ones out of the shard set."""
    from lightning_mpi.rules.zero import BoundZeroRule

    kept = {"skipped_steps": 2, "zero_heal": {"steps": 5, "whole": True, "own": {"rank": 0}, "mirror": None}}
    mine, handed = object.__new__(BoundZeroRule).hand_over(kept, 1)  # a method of the binding: no transport
    assert mine == kept
    assert handed == {"skipped_steps": 2, "zero_heal": {"joined": True}}


@pytest.mark.timeout(10)
def test_a_new_rank_takes_no_shard_of_the_center_and_a_share_of_gosgds_weight():
    from lightning_mpi.rules.gossip import BoundGoSGD
    from lightning_mpi.rules.server.rules import BoundDownpour
    from lightning_mpi.rules.sync import BoundSync

    def split(bound_class, state, n):  # rank 0's hand_over (a method of the binding: no transport)
        return object.__new__(bound_class).hand_over(state, n)

    kept = {"old_rank": 0, "old_world": 2, "numel": 5, "shard": torch.ones(3), "clock": 7, "ref": torch.ones(6),
            "clock_at_pull": 6, "interrupted": False, "final_committed": False, "steps": 4, "commits": 1,
            "momentum": [torch.ones(2)], "skipped_commits": 1}
    mine, handed = split(BoundDownpour, {"healed": kept}, 1)
    assert mine == {"healed": kept}
    new = handed["healed"]
    assert new["joined"] and "shard" not in new and "ref" not in new and new["clock"] is None
    assert new["steps"] == 4 and new["commits"] == 0 and new["skipped_commits"] == 0
    assert torch.equal(new["momentum"][0], torch.zeros(2)) and new["old_world"] == 2
    gossip = {"healed": {"weight": 0.6, "pushes": 3, "rng": (3, (1, 2), None), "drained": False}}
    mine, handed = split(BoundGoSGD, gossip, 2)
    assert mine["healed"]["weight"] == pytest.approx(0.2) and mine["healed"]["rng"] == (3, (1, 2), None)
    assert handed == {"healed": {"weight": pytest.approx(0.2), "pushes": 0, "drained": False}}
    residuals = {"skipped_steps": 0, "local": {"residual": torch.ones(2)}}
    mine, handed = split(BoundSync, residuals, 1)
    assert mine is residuals and handed == {"skipped_steps": 0}  # rank 0's residuals stay its own


@pytest.mark.timeout(10)
def test_replacements_take_the_shards_lost_this_epoch_first():
    from lightning_mpi.strategies.replacement import replacement_shards

    assert replacement_shards([(4, 0), (4, 2), (4, 3)], 1) == [(4, 1)]  # the lost rank's shard
    assert replacement_shards([(4, 0), (4, 3)], 2) == [(4, 1), (4, 2)]
    # the epoch was sharded over the survivors already (a heal at an epoch's end): repeat theirs
    assert replacement_shards([(2, 0), (2, 1)], 2) == [(2, 0), (2, 1)]
    assert replacement_shards([None, None], 1) == [None]  # not sharded


@pytest.mark.timeout(30)
def test_a_diloco_replacement_takes_the_outer_state_and_starts_its_replica_from_theta_global():
    """On one rank (no MPI peers): what a new rank loads from the handover (the survivors'
    ``heal_state()`` without their own part): the outer state, its weights set to θ_global, no
    exchange in flight; a handover with an exchange in flight is refused (the survivors never
    send one: :meth:`RunReplacing._let_in` waits for a batch without)."""
    from mpi4py import MPI
    from torch import nn

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.diloco import StreamingDiLoCoRule

    rule = StreamingDiLoCoRule(period=4, fragments=2, overlap_steps=1, mix_alpha=0.5, wire="fp32")
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    bound = rule.bind(Transport(MPI.COMM_SELF), list(net.parameters()))
    bound.healing = True
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bound.on_train_start()
    in_flight = []
    for _ in range(5):  # fragment 0 exchanges after steps 2 (in flight over step 3), fragment 1 after 4
        opt.zero_grad()
        net(torch.randn(6, 3)).pow(2).mean().backward()
        assert bound.before_step(opt)
        opt.step()
        bound.after_step(opt)
        in_flight.append(bound.exchange_in_flight)
    assert in_flight == [False, True, False, True, False]
    handover = {key: value for key, value in bound.heal_state().items() if key != "local"}
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    joined = rule.bind(Transport(MPI.COMM_SELF), list(fresh.parameters()))
    joined.load_state_dict(handover)
    joined.on_train_start()  # the loaded outer state stays (not adopted from the local weights)
    assert joined.steps == 5 and joined.outer_steps == bound.outer_steps and not joined.exchange_in_flight
    for mine, theirs in zip(joined.fragments, bound.fragments, strict=True):
        assert torch.equal(mine.theta_global, theirs.theta_global)
        assert torch.equal(mine.local.pull(), theirs.theta_global)  # its replica: θ_global
    opt.zero_grad()
    net(torch.randn(6, 3)).pow(2).mean().backward()
    bound.before_step(opt)
    opt.step()
    bound.after_step(opt)  # step 6: fragment 0 starts again: in flight
    in_flight_handover = {key: value for key, value in bound.heal_state().items() if key != "local"}
    with pytest.raises(ValueError, match="cannot join while a DiLoCo exchange is in flight"):
        rule.bind(Transport(MPI.COMM_SELF), list(fresh.parameters())).load_state_dict(in_flight_handover)
    for b in (bound, joined):
        b.on_train_end()
        b.close()


@pytest.mark.timeout(10)
def test_ready_replacements_wait_for_a_batch_without_an_exchange_in_flight():
    from types import SimpleNamespace

    from lightning_mpi.strategies.replacement import RunReplacing, _Pending

    bound = SimpleNamespace(exchange_in_flight=True)
    runner = SimpleNamespace(bound=bound, live=True)
    healing = SimpleNamespace(mode="replace", events=1, grow_pending=False, boundaries=0, grow_at=0)
    replacing = RunReplacing(healing, None, None, runner, None, print, "key", None)
    switched = []
    replacing._switch = lambda trainer, pending: switched.append(pending)
    pending = _Pending(respawned=None, started=0.0, deadline=0.0, events=1, ready=True)
    replacing._pending = pending
    replacing.at_batch_start(None)  # ready, but an exchange is in flight: not yet, and no collective
    assert switched == [] and replacing._pending is pending and pending.batches == 1
    bound.exchange_in_flight = False
    replacing.at_batch_start(None)
    assert switched == [pending] and replacing._pending is None
    replacing._pending = pending
    healing.events = 2  # a survivor lost meanwhile: the spawn is given up (not let in)
    given_up = []
    replacing._give_up = lambda revoke: given_up.append(revoke) or setattr(replacing, "_pending", None)
    replacing.at_batch_start(None)
    assert given_up == [True] and switched == [pending]


@pytest.mark.timeout(10)
def test_the_spawn_waits_for_the_batch_after_the_furthest_survivors():
    """A survivor that was a batch behind at the heal (it took the interrupted operation's result)
    must not start the spawn, a collective, at the batch the others had begun already: the heal
    sets ``grow_at`` one past the furthest survivor's count of batches, and the spawn starts there."""
    from types import SimpleNamespace

    from lightning_mpi.strategies.replacement import RunReplacing

    healing = SimpleNamespace(mode="replace", events=1, grow_pending=True, boundaries=5, grow_at=7)
    runner = SimpleNamespace(bound=None, live=False)
    replacing = RunReplacing(healing, None, None, runner, None, print, "key", None)
    started = []
    replacing._start = lambda: started.append(healing.boundaries)
    replacing.at_batch_start(None)  # batch 6: the others had begun it before the heal
    assert started == []
    replacing.at_batch_start(None)  # batch 7: every survivor is here
    assert started == [7]


@pytest.mark.timeout(10)
def test_a_replacement_skips_the_batches_done_once_then_resumes_from_the_handover():
    from torch.utils.data import DistributedSampler

    from lightning_mpi.strategies.replacement import HANDOVER_PATH
    from lightning_mpi.strategies.resume import AutoResume
    from lightning_mpi.strategies.sharding import SkipFirst

    inner = DistributedSampler(range(60), num_replicas=4, rank=3, shuffle=True, seed=0)
    inner.set_epoch(1)
    skip = SkipFirst(DistributedSampler(range(60), num_replicas=4, rank=3, shuffle=True, seed=0), 8)
    skip.set_epoch(1)
    assert len(skip) == len(inner) == 15
    assert list(skip) == list(inner)[8:]  # the first pass leaves out the 2 batches of 4 done
    assert list(skip) == list(inner)  # later passes are whole

    class Trainer:  # what AutoResume reads
        class state:
            fn = "fit"

    def fit(model, ckpt_path=None):
        return ckpt_path

    class Inner:
        def launch(self, function, *args, trainer=None, **kwargs):
            return function(*args, **kwargs)

    chosen = []
    launcher = AutoResume(
        Inner(), "fit", lambda trainer, reason: chosen.append(reason) or HANDOVER_PATH, lambda: "replacement"
    )
    # a replacement resumes from the handover, even when the script gives a ckpt_path
    assert launcher.launch(fit, None, ckpt_path="last", trainer=Trainer()) == HANDOVER_PATH
    assert chosen == ["replacement"]
    assert AutoResume(Inner(), "fit", lambda t, r: "x").launch(fit, None, trainer=Trainer()) is None  # no reason


@pytest.mark.timeout(60)
@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_a_replacement_takes_what_the_survivors_model_checkpoints_saved_last(tmp_path, package):
    """A ``ModelCheckpoint(save_last=True)`` saves at the end of training when its process saved
    nothing yet, and that save is a collective: a replacement let in after the last periodic save
    must know that the survivors saved, or it reduces alone while they end (a job that never ended,
    measured). The handover carries each callback's last save, and the new rank takes it."""
    import importlib

    from lightning_mpi.strategies.trainer.checkpoints import adopt_saves, handover_checkpoint

    pl = importlib.import_module(package)
    callbacks = importlib.import_module(f"{package}.callbacks")

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(root):
        saves = callbacks.ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2)
        return pl.Trainer(
            default_root_dir=root, max_steps=3, callbacks=[saves], logger=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu",
        ), saves

    survivor, saved = trainer(tmp_path / "survivor")
    survivor.fit(Model(), torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2))
    assert saved._last_checkpoint_saved  # the survivors saved (and would not save again at the end)
    handed = handover_checkpoint(survivor)
    assert "state_dict" in handed  # Lightning's own checkpoint dictionary, with the saves beside it

    joined, fresh = trainer(tmp_path / "replacement")
    assert not fresh._last_checkpoint_saved and fresh._last_global_step_saved == 0
    adopt_saves(joined, handed)
    assert fresh._last_checkpoint_saved == saved._last_checkpoint_saved
    assert fresh._last_global_step_saved == saved._last_global_step_saved == 2


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(480)
def test_trainer_replace_spawns_a_rank_that_joins_mid_epoch_and_matches_a_replay(healed):
    """The replace phase (W = 4): launch rank 3 dies at step 1; the three survivors finish step 1,
    spawn a replacement at step 2 and let it in at step 3 (launch rank REPLACEMENT in the records),
    with rank 3's shard, skipping the three batches of it the epoch went through; all four end identical, equal to one
    process replaying the batches of the ranks alive at each step."""
    err, finals, records, out = healed
    assert sorted(finals["replace"]) == [0, 1, 2, REPLACEMENT]  # three survivors and the replacement
    steps = records["replace"]
    assert sorted(steps) == list(range(8))  # no step lost, none repeated
    alive = {0: [0, 1, 2, 3], 1: [0, 1, 2], 2: [0, 1, 2]} | {s: [0, 1, 2, REPLACEMENT] for s in range(3, 8)}
    for step, entries in steps.items():
        assert sorted(rank for rank, _ in entries) == alive[step], step
        assert all(e["world"] == len(entries) for _, e in entries), step
    # epoch 0: the replacement takes batch 3 of rank 3's shard (3 samples; its batches 1 and 2, 8
    # samples, are not seen); epoch 1: every sample, the four sharded anew
    (joined,) = [e for rank, e in steps[3] if rank == REPLACEMENT]
    assert joined["epoch"] == 0 and joined["batch"] == 3 and joined["rank"] == 3
    epoch0 = [i for s in range(4) for _, e in steps[s] for i in e["indices"]]
    assert len(epoch0) == len(set(epoch0)) == 60 - 8
    epoch1 = sorted(i for s in range(4, 8) for _, e in steps[s] for i in e["indices"])
    assert epoch1 == list(range(60)) and all(e["epoch"] == 1 for s in range(4, 8) for _, e in steps[s])
    ours = [finals["replace"][r] for r in (0, 1, 2, REPLACEMENT)]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # bitwise identical, replacement too
    replay = _replay(ours[0]["initial"], [[e["indices"] for _, e in sorted(steps[s])] for s in range(8)])
    assert _close(ours[0]["final"], replay)
    for result in ours:
        assert result["global_step"] == 8 and result["world_size"] == 4 and result["stats"]["mpi/heal/world_size"] == 4
    survivor = ours[0]
    assert survivor["stats"]["mpi/heal/events"] == 1 and survivor["stats"]["mpi/heal/replaced"] == 1
    healed_event, joined_event = survivor["history"]
    assert healed_event["lost"] == [3] and healed_event["world_size"] == 3
    assert joined_event["joined"] == [3] and joined_event["world_size"] == 4
    # validation (its loader built by the replacement at the first one) at the end of both epochs, on four
    validation = records["replace_val"]
    assert sorted(validation) == [4, 8]
    for step in (4, 8):
        assert {e["world"] for _, e in validation[step]} == {4}
        assert sorted(i for _, e in validation[step] for i in e["indices"]) == list(range(20))
    lines = [x for x in err.splitlines() if "lightning_mpi: replaced: 1 new rank (3) joined at step 3" in x]
    assert len(lines) == 1 and "training goes on at world size 4" in lines[0], err[-3000:]


@pytest.fixture(scope="module")
def rules_replaced(tmp_path_factory):
    """``lightning-mpi --heal -n 3 --spares 2 heal_train.py OUT replace_rules``: six phases with
    ``heal="replace"`` (the Trainer with DOWNPOUR, PowerSGD, EASGD, GoSGD, ZeRO with Adam; a Fabric
    loop with Adam), each losing its last rank (from the second on: the replacement of the one
    before) at step 1 and letting a replacement in: in the first phase a spare (launch rank 3),
    which waited from the start, in the others a process spawned after the loss (a spare waits in
    the first strategy's construction: the second spare is never used, and dismissed at the end);
    then ``drain_heal`` (DOWNPOUR, ``heal="shrink"``, W 3 -> 2), survivors healing in two places."""
    # the launcher's default --hang-timeout: a phase freezes a rank (5 processes start: no stall that long)
    _, err, out = _heal_launch(tmp_path_factory, "replace_rules", 3, 360, "replace_rules", spares=2, hang_timeout=8)
    return (err, *launch_outputs(out))


def _replaced_phase_checks(finals, records, phase, lost_launch_rank, new_launch_rank):
    """The survivors ran every step once, the lost rank stopped at step 1, the replacement ran every
    step from the one it joined at (in epoch 0, with the lost rank's shard); one heal and one join;
    all three end on the same weights (the center, the consensus)."""
    assert sorted(finals[phase]) == [0, 1, new_launch_rank], sorted(finals[phase])
    ran = defaultdict(list)
    for step, entries in records[phase].items():
        for rank, _ in entries:
            ran[rank].append(step)
    assert sorted(ran[0]) == sorted(ran[1]) == list(range(8)), phase
    assert sorted(ran[lost_launch_rank]) == [0], phase
    first = min(ran[new_launch_rank])
    assert 2 <= first < 5 and sorted(ran[new_launch_rank]) == list(range(first, 8)), (phase, first)
    (joined,) = [e for rank, e in records[phase][first] if rank == new_launch_rank]
    assert joined["epoch"] == 0 and joined["batch"] == first and joined["rank"] == 2  # rank 2's shard
    ours = [finals[phase][r] for r in (0, 1, new_launch_rank)]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # bitwise identical, the new rank too
    for result in ours:
        assert result["global_step"] == 8 and result["world_size"] == 3
    # every rank counted the same operations since the let-in, the new one too: a later heal
    # compares these counts (a replacement's count from its start made the next heal fail)
    assert len({result["operations"] for result in ours}) == 1, [result["operations"] for result in ours]
    healed_event, joined_event = ours[0]["history"]
    assert healed_event["lost"] == [2] and healed_event["world_size"] == 2
    assert joined_event["joined"] == [2] and joined_event["world_size"] == 3
    return ours


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(360)
def test_parameter_server_and_gossip_rules_replace_a_lost_rank(rules_replaced):
    """``heal="replace"`` with DOWNPOUR (its last rank hangs: declared failed after the hang timeout;
    the center: the survivors' shards, rebuilt over themselves at the heal, are re-cut over the
    grown run at the join with nothing lost; the new rank starts from the center and commits) and GoSGD (rank 0 shares its mixing weight with the new rank, which
    holds its θ): both finish, every rank on the same weights (the center, the consensus)."""
    err, finals, records = rules_replaced
    ours = _replaced_phase_checks(finals, records, "replace_downpour", 2, 3)
    for result in ours:
        assert result["last_rebuild_lost"] == []  # the join's rebuild: every shard from a survivor
        assert result["commits"] > 0
    # its last rank hung (SIGSTOP) rather than died: killed by the process beside it, which saw it stop
    # while the others ran on (comm.watchdog)
    assert all(result["frozen_alive"] is False for result in ours[:2])
    frozen = [line for line in err.splitlines() if "lightning_mpi: rank 2 (" in line and "has been stopped for" in line]
    assert len(frozen) >= 1 and "while the rest of the run went on" in frozen[0], err[-3000:]
    _replaced_phase_checks(finals, records, "replace_gosgd", 18, 14)


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(420)
def test_powersgd_and_easgd_replace_a_lost_rank(rules_replaced):
    """``heal="replace"`` with PowerSGD (the warm Q's replicated, the new rank's residuals zero) and
    EASGD (the center replicated; its last rank, spawned in the phase before, hangs: Open MPI's
    detector does not watch a spawned process, the watchdog beside it kills it): both finish with
    every rank, the new one too, on the same weights."""
    err, finals, records = rules_replaced
    _replaced_phase_checks(finals, records, "replace_powersgd", 3, 17)
    ours = _replaced_phase_checks(finals, records, "replace_easgd", 17, 18)
    assert all(result["frozen_alive"] is False for result in ours[:2])
    frozen = [line for line in err.splitlines() if "lightning_mpi: rank 2 (" in line and "has been stopped for" in line]
    assert len(frozen) == 2, err[-3000:]  # this phase's and DOWNPOUR's


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(360)
def test_a_spare_launched_with_the_job_takes_a_lost_ranks_place_at_the_next_batch(rules_replaced):
    """``--spares 2``: launch ranks 3 and 4 waited, idle, inside the first phase's strategy
    construction; when the last training rank died at step 1 of that phase, the survivors let the
    first spare in at the very next batch (no process to start), the other waiting on. The later
    phases built strategies of their own, so their losses were replaced by spawned processes (a
    spare let in there would run the first phase's code), and the unused spare was dismissed at
    the end: the job exits 0."""
    err, finals, records = rules_replaced
    first = min(step for step, entries in records["replace_downpour"].items() if any(r == 3 for r, _ in entries))
    # the batch after the heal's (one more if the survivors were a batch apart at the heal: grow_at)
    assert first in (2, 3), first
    healed_event, joined_event = finals["replace_downpour"][0]["history"]
    assert joined_event["spares"] is True and joined_event["seconds"] < 10, joined_event  # spawned: 4-15 s
    for phase in ("replace_powersgd", "replace_easgd", "replace_gosgd", "replace_zero", "replace_fabric"):
        assert finals[phase][0]["history"][1]["spares"] is False, phase  # spawned
    assert 4 not in finals["replace_downpour"]  # the second spare never trained
    lines = [x for x in err.splitlines() if "spares launched with the job" in x]
    assert len(lines) == 1 and f"joined at step {first}" in lines[0], err[-3000:]


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(300)
def test_fewer_spares_than_ranks_lost_let_one_in_and_spawn_the_rest(tmp_path):
    """``lightning-mpi --heal -n 3 --spares 1 partial_let_in.py``: ranks 1 and 2 die together; rank 0
    heals alone, lets the one spare in, and both spawn the rank still missing at the next batch. The
    spare learns from the handover the size the run started with (3, not the 2 it joined) and that a
    rank is still missing, so it takes part in the spawn. Before, it did not: rank 0 waited in the
    spawn's first collective while the spare trained on (seen in an 8-rank partition run, where the
    run stood still until the next loss), and the spare's ``min_ranks`` was a majority of 2."""
    require_ulfm()
    script = REPO / "tests" / "scripts" / "partial_let_in.py"
    args = [sys.executable, "-m", "lightning_mpi", "-n", 3, "--heal", "--spares", 1]
    args += ["--hang-timeout", STARTUP_HANG_TIMEOUT, "--grace", 3, script, tmp_path]
    code, _, err = finish(launch(args, REPO), 280)
    assert code == 0, err[-6000:]
    ends = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert sorted(ends) == ["rank0", "spare", "spawned"], (sorted(ends), err[-3000:])
    for who, end in ends.items():
        assert end["world_size"] == 3 and end["start_size"] == 3 and end["min_ranks"] == 1, (who, end)
        assert end["weights"] == ends["rank0"]["weights"], who  # one run, bitwise
        assert end["step"] == ends["rank0"]["step"] >= 6, who
    history = ends["rank0"]["history"]
    heals = [event for event in history if "lost" in event]
    joins = [event for event in history if "joined" in event]
    assert sorted(rank for event in heals for rank in event["lost"]) == [1, 2] and heals[-1]["world_size"] == 1
    assert [(event["spares"], event["world_size"]) for event in joins] == [(True, 2), (False, 3)], joins
    # the spare took part in the second let-in (each rank times it itself)
    assert {**ends["spare"]["history"][-1], "seconds": 0} == {**joins[-1], "seconds": 0}


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(200)
def test_a_rank_lost_while_lightning_sets_the_training_loader_up(tmp_path):
    """``lightning-mpi --heal -n 3 heal_in_loader_setup.py``: rank 2 dies while epoch 1's training
    loader is sharded; the survivors heal in the reduce of its length, with the loader (sharded
    over 3) already handed to Lightning. They train epoch 1 on it (rank 2's share not seen) and
    epoch 2 on a loader sharded over the two. Before, the heal dropped the loader at once, and
    Lightning's fit loop, going on, found none (``AssertionError``; seen in an 8-rank partition run)."""
    require_ulfm()
    script = REPO / "tests" / "scripts" / "heal_in_loader_setup.py"
    args = [sys.executable, "-m", "lightning_mpi", "-n", 3, "--heal", "--hang-timeout", STARTUP_HANG_TIMEOUT]
    code, _, err = finish(launch(args + ["--grace", 3, script, tmp_path], REPO), 190)
    assert code == 0, err[-6000:]
    ends = {int(p.suffixes[0][1:]): json.loads(p.read_text()) for p in tmp_path.glob("end.*.json")}
    assert sorted(ends) == [0, 1], err[-3000:]
    assert ends[0]["final"] == ends[1]["final"]
    (event,) = ends[0]["history"]
    assert event["lost"] == [2] and event["world_size"] == 2
    steps = {r: [json.loads(x) for x in (tmp_path / f"steps.{r}.jsonl").read_text().splitlines()] for r in (0, 1, 2)}
    everything = [s for r in (0, 1, 2) for s in steps[r]]
    seen = {e: sorted(i for s in everything if s["epoch"] == e for i in s["indices"]) for e in range(3)}
    assert seen[0] == list(range(60))  # 3 ranks
    assert len(seen[1]) == 40 and len(set(seen[1])) == 40  # the shards of 3, rank 2's not seen
    assert seen[2] == list(range(60))  # sharded anew over the two
    assert {s["world"] for r in (0, 1) for s in steps[r] if s["epoch"] > 0} == {2}
    assert all(s["epoch"] == 0 for s in steps[2])


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(360)
def test_survivors_that_heal_one_after_its_last_batch_one_still_training_both_end(rules_replaced):
    """The replace_rules launch's last phase (DOWNPOUR, ``heal="shrink"``, W 3 -> 2): rank 1 had run
    all its steps and was draining the preemption votes when the last rank died, while rank 0, slow,
    still trained (an epoch ahead of it). Rank 1 drains the votes restarted by the heal again, and
    rank 0 trains on with the loaders it has (loading them again is collective, and rank 1 never
    would): both reach max_steps and end on the same center. Before, rank 1 skipped the drain and
    met rank 0's collectives with its own (MPI_ERR_TRUNCATE, or a wait for good)."""
    _, finals, records = rules_replaced
    steps = _script_module().DRAIN_STEPS
    assert sorted(finals["drain_heal"]) == [0, 1]
    ours = [finals["drain_heal"][r] for r in (0, 1)]
    for result in ours:
        assert result["global_step"] == steps and result["world_size"] == 2
        (event,) = result["history"]
        assert event["lost"] == [2] and event["world_size"] == 2
    assert ours[0]["final"] == ours[1]["final"]
    entries = [e for es in records["drain_heal"].values() for _, e in es]
    rank1_done = max(e["t"] for e in entries if e["rank"] == 1)
    rank0_healed = [e for e in entries if e["rank"] == 0 and e["world"] == 2]
    assert len([e for e in entries if e["rank"] == 1]) == steps
    # rank 1 had ended before rank 0 trained at W = 2, with an epoch's start (step 5) still ahead of it
    assert rank0_healed and rank1_done <= min(e["t"] for e in rank0_healed)
    assert min(e["step"] for e in rank0_healed) < 5


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(360)
def test_a_fabric_loop_lets_a_replacement_in_and_matches_a_one_process_adam(rules_replaced):
    """``heal="replace"`` under Fabric: the loop gives its state (model, Adam, step counter) to
    ``fabric.strategy.let_in`` at the top of each iteration. The last rank dies at step 1; the
    survivors heal in that step's exchange, spawn a replacement at the next ``let_in`` and let it in
    at the one after. It runs the script from the top, gets rank 0's weights in ``fabric.setup`` and
    the state (Adam's moments, the step) in ``let_in``, and goes on from that step. Every step ran
    once on the ranks alive; all three end bitwise identical, weights and Adam state, equal to one
    process running Adam over the batches of the ranks alive at each step."""
    _, finals, records = rules_replaced
    ours = _replaced_phase_checks(finals, records, "replace_fabric", 15, 16)
    new = finals["replace_fabric"][16]
    assert new["joined_at"] == min(step for step, entries in records["replace_fabric"].items()
                                   if any(rank == 16 for rank, _ in entries))
    assert all(result["optimizer"] == ours[0]["optimizer"] for result in ours)
    assert ours[0]["stats"]["mpi/heal/replaced"] == 1
    _assert_one_process_adam(ours[0], records["replace_fabric"], _script_module().ZERO_LR)


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(360)
def test_zero_replaces_a_lost_rank_and_matches_a_one_process_adam(rules_replaced):
    """``heal="replace"`` with ZeRO (``shard_optimizer=True``, Adam): the survivors rebuild the
    optimizer state over two at the heal (the lost shard from its buddy copy), and over three when
    the new rank is let in (it joins with no shard of its own). Every rank ends with the same
    weights and the same whole Adam state, equal to one process running Adam over the batches of
    the ranks alive at each step: nothing lost or made up at either rebuild."""
    _, finals, records = rules_replaced
    ours = _replaced_phase_checks(finals, records, "replace_zero", 14, 15)
    assert all(result["optimizer"] == ours[0]["optimizer"] for result in ours)
    _assert_one_process_adam(ours[0], records["replace_zero"], _script_module().ZERO_LR)


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(480)
@pytest.mark.parametrize("phase", FIRST_PHASES)
def test_rules_heal_with_their_state_and_match_a_replay(healed, phase):
    """The first phases, one rule each: the last rank dies at the step of an exchange; the survivors
    keep what the rule keeps (their own residuals, PowerSGD's warm Q, DiLoCo's outer state), redo
    the exchange (with their own gradients or the state before it put back; Streaming DiLoCo's in
    flight is started again), end identical and equal a one-process replay of the rule over the
    ranks alive at each step."""
    err, finals, records, out = healed
    size = LAUNCHED - FIRST_PHASES.index(phase)  # the ranks at the phase's start
    steps = records[phase]
    assert sorted(steps) == list(range(6))
    for step, entries in steps.items():
        assert len(entries) == (size if step < 3 else size - 1), step
        # Streaming DiLoCo's exchange started at the kill step may be found failed only in flight,
        # at the next step (the survivors then record the kill step before they heal)
        worlds = {e["world"] for _, e in entries}
        assert worlds == {len(entries)} or (phase == "streaming" and step == 3 and worlds == {size}), step
    assert sorted(finals[phase]) == list(range(size - 1))
    ours = [finals[phase][r] for r in range(size - 1)]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # bitwise identical survivors
    batches = [{rank: e["indices"] for rank, e in steps[s]} for s in range(6)]
    script = _script_module()
    if phase == "diloco":
        replay = _replay_diloco(ours[0]["initial"], batches, script.PERIOD, 1, 0, 0.0)
    elif phase == "streaming":
        replay = _replay_diloco(ours[0]["initial"], batches, **script.STREAMING)
    elif phase == "weights":  # average="weights": model averaging every step
        replay = _replay_model_averaging(ours[0]["initial"], batches, period=1)
    else:
        compress = _topk(script.TOPK_RATIO) if phase == "topk" else _powersgd
        replay = _replay_compressed(ours[0]["initial"], batches, compress)
    assert _close(ours[0]["final"], replay)
    for result in ours:
        (event,) = result["history"]
        assert event["lost"] == [size - 1] and event["world_size"] == size - 1 and event["redo"]
    assert sum(f"lightning_mpi: healed: rank {size - 1} of {size} lost" in x for x in err.splitlines()) == 1


GOSGD_LAUNCHED = 4


@pytest.fixture(scope="module")
def gosgd_healed(tmp_path_factory):
    """The asynchronous phases alone, ``downpour`` (W 4 -> 3) then ``gosgd`` (3 -> 2): their own
    launch, not in the Open MPI CI run, whose time is at its limit; run it with
    ``LIGHTNING_MPI_TEST_MPI=openmpi python -m pytest -m mpi -k "gosgd or parameter_server"``."""
    _, err, out = _heal_launch(tmp_path_factory, "heal_gosgd", GOSGD_LAUNCHED, 300, "gosgd")
    return (err, *launch_outputs(out), out)


@pytest.mark.mpi
@pytest.mark.timeout(330)
def test_gosgd_survivors_renormalise_and_reach_their_consensus(gosgd_healed):
    """GoSGD on all ranks, the last dies mid-training: the survivors finish every step, heal once
    (wherever each noticed), end identical, in the weighted consensus Σ wᵢθᵢ / Σ wᵢ of what they
    brought to the drain (their weights renormalised: Σ w = 1), and the drain waited only for the
    messages the survivors sent each other on the healed run (none from the lost rank)."""
    err, finals, records, out = gosgd_healed
    size = GOSGD_LAUNCHED - 1  # after the downpour phase
    steps = records["gosgd"]
    assert sorted(steps) == list(range(6))
    for step, entries in steps.items():
        ranks = sorted(rank for rank, _ in entries)
        assert ranks == list(range(size if step < 3 else size - 1)), step
    assert sorted(finals["gosgd"]) == list(range(size - 1))
    ours = [finals["gosgd"][r] for r in range(size - 1)]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # the consensus, on every survivor
    thetas = [torch.tensor(r["drain"]["theta"], dtype=torch.float64) for r in ours]
    ws = [r["drain"]["weight"] for r in ours]
    consensus = sum(w * t for w, t in zip(ws, thetas, strict=True)) / sum(ws)
    final = torch.tensor([x for p in ours[0]["final"] for x in p], dtype=torch.float64)
    assert torch.allclose(final, consensus[: final.numel()].to(torch.float32).double(), atol=1e-6, rtol=0)
    for result in ours:
        (event,) = result["history"]
        assert event["lost"] == [size - 1] and event["world_size"] == size - 1
    assert math.isclose(sum(ws), 1.0, abs_tol=1e-9)  # renormalised over the survivors at the heal
    expected = sum(r["drain"]["expected"] for r in ours)
    assert expected == sum(r["drain"]["sent"] for r in ours)  # sent among survivors after the heal
    assert all(r["drain"]["received"] == r["drain"]["expected"] for r in ours)
    assert sum(f"lightning_mpi: healed: rank {size - 1} of {size} lost" in x for x in err.splitlines()) == 1


@pytest.mark.mpi
@pytest.mark.timeout(330)
def test_parameter_server_survivors_rebuild_the_center_and_train_on(gosgd_healed):
    """DOWNPOUR on 4 ranks, its center sharded over their windows; the last rank dies mid-training
    (the survivors notice it wherever they do: a progress thread, the error channel, the final
    barrier). The survivors finish every step, heal once, and rebuild the same center: each
    surviving shard as its host kept it, the lost one from the pulled center of the survivor with
    the highest clock at its pull; the clock from old rank 0. They end identical, on that center
    plus exactly the commits they made on the healed run."""
    from lightning_mpi.rules.server.heal import freshest

    err, finals, records, out = gosgd_healed
    size = GOSGD_LAUNCHED
    steps = records["downpour"]
    assert sorted(steps) == list(range(6))
    for step, entries in steps.items():
        assert sorted(rank for rank, _ in entries) == list(range(size if step < 3 else size - 1)), step
    ours = [finals["downpour"][r] for r in range(size - 1)]
    assert sorted(finals["downpour"]) == list(range(size - 1))
    for result in ours:
        (event,) = result["history"]
        assert event["lost"] == [size - 1] and event["world_size"] == size - 1
    assert sum(f"lightning_mpi: healed: rank {size - 1} of {size} lost" in x for x in err.splitlines()) == 1
    # one rebuild on each survivor, the same everywhere
    rebuilds = [result["rebuilds"] for result in ours]
    assert all(len(r) == 1 for r in rebuilds)
    kept = {r[0]["kept"]["old_rank"]: r[0]["kept"] for r in rebuilds}
    assert sorted(kept) == list(range(size - 1))
    outcomes = {(tuple(r[0]["center"]), r[0]["clock"], tuple(r[0]["chosen"].items())) for r in rebuilds}
    ((center, clock, chosen),) = outcomes
    pulls = {rank: k["clock_at_pull"] for rank, k in kept.items()}
    (_, source), *_ = chosen
    assert dict(chosen) == {str(size - 1): source} and freshest(pulls, [size - 1]) == {size - 1: source}
    assert pulls[source] == max(pulls.values()) and all(pulls[r] < pulls[source] for r in pulls if r < source)
    numel = kept[0]["numel"]
    shard = len(kept[0]["shard"])
    assert len(center) == numel and shard * size == len(kept[0]["ref"])
    for rank, k in kept.items():  # a surviving shard: as its host kept it
        assert list(center[rank * shard : (rank + 1) * shard]) == k["shard"][: numel - rank * shard]
    lost = slice((size - 1) * shard, numel)  # the lost shard: the chosen survivor's pull of it
    assert list(center[lost]) == kept[source]["ref"][lost]
    assert clock == kept[0]["clock"] >= max(pulls.values())  # old rank 0 hosted the clock
    # the survivors end identical, on the rebuilt center plus every commit made since
    assert all(result["final"] == ours[0]["final"] for result in ours)
    final = torch.tensor([x for p in ours[0]["final"] for x in p], dtype=torch.float64)
    expected = torch.tensor(center, dtype=torch.float64)
    for result in ours:
        for update in result["commits"]:
            expected += torch.tensor(update, dtype=torch.float64)[:numel]
    assert torch.allclose(final, expected, atol=1e-5, rtol=0)


AUTO_LAUNCHED = 6  # W 6 -> 5 in the final average, then the decisions' phase from 5


@pytest.fixture(scope="module")
def auto_healed(tmp_path_factory):
    """``mpi_auto`` alone (the Trainer, a loss in the final average: W 6 -> 5; Fabric, ``"shrink"``: 5 -> 4
    -> 3 -> 2; then the Trainer, ``"replace"``: 2 -> 1 -> 2): its own launch, not in the Open MPI CI run, whose time is
    at its limit; run it with ``LIGHTNING_MPI_TEST_MPI=openmpi python -m pytest -m mpi -k mpi_auto``."""
    printed, err, out = _heal_launch(tmp_path_factory, "heal_auto", AUTO_LAUNCHED, 400, "auto")
    return (printed + err, *launch_outputs(out))  # mpi_auto's lines are printed (stdout), heal lines on stderr


@pytest.mark.mpi
@pytest.mark.timeout(430)
def test_mpi_auto_survivors_heal_in_a_decision_and_an_exchange_and_agree_on_their_arm(auto_healed):
    """``mpi_auto`` on 5 ranks: the last dies inside the first decision's probe (a collective): the
    four survivors heal there and redo the decision over themselves (probe, dry runs, agreement,
    the switch from Streaming DiLoCo to every-step ASA); the last of them dies as that redo
    switches: the three left heal again, put back the weights and momenta it started from and redo
    it once more; the last of those dies in ASA's exchange at step AUTO_KILL: the two left redo it
    and re-decide at the next step over themselves. Training finishes; from the switch on, every
    rank alive holds the same weights at every step, the same arm and the same count of decisions;
    the survivors end bitwise identical, with one heal line per loss and the decisions announced
    (the one after the last heal too)."""
    err, finals, records = auto_healed
    script = _script_module()
    steps = records["auto"]
    assert sorted(steps) == list(range(script.AUTO_STEPS))
    decided = script.AUTO_DECIDES - 1  # the Fabric step whose update ends with the first decision
    for step, entries in steps.items():
        world = AUTO_LAUNCHED - 1 - 2 * (step >= decided) - (step >= script.AUTO_KILL)
        assert sorted(rank for rank, _ in entries) == list(range(world)), step
        assert all(e["world"] == world for _, e in entries)
        if step >= decided:  # every-step ASA after the switch: one set of weights everywhere
            assert {e["digest"] for _, e in entries} == {entries[0][1]["digest"]}, step
            assert {(e["arm"], e["decisions"]) for _, e in entries} == {("sync", 1 + (step >= script.AUTO_KILL))}
        else:
            assert {e["arm"] for _, e in entries} == {"streaming"}
    ours = [finals["auto"][r] for r in range(2)]
    assert sorted(finals["auto"]) == [0, 1]
    assert ours[0]["final"] == ours[1]["final"] and ours[0]["final"] != ours[0]["initial"]
    assert ours[0]["stats"]["mpi/auto/arm"] == ours[1]["stats"]["mpi/auto/arm"] == 0.0  # sync
    for result in ours:
        events = [(e["where"], e["lost"], e["world_size"], e["redo"]) for e in result["history"]]
        assert events == [
            ("the mpi_auto decision", [4], 4, True),
            ("the mpi_auto decision", [3], 3, True),
            ("the exchange", [2], 2, True),
        ]
        assert result["stats"]["mpi/heal/events"] == 3.0 and result["stats"]["mpi/auto/switches"] == 1.0
    lines = err.splitlines()
    for lost, size, where in ((4, 5, "the mpi_auto decision"), (3, 4, "the mpi_auto decision"), (2, 3, "the exchange")):
        assert sum(f"lightning_mpi: healed: rank {lost} of {size} lost (detected in {where}" in x for x in lines) == 1
    assert f"mpi_auto after step {script.AUTO_DECIDES}: every-step ASA" in err
    assert f"mpi_auto after step {script.AUTO_KILL + 1}: every-step ASA" in err  # the re-decision over two


@pytest.mark.mpi
@pytest.mark.timeout(430)
def test_mpi_auto_survivors_heal_in_the_final_average_of_its_streaming_diloco_arm(auto_healed):
    """``mpi_auto`` under the Trainer on 6 ranks, before its first decision (its first arm,
    Streaming DiLoCo): the last rank dies inside ``on_train_end``'s final average, once fragment 0's
    exchange was averaged into the weights. The five survivors heal there and redo the average
    over themselves: every step done by the six, one heal line, the survivors bitwise identical
    and moved by the average (not the weights of any one replica), still on their first arm."""
    err, finals, records = auto_healed
    script = _script_module()
    steps = records["auto_end"]
    assert sorted(steps) == list(range(script.AUTO_END_STEPS))
    for step, entries in steps.items():
        assert sorted(rank for rank, _ in entries) == list(range(AUTO_LAUNCHED)), step  # nobody lost while training
    survivors = list(range(AUTO_LAUNCHED - 1))
    assert sorted(finals["auto_end"]) == survivors
    ours = [finals["auto_end"][r] for r in survivors]
    assert all(result["final"] == ours[0]["final"] for result in ours) and ours[0]["final"] != ours[0]["initial"]
    for result in ours:
        assert result["auto"] == {"arm": "streaming", "decisions": 0, "steps": script.AUTO_END_STEPS}
        (event,) = result["history"]
        assert (event["where"], event["lost"], event["world_size"], event["redo"]) == (
            "the final average", [AUTO_LAUNCHED - 1], AUTO_LAUNCHED - 1, True)
    line = f"rank {AUTO_LAUNCHED - 1} of {AUTO_LAUNCHED} lost (detected in the final average"
    assert sum(line in x for x in err.splitlines()) == 1


@pytest.mark.mpi
@pytest.mark.timeout(430)
def test_mpi_auto_replacement_takes_its_state_and_decides_with_the_survivor(auto_healed):
    """``mpi_auto`` under the Trainer with ``heal="replace"`` on two ranks (every-step ASA from step
    AUTO_DECIDES): one dies at step AUTO_REPLACE_KILL, the survivor trains on alone, spawns a
    replacement and lets it in two batches later; the replacement takes the rule's state from the
    handover, both re-decide at the next step over two (the same arm, the same count of
    decisions), finish every step and end bitwise identical."""
    err, finals, records = auto_healed
    script = _script_module()
    kill = script.AUTO_REPLACE_KILL
    steps = records["auto_replace"]
    assert sorted(steps) == list(range(script.AUTO_REPLACE_STEPS))
    for step, entries in steps.items():
        alone = step in (kill, kill + 1)
        assert sorted(rank for rank, _ in entries) == ([0] if alone else [0, 1] if step < kill else [0, REPLACEMENT])
    assert sorted(finals["auto_replace"]) == [0, REPLACEMENT]
    survivor, replacement = finals["auto_replace"][0], finals["auto_replace"][REPLACEMENT]
    assert survivor["final"] == replacement["final"] and survivor["final"] != survivor["initial"]
    assert (
        survivor["auto"] == replacement["auto"] == {"arm": "sync", "decisions": 2, "steps": script.AUTO_REPLACE_STEPS}
    )
    assert survivor["global_step"] == replacement["global_step"] == script.AUTO_REPLACE_STEPS
    heal, join = survivor["history"]
    assert heal["world_size"] == 1 and join["joined"] == [1] and join["world_size"] == 2
    assert survivor["stats"]["mpi/heal/replaced"] == 1.0
    assert "lightning_mpi: replaced: 1 new rank (1) joined" in err


@pytest.mark.timeout(10)
def test_mpi_auto_survivors_agree_on_the_arm_and_the_next_decision():
    """What ``mpi_auto``'s survivors agree after a heal (lightning_mpi.rules.auto.heal), from each
    one's (decisions, steps, inside a decision)."""
    from lightning_mpi.rules.auto.heal import agree_after_heal

    # nobody in a decision: re-decide at the step after the furthest survivor's (one may be a step behind)
    assert agree_after_heal([(2, 30, False), (2, 29, False)], 5) == (0, 2, 31)
    assert agree_after_heal([(0, 1, False), (0, 2, False)], 5) == (0, 0, 5)  # not before the first steps
    # all in the decision, or some not there yet: it is redone at its step
    assert agree_after_heal([(1, 11, True), (1, 10, False), (1, 11, True)], 5) == (0, 1, 11)
    assert agree_after_heal([(1, 10, False), (1, 11, True)], 5) == (1, 1, 11)
    # one completed it (one more decision): its arm for everyone, the others take its outcome
    assert agree_after_heal([(1, 11, True), (2, 11, False)], 5) == (1, 2, 12)
    with pytest.raises(ValueError, match="more than one decision apart"):
        agree_after_heal([(1, 11, False), (3, 40, False)], 5)


@pytest.mark.timeout(30)
def test_mpi_auto_keeps_its_arm_and_its_state_through_a_heal():
    """On one rank (no MPI peers): what a heal keeps of ``mpi_auto`` (its decisions' state, its arm's
    kept state with this rank's own part under "local"; inside a decision, the state that decision
    started from) binds again the arm in use with that state, and the next decision is scheduled."""
    from mpi4py import MPI
    from torch import nn

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.auto import AutoRule
    from lightning_mpi.rules.auto.choice import default_plan
    from lightning_mpi.rules.auto.rule import PROBE_STEPS
    from lightning_mpi.rules.diloco import BoundDiLoCo

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(net.parameters())
    bound = AutoRule().bind(Transport(MPI.COMM_SELF), params)
    bound.healing = True
    plan = default_plan(bound.sizes)
    bound._bind(plan)  # Streaming DiLoCo, the arm of the first steps on more than one rank
    assert bound.inner.healing  # an arm bound later keeps its exchanges' starts too
    bound.steps, bound.decisions, bound.observed = 3, 0, {"sync": (0.1, 1e9)}
    kept = bound.heal_state()
    assert kept["healed"] and not kept["deciding"] and kept["choice"] == plan.as_dict()
    assert "local" in kept and "local" not in kept["inner"]  # a replacement takes the rest
    healed = AutoRule().bind(Transport(MPI.COMM_SELF), params)
    healed.load_state_dict(kept)
    assert isinstance(healed.inner, BoundDiLoCo) and healed.choice == plan
    assert (healed.steps, healed.decisions, healed.next_decision, healed.observed) == (3, 0, PROBE_STEPS, {})
    bound.deciding = {**kept, "deciding": True, "steps": 2}
    assert bound.heal_state()["steps"] == 2  # inside a decision: the state it started from
    bound.close()
    healed.close()


@pytest.mark.timeout(30)
def test_an_mpi_auto_survivor_inside_a_decision_another_completed_takes_its_outcome():
    """On one rank (no MPI peers; the survivors' allgather answered by hand): survivor A completes a
    decision that switches from Streaming DiLoCo to every-step ASA; survivor B is inside it when
    the loss comes, keeps the state it started from, binds on the healed run the arm A's state
    names (the agreement), and takes A's outcome: the same arm, decisions, weights and momenta, the
    next decision agreed at the heal, nothing observed kept."""
    from types import SimpleNamespace

    from mpi4py import MPI
    from torch import nn

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.auto import AutoRule
    from lightning_mpi.rules.auto.choice import default_plan
    from tests.scripts.auto_assumed import assumed

    with assumed("50,1000,0.1"):  # decisions from these numbers, not timed ones
        rule = AutoRule()

        def survivor(seed: int):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            torch.manual_seed(seed)  # each rank its own local steps
            for _ in range(2):
                opt.zero_grad()
                net(torch.randn(5, 3)).pow(2).mean().backward()
                opt.step()
            bound = rule.bind(Transport(MPI.COMM_SELF), list(net.parameters()))
            bound.healing = True
            bound._bind(default_plan(bound.sizes))  # the first steps' arm on more than one rank
            bound.steps = bound.next_decision = 5
            return net, opt, SimpleNamespace(bound=bound)

        net_a, opt_a, runner_a = survivor(1)
        kept: list = []

        def completes(op):  # the strategy's executor, with no loss
            op.start(runner_a.bound)
            kept.append(op.result(runner_a.bound, op.run(runner_a.bound)))

        completes(runner_a.bound.decision(opt_a))
        a = runner_a.bound
        assert a.choice.arm == "sync" and a.decisions == 1 and a.deciding is None
        net_b, opt_b, runner_b = survivor(2)
        theirs = (a.decisions, a.steps, False, a.choice.as_dict())

        def interrupted(op):  # the strategy's executor: a loss inside, this survivor takes A's result
            started = op.start(runner_b.bound)
            runner_b.bound.decide = lambda optimizer: (_ for _ in ()).throw(RuntimeError("a rank died"))
            with pytest.raises(RuntimeError):
                op.run(runner_b.bound)
            state = runner_b.bound.heal_state()
            assert state["deciding"] and state["choice"]["arm"] == "streaming" and state["decisions"] == 0
            transport = Transport(MPI.COMM_SELF)
            # the healed run's two survivors: on one host (the binding's host keys), and A's agreement
            transport.allgather_object = lambda mine: [mine, mine if isinstance(mine, str) else theirs]
            transport.size = 2
            healed = rule.bind(transport, list(net_b.parameters()))
            healed.load_state_dict(state)  # binds A's arm: binding is collective, every survivor binds the same
            assert healed.choice == a.choice and healed.next_decision == 6
            runner_b.bound = healed
            op.take(healed, kept[0], started)

        interrupted(runner_b.bound.decision(opt_b))
        b = runner_b.bound
        assert (b.choice, b.decisions, b.switches, b.observed, b.next_decision) == (a.choice, 1, 1, {}, 6)
        assert all(torch.equal(p, q) for p, q in zip(net_a.parameters(), net_b.parameters(), strict=True))
        moments = [
            opt.state[p]["momentum_buffer"] for opt, net in ((opt_a, net_a), (opt_b, net_b)) for p in net.parameters()
        ]
        half = len(moments) // 2
        assert all(torch.equal(x, y) for x, y in zip(moments[:half], moments[half:], strict=True))


@pytest.mark.timeout(10)
def test_gosgd_weights_are_renormalised_over_the_survivors():
    from lightning_mpi.rules.gossip import renormalised, weighted_consensus

    # four ranks' weights after some pushes (sum 1); rank 3 is lost with its mass
    weights = [0.25, 0.125, 0.375, 0.25]
    survivors = renormalised(weights[:3])
    assert survivors == [1 / 3, 1 / 6, 1 / 2] or all(
        math.isclose(a, b) for a, b in zip(survivors, [1 / 3, 1 / 6, 1 / 2], strict=True)
    )
    assert math.isclose(sum(survivors), 1.0)
    thetas = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([0.0, 4.0])]
    # the consensus is scale-free: renormalising does not move it
    assert torch.allclose(weighted_consensus(thetas, survivors), weighted_consensus(thetas, weights[:3]))
    with pytest.raises(ValueError, match="sum to 0.0; expected a positive sum"):
        renormalised([0.0, 0.0])
    with pytest.raises(ValueError, match="positive sum"):
        renormalised([float("nan")])


def test_script_is_where_the_tests_expect_it():
    assert Path(SCRIPT).exists()


class _FakeTransport:
    """What RunHealing asks of the healed run's transport, answering as the other survivors would."""

    def __init__(self, rank: int, others: list, sent=None) -> None:
        self.rank, self.size, self._others, self._sent, self.broadcasts = rank, 2, others, sent, []

    def allgather_object(self, mine):
        everyone = list(self._others)
        everyone.insert(self.rank, mine)
        return everyone

    def broadcast_object(self, obj, root=0):
        self.broadcasts.append((obj, root))
        return obj if root == self.rank else self._sent


def _healing(monkeypatch, transport):
    """A RunHealing whose heal_run and strategy are stand-ins (no MPI)."""
    from types import SimpleNamespace

    from lightning_mpi.strategies import healing as module

    healed = SimpleNamespace(lost=(2,), old_ranks=(0, 1))
    run = SimpleNamespace(healed=healed, transport=transport, base=None)
    monkeypatch.setattr(module, "heal_run", lambda *a, **k: run)
    failures = SimpleNamespace(rank=transport.rank, world_size=3, transport=None, base_comm=None, adopt=lambda r: None)
    environment = SimpleNamespace(derived_comms=lambda: [], adopt=lambda comm: None)
    adopted = []
    h = module.RunHealing(None, None, failures, environment, lambda: None, adopted.append, lambda: None, "sync")
    h.mode = "shrink"
    return h, adopted


@pytest.mark.timeout(10)
def test_a_survivor_behind_takes_the_result_and_the_others_redo(monkeypatch, capsys):
    from lightning_mpi.comm.errors import ProcessFailed

    calls = []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise ProcessFailed((2,), "allreduce")
        return "redone"

    # rank 1 missed the completion of the operation that rank 0 completed (its 6th): takes rank 0's result
    # (rank 0 had begun its 4th batch, rank 1 is still in its 3rd)
    behind, adopted = _healing(monkeypatch, _FakeTransport(1, [(6, "allreduce", "MPI_ERR_REVOKED", 0, 4)], "rank 0's"))
    behind.completed, behind.boundaries = 5, 3
    assert behind.operation("allreduce", fails_once, take=lambda kept: f"took {kept}") == "took rank 0's"
    assert len(calls) == 1 and behind.completed == 6 and adopted == [None]
    assert behind.grow_at == 5  # a spawn only from the batch after the furthest survivor's
    assert behind.history[0]["redo"] is False and behind.stats["mpi/heal/events"] == 1.0
    # rank 0, ahead, sends the result it kept and redoes the operation it was in (its 7th)
    calls.clear()
    transport = _FakeTransport(0, [(5, "allreduce", "MPI_ERR_PROC_FAILED", 1, 3)])
    ahead, _ = _healing(monkeypatch, transport)
    ahead.completed, ahead._last, ahead.boundaries = 6, "rank 0's", 4
    assert ahead.operation("reduce", fails_once) == "redone" and len(calls) == 2 and ahead.completed == 7
    assert ahead.grow_at == 5
    assert transport.broadcasts == [("rank 0's", 0)]
    assert "lightning_mpi: healed: rank 2 of 3 lost (detected in reduce on rank 0)" in capsys.readouterr().err
    # more than one operation apart: no way back in step
    far, _ = _healing(monkeypatch, _FakeTransport(1, [(8, "x", "MPI_ERR_REVOKED", 0, 0)]))
    far.completed = 5
    with pytest.raises(RankFailedError, match="3 operations apart"):
        far.operation("x", lambda: (_ for _ in ()).throw(ProcessFailed((2,), "x")))


@pytest.mark.timeout(10)
def test_a_rank_lost_during_the_heal_heals_again(monkeypatch):
    from lightning_mpi.comm.errors import ProcessFailed

    class DiesOnce(_FakeTransport):
        def allgather_object(self, mine):
            if not getattr(self, "died", False):
                self.died = True
                raise ProcessFailed((1,), "allgather")
            return [mine]

    healing, adopted = _healing(monkeypatch, DiesOnce(0, []))
    runs = iter([Exception("first run failed"), "redone"])

    def run():
        result = next(runs)
        if isinstance(result, Exception):
            raise ProcessFailed((2,), "allreduce")
        return result

    assert healing.operation("allreduce", run) == "redone"
    assert adopted == [None] and healing.events == 1  # one heal, made of two shrinks


@pytest.mark.timeout(10)
def test_a_heal_during_validation_binds_the_rule_outside_inference_mode(monkeypatch):
    """Lightning validates under ``torch.inference_mode()``: what a heal there keeps and binds anew
    (DiLoCo's outer state, residuals) must be tensors that training can update in place later."""
    from lightning_mpi.comm.errors import ProcessFailed

    healing, _ = _healing(monkeypatch, _FakeTransport(0, [(0, "reduce", "MPI_ERR_REVOKED", 1, 0)]))
    modes = []
    healing._adopt = lambda state: modes.append(torch.is_inference_mode_enabled())
    runs = iter([True, False])

    def run():
        if next(runs):
            raise ProcessFailed((2,), "allreduce")
        return torch.ones(2)

    with torch.inference_mode():
        assert torch.equal(healing.operation("reduce", run), torch.ones(2))
    assert modes == [False]


@pytest.mark.timeout(10)
def test_a_save_interrupted_by_a_loss_is_redone_and_the_lost_writers_temporary_removed(monkeypatch, tmp_path):
    """``save_through_heals``: the save and a barrier are one healing operation; after the heal the
    writer (the new rank 0) removes the temporary file the lost writer left and writes again; the
    previous file stays whole until then. ``heal=None``: the save alone, as before."""
    from lightning_mpi.comm.errors import ProcessFailed
    from lightning_mpi.strategies.checkpoint_io import remove_stale_temporaries, save_through_heals
    from lightning_mpi.strategies.healing import RunHealing

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous checkpoint")
    others = [tmp_path / ".other.ckpt.0123456789ab.tmp", tmp_path / ".last.ckpt.tmp", tmp_path / "last.ckpt.x.tmp"]
    for other in others:
        other.write_bytes(b"not ours")
    calls = []

    def save():
        calls.append("save")
        if len(calls) == 1:  # the writer died in the middle of its write: a temporary file is left
            (tmp_path / ".last.ckpt.a1b2c3d4e5f6.tmp").write_bytes(b"half")
            assert target.read_bytes() == b"the previous checkpoint"
            raise ProcessFailed((0,), "barrier")
        assert not (tmp_path / ".last.ckpt.a1b2c3d4e5f6.tmp").exists()  # removed before the redo's write
        target.write_bytes(b"the new checkpoint")

    healing, adopted = _healing(monkeypatch, _FakeTransport(0, [(4, "barrier", "MPI_ERR_PROC_FAILED", 1, 0)]))
    healing.completed = 4
    save_through_heals(healing, save, lambda: calls.append("barrier"), target, writes=lambda: True)
    assert calls == ["save", "save", "barrier"] and healing.completed == 5 and adopted == [None]
    assert target.read_bytes() == b"the new checkpoint" and all(other.exists() for other in others)
    assert healing.history[0]["where"] == "the checkpoint save"
    # heal=None: the save alone, no barrier
    inert = RunHealing(None, None, None, None, lambda: None, print, print, "sync")
    save_through_heals(inert, lambda: calls.append("plain"), lambda: calls.append("barrier"), target, lambda: True)
    assert calls[3:] == ["plain"]
    assert remove_stale_temporaries(tmp_path / "missing" / "x.ckpt") == []


@pytest.mark.timeout(10)
def test_a_heal_during_validation_reshards_the_next_validation():
    """A heal in fit's validation leaves that validation its loaders and drops them at the next
    training batch; a heal while training drops them at once. Shrunk to one rank, the run stays
    distributed for Lightning (a ``sync_dist`` key keeps its sync)."""
    from types import SimpleNamespace

    from lightning_mpi.strategies.healing import RunHealing
    from lightning_mpi.strategies.sharding import LoaderSharding

    val_loop = SimpleNamespace(_combined_loader="validation loaders")
    fit_loop = SimpleNamespace(_combined_loader="training loader", epoch_loop=SimpleNamespace(val_loop=val_loop))
    trainer = SimpleNamespace(fit_loop=fit_loop, validating=True)
    sharding = LoaderSharding(api=None)
    sharding.reshard_next_epoch(trainer)
    assert fit_loop._combined_loader is None and val_loop._combined_loader == "validation loaders"
    trainer.validating = False
    sharding.at_training_batch(trainer)
    assert val_loop._combined_loader is None
    val_loop._combined_loader = "rebuilt"
    sharding.at_training_batch(trainer)  # once only
    assert val_loop._combined_loader == "rebuilt"
    sharding.reshard_next_epoch(trainer)  # training: at once
    assert val_loop._combined_loader is None
    healing = RunHealing(None, None, SimpleNamespace(world_size=3), None, lambda: None, print, print, "sync")
    assert not healing.distributed(1) and healing.distributed(2)
    healing.mode = "shrink"
    assert healing.distributed(1)


# -- the ``outer`` launch (outside CI): heal="replace" with the compressed and DiLoCo rules, a loss in
#    DiLoCo's final average ------------------------------------------------------------------------------
OUTER_LAUNCHED = 4
#: per phase of the outer launch: the processes at its start (launch ranks; a replacement records under
#: 20 + the index of the phase that spawned it), the one that dies, and the step a replacement joins at
OUTER = {
    "topk_replace": ([0, 1, 2, 3], 3, 3),
    "diloco_replace": ([0, 1, 2, 20], 20, 3),
    "streaming_replace": ([0, 1, 2, 21], 21, 3),
    "diloco_end": ([0, 1, 2, 22], 22, None),
    "streaming_end": ([0, 1, 2], 2, None),
}


@pytest.fixture(scope="module")
def outer_healed(tmp_path_factory):
    """``heal_train.py ... outer`` on 4 ranks: its own launch, not in the Open MPI CI run, whose time
    is at its limit; run it with ``LIGHTNING_MPI_TEST_MPI=openmpi python -m pytest -m mpi
    tests/strategies/test_heal.py -k outer``."""
    _, err, out = _heal_launch(tmp_path_factory, "heal_outer", OUTER_LAUNCHED, 840, "outer")
    return (err, *launch_outputs(out), out)


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", ["topk_replace", "diloco_replace", "streaming_replace"])
def test_outer_replace_with_compressed_and_diloco_rules_matches_a_replay(outer_healed, phase):
    """The Trainer with ``heal="replace"`` at W = 4: the last rank dies (for Streaming DiLoCo while an
    exchange is in flight, which the survivors start again over themselves); a replacement joins
    (for Streaming DiLoCo ready while another exchange is in flight, let in at the next step
    without one): top-k's residuals stay local and the replacement starts with none; DiLoCo's
    replacement takes the outer state from rank 0, its replica starting from θ_global. All four
    end bitwise identical, equal to a one-process replay of the rule over the ranks alive at each
    step with the recorded batches."""
    err, finals, records, out = outer_healed
    start, lost, joins = OUTER[phase]
    new = 20 + list(OUTER).index(phase)
    survivors = [r for r in start if r != lost]
    assert sorted(finals[phase]) == sorted([*survivors, new])
    steps = records[phase]
    assert sorted(steps) == list(range(8))  # no step lost, none repeated
    kill = next(s for s in range(8) if lost not in {rank for rank, _ in steps[s]})
    for step, entries in steps.items():
        alive = start if step < kill else survivors if step < joins else [*survivors, new]
        assert sorted(rank for rank, _ in entries) == sorted(alive), step
        assert all(e["world"] == len(alive) for _, e in entries), step
    ours = [finals[phase][r] for r in [*survivors, new]]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # bitwise identical, replacement too
    batches = [{rank: e["indices"] for rank, e in steps[s]} for s in range(8)]
    script = _script_module()
    if phase == "topk_replace":
        replay = _replay_compressed(ours[0]["initial"], batches, _topk(script.TOPK_RATIO))
    elif phase == "diloco_replace":
        replay = _replay_diloco(ours[0]["initial"], batches, script.OUTER_PERIOD, 1, 0, 0.0)
    else:
        replay = _replay_diloco(ours[0]["initial"], batches, **script.STREAMING)
    assert _close(ours[0]["final"], replay)
    for result in ours:
        assert result["global_step"] == 8 and result["world_size"] == 4 and result["stats"]["mpi/heal/world_size"] == 4
    healed_event, joined_event = ours[0]["history"]
    assert healed_event["lost"] == [3] and healed_event["world_size"] == 3
    assert joined_event["joined"] == [3] and joined_event["world_size"] == 4
    assert ours[0]["stats"]["mpi/heal/replaced"] == 1


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", ["diloco_end", "streaming_end"])
def test_outer_a_rank_lost_in_the_final_average_heals_and_the_survivors_average_theirs(outer_healed, phase):
    """DiLoCo under Fabric (``finish_training``), Streaming DiLoCo under the Trainer (``on_train_end``,
    ending with an exchange in flight; the loss comes after it and one fragment were averaged into
    the weights): no loss while training; the last rank dies inside the final average. The
    survivors heal there, put back what the interrupted average changed and redo it over
    themselves: they end bitwise identical on the mean of their own replicas (a replay that leaves
    the lost rank out of the final average, and not one that keeps it)."""
    err, finals, records, out = outer_healed
    start, lost, _ = OUTER[phase]
    survivors = [r for r in start if r != lost]
    steps = records[phase]
    count = 6 if phase == "diloco_end" else 8
    assert sorted(steps) == list(range(count))
    for step, entries in steps.items():
        assert sorted(rank for rank, _ in entries) == sorted(start), step  # nobody lost while training
    assert sorted(finals[phase]) == sorted(survivors)
    ours = [finals[phase][r] for r in survivors]
    assert all(result["final"] == ours[0]["final"] for result in ours)  # bitwise identical survivors
    batches = [{rank: e["indices"] for rank, e in steps[s]} for s in range(count)]
    script = _script_module()
    schedule = (script.OUTER_PERIOD, 1, 0, 0.0) if phase == "diloco_end" else tuple(script.STREAMING_END.values())
    assert _close(ours[0]["final"], _replay_diloco(ours[0]["initial"], batches, *schedule, lost_at_end=(lost,)))
    assert not _close(ours[0]["final"], _replay_diloco(ours[0]["initial"], batches, *schedule))
    for result in ours:
        (event,) = result["history"]
        assert event["lost"] == [len(start) - 1] and event["world_size"] == len(survivors)
        assert event["where"] == "the final average" and event["redo"]
        assert result["world_size"] == len(survivors)
    line = f"rank {len(start) - 1} of {len(start)} lost (detected in the final average"
    assert sum(line in x for x in err.splitlines()) == 1


def _replay_adam(
    initial: list, steps: list[list[list[int]]], lr: float, clip: float | None = None, gamma_after: dict | None = None
) -> tuple[list, dict]:
    """One process, one Adam over the whole model: each step averages the MSE gradients of the
    batches the ranks alive at that step trained on (``steps[s]``: one index list per rank);
    ``clip``: clipped by the norm of the whole gradient; ``gamma_after``: step -> the lr's factor
    after it (an epoch's end, ``ExponentialLR``)."""
    script = _script_module()
    net = script.make_net()
    with torch.no_grad():
        for p, w in zip(net.parameters(), initial, strict=True):
            p.copy_(torch.tensor(w, dtype=torch.float64).view_as(p))
    data = script.Indexed()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for step, batches in enumerate(steps):
        grads = []
        for index in batches:
            net.zero_grad()
            torch.nn.functional.mse_loss(net(data.x[index]), data.y[index]).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *per_rank in zip(net.parameters(), *grads, strict=True):
            p.grad = sum(per_rank) / len(per_rank)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if gamma_after and step in gamma_after:
            for group in opt.param_groups:
                group["lr"] *= gamma_after[step]
    state = {
        str(i): {k: v.double().flatten().tolist() for k, v in opt.state[p].items()}
        for i, p in enumerate(net.parameters())
    }
    return [p.detach().double().flatten().tolist() for p in net.parameters()], state


def _assert_one_process_adam(result: dict, steps: dict, lr: float) -> None:
    """``result``'s final weights and whole Adam state equal one process running Adam at ``lr`` over
    the batches of the ranks alive at each step (``steps``: step -> [(launch rank, record)], the
    batches in order of current rank)."""
    batches = [[e["indices"] for _, e in sorted(steps[s], key=lambda x: x[1]["rank"])] for s in sorted(steps)]
    weights, state = _replay_adam(result["initial"], batches, lr)
    assert _close(result["final"], weights)
    assert sorted(state) == sorted(result["optimizer"])
    for index, entry in state.items():
        for key, values in entry.items():
            assert _close([result["optimizer"][index][key]], [values]), (index, key)


@pytest.fixture(scope="module")
def zero_healed(tmp_path_factory):
    """``heal_train.py ... zero`` on 5 ranks: its own launch (about 25 s), not in the Open MPI CI run;
    ``LIGHTNING_MPI_TEST_MPI=openmpi python -m pytest -q -m mpi tests/strategies/test_heal.py -k zero``."""
    _, err, out = _heal_launch(tmp_path_factory, "heal_zero", 5, 400, "zero")
    return (err, *launch_outputs(out), out)


@pytest.mark.mpi
@pytest.mark.timeout(450)
def test_zero_heals_from_the_buddy_copies_and_matches_a_replay(zero_healed):
    """ZeRO with Adam under ``heal="shrink"`` in a Fabric loop at W = 5: launch rank 4 dies (its shard
    comes back from rank 3's mirror, resharded over four), then launch rank 1 (from rank 0's
    mirror, over three). The three survivors end bitwise identical, weights and the whole Adam
    state, equal to a one-process Adam over the ranks alive at each step: no optimizer state was
    lost or made up."""
    err, finals, records, _ = zero_healed
    script = _script_module()
    steps = records["zero"]
    assert sorted(steps) == list(range(script.ZERO_STEPS))  # no step lost, none repeated
    first, second = sorted(script.ZERO_KILLS)
    for step, entries in steps.items():
        alive = [0, 1, 2, 3, 4] if step < first else [0, 1, 2, 3] if step < second else [0, 2, 3]
        assert sorted(rank for rank, _ in entries) == alive, step
        assert all(e["world"] == len(alive) for _, e in entries), step
    assert sorted(finals["zero"]) == [0, 2, 3]
    ours = finals["zero"][0]
    for theirs in finals["zero"].values():  # bitwise identical
        assert theirs["final"] == ours["final"] and theirs["optimizer"] == ours["optimizer"]
    _assert_one_process_adam(ours, steps, script.ZERO_LR)
    assert [(e["lost"], e["world_size"], e["where"]) for e in ours["history"]] == [
        ([4], 4, "the exchange"),
        ([1], 3, "the exchange"),
    ]
    assert sum("healed: rank" in line for line in err.splitlines()) == 3  # and the Trainer's, below


@pytest.mark.mpi
@pytest.mark.timeout(450)
def test_zero_heals_under_the_trainer_with_clipping_a_schedule_and_checkpoints(zero_healed, tmp_path):
    """ZeRO under the Trainer on the three left (gradient clipping by the global norm, an lr that
    decays each epoch: the mirror follows both): launch rank 3 dies at the start of a batch; the
    survivors heal in Lightning's ``reduce`` (``self.log(sync_dist=True)``, inside the forward
    pass: the weights are left alone, backward works), finish, and end bitwise identical and equal
    to a one-process replay. The checkpoints written after the heal hold one optimizer shard per survivor."""
    err, finals, records, out = zero_healed
    script = _script_module()
    steps = records["zero_trainer"]
    assert sorted(steps) == list(range(script.ZERO_TRAINER_STEPS))
    for step, entries in steps.items():
        alive = [0, 2, 3] if step < script.ZERO_TRAINER_KILL else [0, 2]
        assert sorted(rank for rank, _ in entries) == alive, step
    assert sorted(finals["zero_trainer"]) == [0, 2]
    ours = finals["zero_trainer"][0]
    theirs = finals["zero_trainer"][2]
    assert theirs["final"] == ours["final"] and theirs["optimizer"] == ours["optimizer"]
    assert ours["world_size"] == 2 and ours["global_step"] == script.ZERO_TRAINER_STEPS
    ((event),) = ours["history"]
    assert event["lost"] == [2] and event["where"] == "reduce"
    ordered = [sorted(steps[s], key=lambda x: x[1]["rank"]) for s in sorted(steps)]
    batches = [[e["indices"] for _, e in entries] for entries in ordered]
    epoch_ends = {
        s: script.ZERO_GAMMA
        for s in range(len(ordered) - 1)
        if ordered[s + 1][0][1]["epoch"] > ordered[s][0][1]["epoch"]
    }
    assert epoch_ends  # the schedule stepped
    weights, state = _replay_adam(ours["initial"], batches, script.ZERO_LR, script.ZERO_CLIP, epoch_ends)
    assert _close(ours["final"], weights)
    for index, entry in state.items():
        for key, values in entry.items():
            assert _close([ours["optimizer"][index][key]], [values]), (index, key)
    for checkpoint in (out / "zero_checkpoints").iterdir():
        assert sorted(p.name for p in checkpoint.glob("shard-*")) == [
            "shard-00000-of-00002.pt",
            "shard-00001-of-00002.pt",
        ]
