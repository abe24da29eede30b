"""Synchronous strategies through a real Trainer on 1, 2 and 3 ranks, against one process.

W ranks with batch B must train the same weights as one process with batch W·B under plain SGD,
even though every rank starts from a different random initialisation.
"""
import json
import subprocess
import sys

import pytest

import lightning_mpi
from lightning_mpi.rules.sync import SyncRule
from tests.mpi_utils import REPO, mpi_env, run_mpi

EQUIVALENCE = str(REPO / "tests" / "scripts" / "sync_equivalence.py")
FEATURES = str(REPO / "tests" / "scripts" / "sync_features.py")
TOLERANCE = {"mpi_allreduce": 1e-5, "mpi_asa": 1e-5, "mpi_asa16": 5e-3, "mpi_asa_bf16": 5e-3}


def _run(world: int, script: str, out, timeout: float = 240) -> object:
    if world == 1:  # plain `python train.py`: an MPI singleton, no mpiexec
        subprocess.run([sys.executable, script, str(out)], env=mpi_env(), check=True, timeout=timeout, capture_output=True)
    else:
        run_mpi(world, [script, str(out)], timeout=timeout)
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def equivalence(request, tmp_path_factory):
    world = request.param
    return world, _run(world, EQUIVALENCE, tmp_path_factory.mktemp(f"eq{world}") / "out.json")


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TOLERANCE))
def test_ranks_match_one_process_with_world_batch(equivalence, name):
    world, results = equivalence
    r = results[name]
    assert r["world_size"] == world
    assert r["diff"] <= TOLERANCE[name], f"{name} at W={world}: max |Δw| = {r['diff']}"
    assert r["mismatches"] == 0, "ranks held different weights after some step"
    assert r["global_step"] == 6


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["weights", "weights+momentum"])
def test_weight_averaging_matches_one_process(equivalence, mode):
    # Plain SGD (and SGD with momentum whose buffers are averaged too) is linear in the
    # gradient: averaging weights after local steps equals averaging gradients.
    world, results = equivalence
    assert results[mode]["diff"] <= 1e-5
    assert results[mode]["mismatches"] == 0
    assert results[mode]["exchanges"] == 0  # no gradient exchange in weight-averaging mode


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_gradient_accumulation_exchanges_only_on_updating_steps(equivalence):
    world, results = equivalence
    r = results["accumulate2"]
    assert r["diff"] <= 1e-5
    assert r["global_step"] == 6
    assert r["exchanges"] == (6 if world > 1 else 0)  # 12 micro-batches, 6 exchanges


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_each_rank_trains_on_its_own_shard(equivalence):
    world, results = equivalence
    assert results["mpi_asa"]["sampler_len"] == 4 * 6  # B·STEPS samples per rank, W·B·STEPS in all


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_logging_metrics_collectives_and_overflow_skip(world, tmp_path):
    per_rank = _run(world, FEATURES, tmp_path / "out.json")
    assert len(per_rank) == world
    for r in per_rank:
        assert r["rank_mean"] == pytest.approx((world - 1) / 2)  # sync_dist mean over ranks
        assert r["rank_sum"] == pytest.approx(sum(range(world)))
        # rank k is right on k+1 of 4 samples: global accuracy, not rank 0's 0.25
        assert r["acc"] == pytest.approx(sum(k + 1 for k in range(world)) / (4 * world))
        assert r["gathered"] == [float(k) for k in range(world)]
        assert r["broadcast"] == {"from": world - 1}
        assert r["reduce_max"] == world - 1
        assert r["decision_any"] is True and r["decision_all"] is False
        # the last rank's inf loss reaches everybody through the exchange: all skip that step
        assert r["skipped"] == 1
        assert r["weights_finite"] is True
    assert per_rank[0]["skip_warnings"] == 1
    for r in per_rank:  # one rank's inf reaches every rank's .grad (what a GradScaler inspects)
        assert r["inf_on_rank0"]["accepted"] is False
        assert r["inf_on_rank0"]["grad_finite"] is False
        assert r["inf_on_rank0"]["grad0"] == pytest.approx((world + 1) / 2)
    # rank 0 warns once where it waits longer for the exchange than W - 1 steps' compute; no other rank warns
    assert per_rank[0]["slow_exchange"] == {"asa16, others late": 1, "asa16, rank 0 late": 0,
                                            "powersgd, others late": 1}
    assert all(sum(r["slow_exchange"].values()) == 0 for r in per_rank[1:])


def test_registered_names_map_to_sync_strategy():
    from pytorch_lightning.strategies import StrategyRegistry

    for name in ("mpi_allreduce", "mpi_asa", "mpi_asa16", "mpi_asa_bf16"):
        assert name in StrategyRegistry
        assert StrategyRegistry[name]["strategy"] is lightning_mpi.SyncStrategy
    assert StrategyRegistry["mpi_asa16"]["init_params"] == {"exchange": "asa", "wire": "fp16"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"exchange": "ring"}, r"exchange='ring' is not allowed: choose one of \['allreduce', 'asa'\]"),
        ({"wire": "fp8"}, r"wire='fp8' is not allowed"),
        ({"average": "params"}, r"average='params' is not allowed"),
        ({"bucket_mb": 0}, r"bucket_mb=0 is out of range: it must be in \(0, inf\)"),
        ({"bucket_mb": -1.5}, r"bucket_mb=-1.5 is out of range"),
        ({"first_bucket_mb": 0}, r"first_bucket_mb=0 is out of range: it must be in \(0, inf\)"),
        ({"exchange": "allreduce", "wire": "fp16"}, r"wire='fp16' needs exchange='asa'"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncRule(**kwargs)
    with pytest.raises(ValueError, match=match):
        lightning_mpi.SyncStrategy(**kwargs)  # validated before MPI is touched


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_overlap_launches_buckets_from_gradient_hooks(equivalence):
    world, results = equivalence
    if world == 1:
        assert results["mpi_asa"]["hook_launches"] == 0  # nothing to exchange
        return
    assert results["mpi_asa"]["hook_launches"] == 6  # one bucket per step, launched in backward
    assert results["no_overlap"]["hook_launches"] == 0
    assert results["no_overlap"]["diff"] <= 1e-5
    piped = results["asa16_pipelined"]
    assert piped["buckets"] >= 2 and piped["hook_launches"] == 6 * piped["buckets"]
    assert piped["diff"] <= 5e-3 and piped["mismatches"] == 0


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,tol", [("topology_asa16", 5e-3), ("topology_allreduce", 1e-5)])
def test_topology_aware_exchange_matches_one_process(equivalence, case, tol):
    # LIGHTNING_MPI_RANKS_PER_NODE=2 makes pretend nodes {0,1},{2}: in-node reduce, leaders exchange, in-node bcast.
    world, results = equivalence
    assert results[case]["diff"] <= tol
    assert results[case]["mismatches"] == 0
