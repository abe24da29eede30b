"""ZeRO on ASA: the partition math, the shard format and the optimizer rebuild in one process; the
equivalence with plain ASA + the full optimizer under mpiexec at W = 2 and 3 (one launch each)."""
import json
import random

import pytest
import torch

from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.rules.zero import ZeroRule
from lightning_mpi.rules.zero.layout import ParamSpec, plan_buckets, rank_pieces, shard_numel
from lightning_mpi.rules.zero.optimizer import ShardedOptimizer, check_elementwise
from lightning_mpi.rules.zero.state import (
    SHARD_FORMAT,
    consolidate,
    gather_range,
    index_sources,
    slice_param_state,
    state_numel,
)
from tests.mpi_utils import REPO, run_mpi

CPU = torch.device("cpu")


def specs_of(numels, dtype=torch.float32):
    return [ParamSpec(n, dtype, CPU) for n in numels]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_bytes", [None, 40, 400])
def test_pieces_cover_every_element_once(world, bucket_bytes):
    rng = random.Random(world * 1000 + (bucket_bytes or 0))
    numels = [rng.choice([0, 1, 2, 5, 13, 31, 64]) for _ in range(12)]
    specs = specs_of(numels)
    plans = plan_buckets(specs, world, bucket_bytes)
    owned = [[0] * n for n in numels]
    for rank in range(world):
        pieces = rank_pieces(plans, rank)
        for piece in pieces:
            for e in range(piece.start, piece.start + piece.length):
                owned[piece.param][e] += 1
            plan = plans[piece.bucket]
            # the piece sits where the bucket's layout puts it, inside this rank's chunk
            seg = next(s for s in plan.segments if s.param == piece.param and s.start <= piece.start < s.start + s.length)
            assert seg.offset + piece.start - seg.start == rank * plan.chunk + piece.offset
            assert piece.offset + piece.length <= plan.chunk and piece.start + piece.length <= seg.start + seg.length
    assert all(count == 1 for counts in owned for count in counts)
    for plan in plans:
        assert plan.padded % world == 0 and plan.padded - plan.numel < world
        if bucket_bytes is not None and plan is not plans[-1]:
            assert plan.numel * 4 == bucket_bytes  # every bucket but the last holds exactly bucket_bytes
    # each rank owns 1/W of the elements, up to the padding (< W per bucket)
    assert shard_numel(plans) * world - sum(numels) < world * max(1, len(plans))


def test_buckets_follow_make_buckets_rule():
    # reverse registration order; a bucket closes once it holds bucket_bytes (here 2 tensors of 4 floats)
    specs = specs_of([4, 4, 4, 4, 4]) + [ParamSpec(3, torch.float64, CPU)]
    plans = plan_buckets(specs, 2, 32)
    assert [p.members for p in plans] == [(5,), (4, 3), (2, 1), (0,)]
    assert [p.dtype for p in plans] == [torch.float64] + [torch.float32] * 3
    assert plans[3].chunk == 2 and plans[0].chunk == 2 and plans[0].padded == 4
    # the same grouping as the synchronous rules' buckets
    tensors = [torch.zeros(s.numel, dtype=s.dtype) for s in specs]
    theirs = make_buckets(tensors, 2, 32)
    assert [[next(i for i, t in enumerate(tensors) if t is m) for m in b.tensors] for b in theirs] == [list(p.members) for p in plans]


def test_a_large_parameter_is_cut_across_buckets_unless_not_contiguous():
    specs = specs_of([3, 20, 2])
    plans = plan_buckets(specs, 2, 32)  # 8 floats per bucket
    assert [[(s.param, s.start, s.length) for s in p.segments] for p in plans] == [
        [(2, 0, 2), (1, 0, 6)], [(1, 6, 8)], [(1, 14, 6), (0, 0, 2)], [(0, 2, 1)]]
    strided = [specs[0], ParamSpec(20, torch.float32, CPU, contiguous=False), specs[2]]
    plans = plan_buckets(strided, 2, 32)
    assert [[(s.param, s.start, s.length) for s in p.segments] for p in plans] == [[(2, 0, 2), (1, 0, 20)], [(0, 0, 3)]]


def full_adam_state(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(s, generator=g), "exp_avg_sq": torch.rand(s, generator=g)}
            for i, s in enumerate(shapes)}


def cut(full, shapes, world, bucket_bytes):
    """The shard states a run at ``world`` ranks would save, from a full state."""
    specs = specs_of([torch.Size(s).numel() for s in shapes])
    plans = plan_buckets(specs, world, bucket_bytes)
    groups = [{"lr": 0.1, "params": list(range(len(shapes)))}]
    shards = []
    for rank in range(world):
        pieces = rank_pieces(plans, rank)
        shards.append({
            "format": SHARD_FORMAT, "world_size": world, "rank": rank, "param_groups": groups,
            "param_shapes": [list(s) for s in shapes],
            "pieces": [[p.param, p.start, p.length] for p in pieces],
            "state": [slice_param_state(full[p.param], p.start, p.length) for p in pieces],
        })
    return shards


def test_consolidate_and_reshard_are_exact():
    shapes = [(3, 5), (7,), (), (2, 2, 3)]
    full = full_adam_state(shapes)
    three = cut(full, shapes, 3, 24)
    whole = consolidate(three)
    for i, state in full.items():
        for key, value in state.items():
            assert torch.equal(whole["state"][i][key], value), (i, key)
    assert whole["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2, 3]}]
    # the W = 2 layout's pieces, cut from the W = 3 shards, are the W = 2 slices of the full state
    sources = index_sources(three)
    for shard in cut(full, shapes, 2, 40):
        for (index, start, length), state in zip(shard["pieces"], shard["state"]):
            got = gather_range(sources[index], start, length)
            assert torch.equal(got["exp_avg"], state["exp_avg"]) and torch.equal(got["step"], state["step"])
    assert sum(state_numel(s) for s in three) == 2 * sum(torch.Size(s).numel() for s in shapes)


def test_consolidate_names_a_missing_shard():
    shapes = [(10,)]
    shards = cut(full_adam_state(shapes), shapes, 3, None)
    with pytest.raises(ValueError, match="ranks 0..2"):
        consolidate(shards[:2])
    broken = [dict(s) for s in shards]
    broken[1] = dict(broken[1], pieces=[], state=[])
    with pytest.raises(ValueError, match="covers elements only up to"):
        consolidate(broken)


class OwnStep(torch.optim.Adam):
    def step(self, closure=None):  # an override is not trusted to stay element-wise
        return super().step(closure)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.LBFGS(p),
    lambda p: torch.optim.Adafactor(p),
    lambda p: torch.optim.Muon([q for q in p if q.dim() == 2]),
    lambda p: OwnStep(p),
])
def test_whole_tensor_optimizers_are_refused_by_name(make):
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = make(params)
    with pytest.raises(ValueError, match=type(optimizer).__name__):
        check_elementwise(optimizer)


def test_rebuild_in_place_keeps_object_groups_and_sliced_state():
    a, b, frozen = (torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(2, 2)),
                    torch.nn.Parameter(torch.randn(3), requires_grad=False))
    optimizer = torch.optim.Adagrad([{"params": [a, frozen], "lr": 0.5}, {"params": [b], "weight_decay": 0.1}],
                                    lr=0.1, initial_accumulator_value=0.25)
    groups, state = optimizer.param_groups, optimizer.state
    params = [a, b]
    specs = [ParamSpec.of(p) for p in params]
    plans = plan_buckets(specs, 2, None)
    pieces = rank_pieces(plans, 1)
    tensors = [params[p.param].detach().view(-1)[p.start : p.start + p.length] for p in pieces]
    sharded = ShardedOptimizer(optimizer, params, pieces, tensors, 2, 1)
    assert optimizer.param_groups is groups and optimizer.state is state
    assert [g["lr"] for g in groups] == [0.5, 0.1] and groups[1]["weight_decay"] == 0.1
    assert sum(t.numel() for g in groups for t in g["params"]) == 5  # rank 1's half of 10 elements
    for tensor in sharded.tensors:
        assert torch.equal(state[tensor]["sum"], torch.full((tensor.numel(),), 0.25))
    shard = sharded.shard_state()
    assert shard["param_groups"][0]["params"] == [0, 1] and shard["param_groups"][1]["params"] == [2]


def test_rule_arguments_are_checked():
    with pytest.raises(ValueError, match="wire='int8'"):
        ZeroRule(wire="int8")
    with pytest.raises(ValueError, match="bucket_mb=0"):
        ZeroRule(bucket_mb=0)
    with pytest.raises(ValueError, match="inflight_buckets=0"):
        ZeroRule(inflight_buckets=0)


@pytest.mark.parametrize("world", [2, 3])
def test_zero_equals_asa_with_the_full_optimizer(world, tmp_path):
    out = tmp_path / "zero.json"
    run_mpi(world, [str(REPO / "tests" / "scripts" / "zero_equivalence.py"), str(out)], timeout=240)
    results = json.loads(out.read_text())
    errors = results.pop("errors")
    special = results.pop("special")
    # bf16 weights: fp32 masters in every bucket, and as close to fp32 training as plain bf16 data
    # parallelism gets (6 steps are too few for the masters to pull ahead; measured 0.020 vs 0.021
    # at W = 2, 0.0058 vs 0.0039 at W = 3)
    bf16 = special["bf16_weights"]
    assert bf16["replicas_equal"] and bf16["masters"] == ["torch.float32"] * bf16["buckets"], bf16
    assert bf16["diff"] <= 2 * bf16["plain_bf16_diff"] + 1e-3, bf16
    assert "LBFGS" in errors["lbfgs"] and "trainable parameters" in errors["missing"]
    for name, r in results.items():
        assert r["replicas_equal"], name
        tolerance = 1e-3 if name.startswith("bf16") else 1e-6  # bf16 against ASA-bf16: different roundings
        assert r["diff"] <= tolerance and r["state_diff"] <= tolerance, (name, r)
        # each rank holds 1/W of the optimizer state, up to one shard's padding per bucket
        assert sum(r["held"]) == r["full"], (name, r)
        slack = r["per_key"] * r["buckets"] * (world - 1)
        assert all(abs(h - r["full"] / world) <= slack for h in r["held"]), (name, r)
    assert results["nonfinite"]["skipped"] == [1, 1] and results["nonfinite"]["nan_filled"] == [True]
    assert results["sgd_momentum"]["diff"] == 0.0 and results["adam"]["diff"] == 0.0  # bitwise: same sums, same order
    assert results["no_overlap"]["hook_launches"] == 0 and results["adam"]["hook_launches"] > 0


def _simulated_ranks(world: int, bucket_bytes: int | None, steps: int, lr_at=lambda step: 0.01):
    """ZeRO with the buddy mirror in one process, no MPI: ``world`` ranks, each with its own copy of
    two parameters, its sharded Adam and its mirror of rank (r + 1) % W's shard; every step each
    gets the same averaged gradient, steps its pieces and its mirror (with the owner's lr, a
    scheduler's), and the pieces are shared as the Allgather would. Returns (ranks, the unsharded
    Adam run alongside)."""
    from types import SimpleNamespace

    from lightning_mpi.rules.zero.layout import bucket_pieces
    from lightning_mpi.rules.zero.mirror import MirrorShard

    g = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (7,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    plans = plan_buckets([ParamSpec.of(t) for t in start], world, bucket_bytes)
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    ref_opt = torch.optim.Adam(reference, lr=0.01, weight_decay=0.1)
    ranks = []
    for rank in range(world):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.Adam(params, lr=0.01, weight_decay=0.1)
        pieces = rank_pieces(plans, rank)
        tensors = [params[p.param].detach().view(-1)[p.start : p.start + p.length] for p in pieces]
        sharded = ShardedOptimizer(opt, params, pieces, tensors, world, rank)
        buckets = [SimpleNamespace(plan=plan, master=None) for plan in plans]
        mirror = MirrorShard(sharded, buckets, params, [False] * len(tensors), rank, world)
        mirror.stale = False  # all start from no state: nothing to send
        ranks.append(SimpleNamespace(params=params, opt=opt, pieces=pieces, sharded=sharded, mirror=mirror))
    for step in range(steps):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, grad in zip(reference, grads, strict=True):
            p.grad = grad.clone()
        ref_opt.param_groups[0]["lr"] = lr_at(step)
        ref_opt.step()
        for r in ranks:
            r.opt.param_groups[0]["lr"] = lr_at(step)
            for (index, s, n), tensor in zip(r.sharded.slots, r.sharded.tensors, strict=True):
                tensor.grad = grads[index].reshape(-1)[s : s + n].clone()
            for plan, buffer in zip(plans, r.mirror.grads, strict=True):
                for piece in bucket_pieces(plan, r.mirror.buddy):
                    buffer[piece.offset : piece.offset + piece.length] = grads[piece.param].reshape(-1)[
                        piece.start : piece.start + piece.length
                    ]
            r.opt.step()
            r.mirror.step()
        with torch.no_grad():  # the Allgather: every rank's pieces to every rank
            for owner in ranks:
                for piece in owner.pieces:
                    values = owner.params[piece.param].reshape(-1)[piece.start : piece.start + piece.length]
                    for r in ranks:
                        r.params[piece.param].view(-1)[piece.start : piece.start + piece.length] = values
    return ranks, reference, ref_opt


@pytest.mark.parametrize("world, bucket_bytes", [(3, None), (4, 24)])
def test_the_mirror_equals_its_buddys_shard_and_rebuilds_the_whole_state(world, bucket_bytes):
    from lightning_mpi.rules.zero.mirror import rebuild_shards, write_weights

    ranks, reference, ref_opt = _simulated_ranks(world, bucket_bytes, 4, lr_at=lambda step: 0.01 / (step + 1))
    for r in ranks:  # bit for bit the buddy's state and weights
        own = ranks[r.mirror.buddy].mirror.sharded_state()
        mirror = r.mirror.state()
        assert mirror["rank"] == own["rank"]
        assert sorted(map(tuple, mirror["pieces"])) == sorted(map(tuple, own["pieces"]))
        by_piece = {tuple(p): s for p, s in zip(own["pieces"], own["state"], strict=True)}
        for piece, state in zip(mirror["pieces"], mirror["state"], strict=True):
            assert state.keys() == by_piece[tuple(piece)].keys()
            for key, value in state.items():
                assert torch.equal(value, by_piece[tuple(piece)][key]), key
    # rank 1 lost: its shard from rank 0's mirror; the rebuilt state is the unsharded Adam's
    kept = [{"steps": 4, "own": r.mirror.sharded_state(), "mirror": r.mirror.state()} for r in ranks]
    del kept[1]
    shards, steps = rebuild_shards(kept[::-1])
    assert steps == 4 and [s["rank"] for s in shards] == list(range(world))
    whole = consolidate(shards)
    for i, p in enumerate(reference):
        for key, value in ref_opt.state[p].items():
            assert torch.allclose(whole["state"][i][key], value.reshape(whole["state"][i][key].shape), atol=1e-6), key
    fresh = [torch.nn.Parameter(torch.zeros_like(p)) for p in reference]
    write_weights(shards, fresh)
    for p, q in zip(fresh, ranks[0].params, strict=True):
        assert torch.equal(p, q)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(fresh, reference, strict=True))


def test_a_shard_lost_with_its_mirror_or_survivors_apart_stop_the_heal():
    from lightning_mpi.comm.errors import RankFailedError
    from lightning_mpi.rules.zero.mirror import rebuild_shards

    ranks, _, _ = _simulated_ranks(4, None, 1)
    kept = [{"steps": 1, "own": r.mirror.sharded_state(), "mirror": r.mirror.state()} for r in ranks]
    # ranks 1 and 2 lost: rank 1 mirrors rank 2, so rank 2's shard is gone (rank 1's is on rank 0)
    with pytest.raises(RankFailedError, match=r"rank\(s\) 2 \(mirrored by rank 1\) of 4 were lost together"):
        rebuild_shards([kept[0], kept[3]])
    with pytest.raises(RankFailedError, match=r"different optimizer steps \(\[1, 2\]\)"):
        rebuild_shards([kept[0], {**kept[2], "steps": 2}, kept[3]])
    assert [s["rank"] for s in rebuild_shards([kept[1], kept[3]])[0]] == [0, 1, 2, 3]  # 0 and 2 lost: mirrored


def test_heal_with_a_grad_scaler_is_refused_by_name():
    from types import SimpleNamespace

    from lightning_mpi.strategies.optimizer_sharding import OptimizerSharding

    sharding = OptimizerSharding(mirror=True)
    sharding.shards = object()  # as if a rule that shards the optimizer were attached
    sharding.check_precision(SimpleNamespace(scaler=None))  # bf16-mixed, 32-true: fine
    with pytest.raises(ValueError, match="cannot use a GradScaler \\(precision='16-mixed'\\).*bf16-mixed"):
        sharding.check_precision(SimpleNamespace(scaler=object()))
    OptimizerSharding(mirror=False).check_precision(SimpleNamespace(scaler=object()))  # heal=None: unchanged


def test_the_mirror_is_cut_from_a_whole_save_and_waits_for_its_buddy_after_its_own_shard():
    ranks, _, _ = _simulated_ranks(3, 24, 2)
    mirror = ranks[0].mirror
    expected = mirror.state()
    shards = [r.mirror.sharded_state() for r in ranks]

    def same(got):
        assert got["pieces"] == expected["pieces"]
        for a, b in zip(got["state"], expected["state"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for saved in (shards, consolidate(shards)):  # all shards of a save; torch's full format
        mirror.optimizer.state.clear()
        mirror.load(saved)
        assert not mirror.stale
        same(mirror.state())
    mirror.load(shards[0])  # this rank's own shard only: the buddy's comes with the next exchange
    assert mirror.stale
