"""``mpi_hybrid`` (lightning_mpi.rules.hybrid): every step inside a replica, (Streaming) DiLoCo across
replicas, each rank carrying its piece of its replica's outer exchange.

Cheap checks here (arguments, the layout's arithmetic, a heal's state on one rank, the
reconciliation inside a replica, SparseLoCo's wire on pieces of one rank's teams); then one launch of
``tests/scripts/hybrid_train.py`` on 4 ranks (2 replicas of 2 ranks, faked with ``group_size=2``)
against one-process math (on fp32 and on SparseLoCo's wire), flat Streaming
DiLoCo, itself resumed, and under Fabric, and one on 2 ranks resuming its checkpoint at another
world size; and, under Open MPI with ULFM, ``tests/scripts/hybrid_heal.py``: a rank lost inside a
replica, then a whole replica, against a one-process replay.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest
import torch
from torch import nn

from lightning_mpi.comm.errors import RankFailedError
from lightning_mpi.rules.hybrid import HybridRule
from lightning_mpi.rules.hybrid.layout import RANKS_PER_NODE_ENV, pieces_of, ranks_per_group, replica_table
from tests.launcher.helpers import finish, launch
from tests.mpi_utils import REPO, require_ulfm, run_mpi

SCRIPTS = REPO / "tests" / "scripts"


# -- arguments and names --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"group_size": 0}, "group_size"),
        ({"group_size": 1.5}, "group_size"),
        ({"inner_exchange": "ring"}, "inner_exchange"),
        ({"inner_wire": "int8"}, "inner_wire"),
        ({"inner_exchange": "allreduce", "inner_wire": "fp16"}, "inner_wire"),
        ({"inner_exchange": "zero", "inner_wire": "bf16"}, "inner_wire"),
        ({"period": 0}, "period"),
        ({"period": 4, "fragments": 5}, "fragments"),
        ({"period": 8, "fragments": 4, "overlap_steps": 2}, "overlap_steps"),
        ({"mix_alpha": 1.0}, "mix_alpha"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"wire": "onebit"}, "wire"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=rf"{name}="):
        HybridRule(**kwargs)


def test_the_strategy_is_registered_and_checks_its_arguments():
    import lightning_mpi

    assert lightning_mpi.STRATEGIES["mpi_hybrid"][0] == "HybridStrategy"
    with pytest.raises(ValueError, match="group_size="):
        lightning_mpi.HybridStrategy(group_size=0)
    strategy = lightning_mpi.HybridStrategy(group_size=2, period=6, fragments=3, wire="int8", inner_wire="bf16")
    assert isinstance(strategy.rule, HybridRule) and strategy.rule.group_size == 2
    assert strategy.rule.inner_rule().wire == "bf16" and strategy.rule.inner_rule().exchange == "asa"


def test_zero_inside_the_replicas_shards_the_optimizer_and_refuses_to_heal():
    from mpi4py import MPI

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.zero import BoundZeroRule

    net = torch.nn.Linear(4, 3)
    bound = HybridRule(inner_exchange="zero").bind(Transport(MPI.COMM_SELF), list(net.parameters()))
    try:
        assert isinstance(bound.inner, BoundZeroRule) and bound.optimizer_shards is not None
        optimizer = torch.optim.Adam(net.parameters())
        assert bound.optimizer_shards.take_optimizer(optimizer, None) is False
        assert bound.optimizer_shards.optimizer is optimizer
        assert bound.optimizer_shards.optimizer_state()["copy"] == 0  # the replica of each shard
        with pytest.raises(ValueError, match="inner_exchange='zero'.*heal=None"):
            bound.healing = True
        assert not bound.healing
    finally:
        bound.close()
    plain = HybridRule().bind(Transport(MPI.COMM_SELF), list(net.parameters()))
    try:
        assert plain.optimizer_shards is None
        plain.healing = True
        assert plain.healing
    finally:
        plain.close()


# -- the layout ---------------------------------------------------------------------------------------------
def test_replicas_are_numbered_by_their_first_rank_and_pieces_go_round_the_members(monkeypatch):
    assert replica_table(["host b", "host b", "host a", "host a"]) == [0, 0, 1, 1]
    assert replica_table(["g0", "g1", "g0", "g1"]) == [0, 1, 0, 1]
    # replicas of one size: member i carries piece i; a shrunk replica carries the lost member's too
    assert [pieces_of(m, 2, 2) for m in range(2)] == [[0], [1]]
    assert pieces_of(0, 1, 2) == [0, 1]
    assert [pieces_of(m, 2, 3) for m in range(2)] == [[0, 2], [1]]
    monkeypatch.delenv(RANKS_PER_NODE_ENV, raising=False)
    assert ranks_per_group(None) is None and ranks_per_group(3) == 3
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    assert ranks_per_group(None) == 2 and ranks_per_group(4) == 4  # group_size wins
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "two")
    with pytest.raises(ValueError, match=RANKS_PER_NODE_ENV):
        ranks_per_group(None)


# -- healing on one rank ----------------------------------------------------------------------------------
def _bind(rule: HybridRule, params: list[torch.Tensor]):
    from mpi4py import MPI

    from lightning_mpi.comm.transport import Transport

    bound = rule.bind(Transport(MPI.COMM_SELF), params)
    bound.healing = True
    return bound


def _rebound(bound, rule: HybridRule, params: list[torch.Tensor], state: dict):
    """``bound`` closed and ``rule`` bound anew from ``state`` (a heal's or a checkpoint's), started."""
    bound.close()
    bound = _bind(rule, params)
    bound.load_state_dict(state)
    bound.on_train_start()
    return bound


def _step(bound, net: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One training step of ``net`` on random inputs, through the rule's hooks."""
    opt.zero_grad()
    net(torch.randn(6, 3)).pow(2).mean().backward()
    assert bound.before_step(opt)
    opt.step()
    bound.after_step(opt)


@pytest.mark.timeout(60)
def test_a_binding_rebuilt_from_its_heal_state_goes_on_as_the_uninterrupted_run():
    """On one rank (no peers): bound again mid-run from ``heal_state()``, also while an exchange is in
    flight (kept as the Δ it started from, started again), the run ends as the uninterrupted one."""
    rule = HybridRule(period=4, fragments=2, overlap_steps=1, mix_alpha=0.5, wire="fp32")

    def run(cut: int | None) -> tuple[list[torch.Tensor], list]:
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        params = list(net.parameters())
        bound = _bind(rule, params)
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        bound.on_train_start()
        statuses = []
        for step in range(11):
            if step == cut:  # as a heal: the state read on this rank, a new binding started from it
                bound = _rebound(bound, rule, params, bound.heal_state())
            _step(bound, net, opt)
            statuses.append([f.status for f in bound.fragments])
        bound.on_train_end()
        bound.close()
        return [p.detach().clone() for p in params], statuses

    whole, statuses = run(None)
    assert statuses[9][0] == "running"  # fragment 0's exchange started after step 10 is in flight at the cut
    healed, _ = run(10)
    assert all(torch.equal(a, b) for a, b in zip(whole, healed, strict=True))


class _Replica:
    """A replica's communicator as :meth:`BoundHybrid._agree_inside_replica` sees it, for one member
    (``rank``) whose replica-mates' counts are ``counts`` and whose ahead member sends ``sent``."""

    def __init__(self, rank: int, counts: list, sent=None) -> None:
        self.rank, self.size, self.counts, self.sent = rank, len(counts), counts, sent
        self.broadcasts: list[int] = []

    def allgather_object(self, mine):
        assert mine == self.counts[self.rank]
        return self.counts

    def broadcast_object(self, value, root=0):
        self.broadcasts.append(root)
        return value if self.rank == root else self.sent


@pytest.mark.timeout(60)
def test_survivors_of_a_replica_one_exchange_apart_take_the_result_more_cannot_heal():
    """After a heal the members of a replica compare their gradient exchanges: one that missed the
    completion of an exchange a replica-mate completed takes that result (and counts it when its redo
    runs); two apart fail the run (``RankFailedError``)."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    params = list(net.parameters())
    bound = _bind(HybridRule(fragments=1), params)
    taken = [torch.full_like(p, 7.0) for p in params]
    bound.inner_steps, bound._healed = 4, True
    bound.layout.inner = _Replica(1, [(5, False), (4, False)], sent=(True, taken))
    bound.on_train_start()
    assert bound._take_inner is not None and bound.layout.inner.broadcasts == [0]
    opt = torch.optim.SGD(params, lr=0.1)
    net(torch.randn(2, 3)).sum().backward()
    assert bound._exchange_gradients(opt) and bound.inner_steps == 5
    assert all(torch.equal(p.grad, t) for p, t in zip(params, taken, strict=True))
    # the member ahead sends and goes on with its own next exchange
    bound.inner_steps, bound._healed = 5, True
    bound.layout.inner = _Replica(0, [(5, False), (4, False)])
    bound.on_train_start()
    assert bound._take_inner is None
    bound.inner_steps, bound._healed = 3, True
    bound.layout.inner = _Replica(1, [(5, False), (3, False)])
    with pytest.raises(RankFailedError, match="2 gradient exchanges apart"):
        bound.on_train_start()
    bound.layout.inner = bound.layout.gather  # the binding's own, to close
    bound.close()


# -- on 4 ranks --------------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_two_replicas_of_two_ranks_against_one_process_flat_diloco_a_resume_and_fabric(tmp_path):
    out, checkpoint = tmp_path / "out.json", tmp_path / "hybrid.ckpt"
    run_mpi(4, [str(SCRIPTS / "hybrid_train.py"), str(out), str(checkpoint)], timeout=240, cwd=tmp_path)
    r = json.loads(out.read_text())
    # DiLoCo across 2 replicas, each on the mean of its 2 ranks' gradients, and model averaging of the
    # replicas: one process's math, bitwise (the sharded exchange on fp32 is the unsharded mean)
    for name in ("diloco", "model_avg"):
        case = r[f"replay_{name}"]
        assert case["diff"] == 0.0 and case["identical"], case
        assert (case["outer_steps"], case["replicas"], case["replica_size"]) == (3.0, 2.0, 2.0), case
    # SparseLoCo's wire across the 2 replicas: one process's math (per replica and piece, the carrier's
    # accumulator; the pieces' sparse rows averaged over the replicas that sent each entry), bitwise;
    # each rank sends its piece's row (29 entries of 114 or 113) to the other replica's carrier
    case = r["replay_sparse"]
    assert case["diff"] == 0.0 and case["identical"] and case["outer_steps"] == 3.0, case
    assert case["bytes_per_exchange"] == [72.0] * 4, case
    # one rank per replica: Streaming DiLoCo over 4 ranks, bitwise
    assert r["flat"] == {"diff": 0.0, "identical": True, "replicas": 4.0, "bytes_per_exchange": 288.0}
    # 2 x 2: each rank sends a third of what a rank of the flat run sends (1 peer and half the Δ against
    # 3 peers); per host, half of the flat run's bytes cross to the other host
    assert r["bytes"] == {"two_by_two": 96.0, "flat": 288.0}
    # an exact resume, with an exchange in flight at the save; one copy of each replica's state
    case = r["resume"]
    assert case["equal_on_every_rank"] and case["identical"] and case["saved_steps"] == 6, case
    assert case["in_flight_saved"] == [True, False] and (case["replicas_saved"], case["ranks_saved"]) == (2, 4), case
    assert r["fabric"] == {"identical": True, "replicas": 2.0, "outer_steps": 0.0,
                           "class": "lightning_mpi.fabric.HybridStrategy"}
    # ZeRO inside the replicas: the ASA run bitwise, half of the replica's Adam state on each rank, a
    # sharded save after fit that consolidates to replica 0's whole Adam state, and an exact resume
    case = r["zero"]
    assert case["diff"] == 0.0 and case["identical"] and case["sharded"], case
    assert all(0.45 < share < 0.55 for share in case["share_held"]), case
    assert case["consolidated_diff"] == 0.0 and case["consolidated_shapes"], case
    assert case["during_fit_rank0_weights"] and case["replicas_differed"], case
    assert case["resumed_equal_on_every_rank"], case
    # the 4-rank checkpoint on 2 ranks of one rank per replica: each replica starts from its own weights
    out = tmp_path / "other.json"
    run_mpi(2, [str(SCRIPTS / "hybrid_train.py"), str(out), "resume_other", str(checkpoint)], timeout=120, cwd=tmp_path)
    assert json.loads(out.read_text())["resume_other"] == {
        "replicas": 2.0, "identical": True, "saved_replicas": 2, "steps": 12,
        "from_saved_replica": True, "replicas_differed": True,
    }


# -- healing under Open MPI ----------------------------------------------------------------------------------
def _script():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import hybrid_heal
    finally:
        sys.path.pop(0)
    return hybrid_heal


def _replay(initial: list, steps: list[dict[int, list[int]]], replica_of) -> list:
    """One process: each replica (``replica_of(launch rank)``) trains its own net (SGD) on the mean of
    the gradients of its ranks alive at the step (``steps[s]``: launch rank -> sample indices); after
    every PERIOD steps Δ_r = θ_global − θ_r is averaged over the replicas alive then (the first outer
    step averages, the others are Nesterov steps, 0.7 and 0.9) and every replica restarts from
    θ_global; the end folds the last steps in by averaging. Returns θ_global."""
    from lightning_mpi.rules.diloco.outer import make_outer_optimizer, outer_step_

    script = _script()
    x, y = script.data()
    shapes = [p.shape for p in script.make_net().parameters()]
    theta = torch.cat([torch.tensor(w, dtype=torch.float32) for w in initial])
    outer = make_outer_optimizer([theta], 0.7, 0.9)
    nets: dict[int, nn.Module] = {}
    count = 0

    def restart(net: nn.Module) -> None:
        torch.nn.utils.vector_to_parameters(theta.clone(), net.parameters())

    def mean_delta() -> torch.Tensor:
        deltas = [theta - torch.nn.utils.parameters_to_vector(nets[r].parameters()) for r in sorted(nets)]
        return deltas[0] if len(deltas) == 1 else (deltas[0] + deltas[1]) / 2

    for step, batches in enumerate(steps):
        members: dict[int, list[int]] = defaultdict(list)
        for rank in sorted(batches):
            members[replica_of(rank)].append(rank)
        for replica in [r for r in nets if r not in members]:  # lost
            del nets[replica]
        for replica, ranks in members.items():
            if replica not in nets:
                nets[replica] = script.make_net()
                restart(nets[replica])
            net = nets[replica]
            grads = []
            for rank in ranks:
                net.zero_grad()
                index = batches[rank]
                nn.functional.mse_loss(net(x[index]), y[index]).backward()
                grads.append([p.grad.clone() for p in net.parameters()])
            with torch.no_grad():
                for i, p in enumerate(net.parameters()):
                    grad = grads[0][i] if len(grads) == 1 else (grads[0][i] + grads[1][i]) / 2
                    p.sub_(script.LR * grad)
        if (step + 1) % script.PERIOD == 0:
            count += 1
            with torch.no_grad():
                theta.sub_(mean_delta()) if count == 1 else outer_step_(outer, theta, mean_delta())
                for net in nets.values():
                    restart(net)
    if len(steps) % script.PERIOD:
        with torch.no_grad():
            theta.sub_(mean_delta())
    out, start = [], 0
    for shape in shapes:
        out.append(theta[start : start + shape.numel()].double().tolist())
        start += shape.numel()
    return out


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(300)
def test_a_rank_lost_inside_a_replica_shrinks_it_a_lost_host_leaves_the_other_going_on_and_replacements_join(
    tmp_path,
):
    """``lightning-mpi --heal -n 4 hybrid_heal.py``: launch rank 3 dies in a step whose outer exchange
    its replica-mate and the other replica then find failed (W 4 -> 3): its replica goes on with launch
    rank 2 alone, carrying both pieces; then, in a new run on the three, launch rank 2 (a whole
    replica) dies (W 3 -> 2) and the other replica goes on alone. Each phase's survivors exit 0,
    finish every step, end bitwise identical, and equal a one-process replay of the replicas. Then
    ``heal="replace"`` under the Trainer: with ``group_size`` the replacement forms a replica of its
    own; with replicas by host name the next one joins the survivor's replica."""
    require_ulfm()
    script = _script()
    args = [sys.executable, "-m", "lightning_mpi", "-n", 4, "--heal", "--hang-timeout", 120, "--grace", 3,
            SCRIPTS / "hybrid_heal.py", tmp_path]
    code, _, err = finish(launch(args, REPO), 290)
    assert code == 0, err[-6000:]
    records: dict[str, dict[int, dict[int, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    for path in tmp_path.glob("steps.*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            records[entry["phase"]][entry["step"]][int(path.suffixes[0][1:])] = entry["indices"]
    for phase, survivors, lost, layouts in (
        ("replica", [0, 1, 2], [3], {0: (2, 2, [0]), 1: (2, 2, [1]), 2: (2, 1, [0, 1])}),
        ("host", [0, 1], [2], {0: (1, 2, [0]), 1: (1, 2, [1])}),
    ):
        ours = {rank: json.loads((tmp_path / f"{phase}.{rank}.json").read_text()) for rank in survivors}
        assert sorted(ours) == survivors and not (tmp_path / f"{phase}.{lost[0]}.json").exists()
        finals = [result["final"] for result in ours.values()]
        assert all(final == finals[0] for final in finals)  # bitwise identical survivors
        for rank, result in ours.items():
            assert result["world_size"] == len(survivors) and [h["lost"] for h in result["history"]] == [lost]
            layout = result["layout"]
            assert (layout["replicas"], layout["replica_size"], layout["pieces"]) == layouts[rank], (phase, rank)
        steps = [records[phase][s] for s in range(script.STEPS)]
        assert all(sorted(steps[s]) == (survivors if s >= script.KILL else sorted(survivors + lost))
                   for s in range(script.STEPS)), phase
        replay = _replay(ours[0]["initial"], steps, lambda rank: rank // 2)
        assert all(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
                   for a, b in zip(finals[0], replay, strict=True)), phase
    for index, (phase, layout) in enumerate((("replace", (2, 1)), ("replace_host", (1, 2))), start=2):
        survivor = json.loads((tmp_path / f"{phase}.0.json").read_text())
        joined = json.loads((tmp_path / f"{phase}.{script.REPLACEMENT + index}.json").read_text())
        assert survivor["final"] == joined["final"], phase  # bitwise identical
        for result in (survivor, joined):
            assert (result["world_size"], result["global_step"]) == (2, script.REPLACE_STEPS), phase
            assert (result["layout"]["replicas"], result["layout"]["replica_size"]) == layout, phase
        assert (survivor["replaced"], joined["replaced"]) == (1, 0), phase


# -- SparseLoCo's wire across replicas ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"wire": "sparseloco", "outer_momentum": 0.5}, "outer_momentum"),
        ({"wire": "int4", "error_decay": 0.9}, "error_decay"),
        ({"wire": "sparseloco", "error_decay": 1.5}, "error_decay"),
        ({"wire": "sparseloco", "topk_per_chunk": 0}, "topk_per_chunk"),
        ({"wire": "sparseloco", "topk_per_chunk": 4097}, "topk_per_chunk"),
        ({"wire": "sparseloco", "topk_per_chunk": True}, "topk_per_chunk"),
        ({"period": "auto"}, "period"),
        ({"wire": "sparseloco", "fragments": 11}, "fragments"),  # period None: 10 on this wire
        ({"wire": "sparseloco", "fragments": 6}, "overlap_steps"),  # 10 // 6 = 1: no room for τ = 1
    ],
)
def test_bad_sparse_wire_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=rf"{name}="):
        HybridRule(**kwargs)


def test_period_and_the_outer_step_resolve_per_wire_as_diloco_does():
    from lightning_mpi.comm.sparseloco import SparseLoCoWire
    from lightning_mpi.rules.diloco import StreamingDiLoCoRule

    for wire in ("int4", "fp32", "sparseloco"):
        ours, theirs = HybridRule(wire=wire), StreamingDiLoCoRule(wire=wire)
        assert ours.inner_period() == theirs.inner_period() and ours.outer_step() == theirs.outer_step(), wire
        assert ours.decay() == theirs.decay() and ours.make_wire() == theirs.make_wire(), wire
    assert (HybridRule().inner_period(), HybridRule().outer_step()) == (50, (0.7, 0.9))
    sparse = HybridRule(wire="sparseloco", topk_per_chunk=8, error_decay=0.5)
    assert (sparse.inner_period(), sparse.outer_step(), sparse.decay()) == (10, (1.0, 0.0), 0.5)
    assert sparse.make_wire() == SparseLoCoWire(8)
    assert HybridRule(wire="sparseloco", outer_momentum=0.0, period=7, fragments=7, overlap_steps=0).inner_period() == 7


def _self_layout(table: list[int], rank: int):
    """A layout on this one process whose piece teams are each this rank alone (``COMM_SELF``)."""
    from mpi4py import MPI

    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.hybrid.layout import Layout

    me = Transport(MPI.COMM_SELF)
    layout = Layout(table, rank, me, me)
    layout.cross = {k: me for k in layout.mine}
    return layout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("table, rank", [([0], 0), ([0, 0, 1], 2)])
def test_a_sparse_piece_on_a_team_of_one_is_single_rank_sparseloco_on_its_real_entries(table, rank):
    """One rank per piece-team: each piece's exchange is single-rank SparseLoCo over the piece's real
    entries as one section (its accumulator decaying by β across exchanges), and the padding stays
    zero. ``[0, 0, 1]``, rank 2: a replica of one carrying both pieces, Δ padded to 4 · 1026."""
    from mpi4py import MPI

    from lightning_mpi.comm.sparseloco import (
        CHUNK,
        SparseLayout,
        SparseLoCoWire,
        SparseLoCoWorkspace,
        sparseloco_mean_steps,
    )
    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.hybrid.pieces import ReplicaFragment

    torch.manual_seed(0)
    params = [torch.randn(4096), torch.randn(5)]  # 4101: a full chunk and a tail (one piece), or padding
    layout = _self_layout(table, rank)
    wire, beta = SparseLoCoWire(16), 0.75
    fragment = ReplicaFragment(params, layout, wire, beta)
    pieces, length = layout.pieces, fragment.rows.shape[1]
    assert sorted(fragment.pieces) == list(range(pieces)) and fragment.exchanges
    reals = [max(0, min(length, 4101 - k * length)) for k in range(pieces)]
    assert [fragment.pieces[k].real for k in range(pieces)] == reals
    assert all(p.owner_residual is None and p.bytes_per_exchange == 0 for p in fragment.pieces.values())
    accumulators = [torch.zeros(real) for real in reals]
    self_t = Transport(MPI.COMM_SELF)
    for _ in range(3):
        delta = torch.zeros_like(fragment.delta)
        delta[:4101] = torch.randn(4101)
        fragment.delta.copy_(delta)
        for _ in fragment.mean_steps():
            pass
        for k, real in enumerate(reals):
            mine = delta.view(pieces, -1)[k][:real].clone()
            before = accumulators[k].clone()
            work = SparseLoCoWorkspace(SparseLayout(wire, [(0, real)], torch.device("cpu")), 1, torch.device("cpu"))
            for _ in sparseloco_mean_steps(self_t, mine, work, accumulators[k], beta):
                pass
            row, piece = fragment.rows[k], fragment.pieces[k]
            assert torch.equal(row[:real], mine) and torch.equal(piece.residual[:real], accumulators[k]), k
            assert not row[real:].any() and not piece.residual[real:].any(), k  # padding stays zero
            # the math itself: k largest of e = β·e + Δ per chunk of 4096 (fewer in a shorter one), and
            # what was not sent stays in e
            folded = beta * before + delta.view(pieces, -1)[k][:real]
            torch.testing.assert_close(piece.residual[:real] + row[:real], folded)
            for start in range(0, real, CHUNK):
                chunk, sent = folded[start : start + CHUNK], row[start : start + CHUNK]
                count = wire.chunk_counts(real)[start // CHUNK][1]
                assert int((sent != 0).sum()) == count
                assert set(torch.topk(chunk.abs(), count).indices.tolist()) == set(sent.nonzero().view(-1).tolist())


@pytest.mark.timeout(60)
def test_a_sparse_hybrid_run_on_one_rank_resumes_its_accumulators_from_a_checkpoint():
    """``wire="sparseloco"`` bound on one rank: the wire runs (its accumulators fill), the outer step
    is plain SGD, and a checkpoint carries the accumulators: a resumed run ends as the uninterrupted one."""
    rule = HybridRule(wire="sparseloco", topk_per_chunk=2, period=4, fragments=2, overlap_steps=1)

    def run(cut: int | None) -> tuple[list[torch.Tensor], bool]:
        torch.manual_seed(5)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        params = list(net.parameters())
        bound = _bind(rule, params)
        opt = torch.optim.SGD(params, lr=0.1)
        bound.on_train_start()
        filled = False
        for step in range(11):
            if step == cut:
                bound = _rebound(bound, rule, params, bound.state_dict())
            _step(bound, net, opt)
            filled = filled or any(p.residual.any() for f in bound.fragments for p in f.pieces.values())
        assert bound.outer_steps > 0 and bound.stats()["bytes_per_exchange"] == 0.0
        assert all(group["momentum"] == 0.0 and group["lr"] == 1.0 for group in bound.outer.param_groups)
        bound.on_train_end()
        bound.close()
        return [p.detach().clone() for p in params], filled

    whole, filled = run(None)
    assert filled
    resumed, _ = run(7)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
