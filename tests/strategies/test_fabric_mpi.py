"""Fabric and the unified package's Trainer on W = 2 and 3 ranks, compared with one process."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.mpi_utils import REPO, run_mpi

pytestmark = pytest.mark.mpi
SCRIPTS = REPO / "tests" / "scripts"
TOLERANCE = {"mpi_allreduce": 1e-5, "mpi_asa": 1e-5, "mpi_asa16": 5e-3, "mpi_asa_bf16": 5e-3}


def _fabric(world: int, parts: str, tmp_path, timeout: float = 240) -> dict:
    """Run ``fabric_train.py`` on ``world`` ranks: {part: its results} for each of the comma-separated parts."""
    out = tmp_path / "fabric.json"
    run_mpi(world, [str(SCRIPTS / "fabric_train.py"), str(out), parts], timeout=timeout, cwd=tmp_path)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fabric_w3(tmp_path_factory) -> dict:
    """Every name, and the collectives, in one 3-rank launch (a launch costs seconds of imports)."""
    return _fabric(3, "every_name,collectives", tmp_path_factory.mktemp("fabric_w3"), timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_fabric_ranks_match_one_process_with_world_batch(world, tmp_path):
    results = _fabric(world, "equivalence", tmp_path)["equivalence"]
    for name, result in results.items():
        tolerance = TOLERANCE[name.split("+")[0]]
        assert result["diff"] <= tolerance, f"{name} at W={world}: max |Δw| = {result['diff']}"
        assert result["mismatches"] == 0, f"{name}: ranks held different weights after some step"
        assert result["steps"] == 6
    assert {"mpi_allreduce+accumulate2", "mpi_asa16+accumulate2"} <= set(results)  # fabric.no_backward_sync


@pytest.mark.timeout(300)
def test_every_name_trains_under_fabric_and_ends_on_identical_weights(fabric_w3):
    import lightning_mpi

    results = fabric_w3["every_name"]
    assert set(results) == set(lightning_mpi.STRATEGIES)
    for name, result in results.items():
        assert result["identical"] and result["finite"], (name, result)
        assert result["steps"] == 16, (name, result)
        assert result["class"].startswith("lightning_mpi.fabric."), (name, result)


@pytest.mark.timeout(300)
def test_fabric_collectives_go_over_mpi(fabric_w3):
    results = fabric_w3["collectives"]
    assert results["mean"] == [1.0, 1.0]
    assert results["sum"] == 3.0
    assert results["gathered"] == [[0, 0], [1, 10], [2, 20]]
    assert results["broadcast"] == {"from": 2}
    assert results["any_rank_zero"] is True
    assert results["world_size"] == 3 and results["global_rank0"]


@pytest.mark.timeout(300)
def test_a_fabric_checkpoint_resumes_exactly(tmp_path):
    results = _fabric(2, "resume", tmp_path)["resume"]
    for name in ("mpi_allreduce", "mpi_asa_int8", "mpi_topk", "mpi_model_avg"):
        assert results[name]["equal"] and results[name]["diff"] == 0.0, (name, results[name])
    for name, result in results.items():
        assert result["rule_state_restored"], (name, result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_unified_trainer_ranks_match_one_process_with_world_batch(world, tmp_path):
    out = tmp_path / "out.json"
    run_mpi(world, [str(SCRIPTS / "sync_equivalence.py"), str(out)], timeout=240,
            env={"LIGHTNING_PACKAGE": "lightning.pytorch"})
    results = json.loads(out.read_text())
    assert results["strategy_class"] == "lightning_mpi.lightning.SyncStrategy on lightning.pytorch"
    for name, tolerance in TOLERANCE.items():
        assert results[name]["diff"] <= tolerance, (name, results[name])
        assert results[name]["mismatches"] == 0 and results[name]["global_step"] == 6
        assert results[name]["world_size"] == world
    assert results["weights"]["diff"] <= 1e-5
    assert results["accumulate2"]["diff"] <= 1e-5 and results["accumulate2"]["global_step"] == 6


@pytest.mark.timeout(400)
def test_lightning_lstm_demo_trains_under_every_name_on_its_own_shard(tmp_path):
    """Lightning's demo LightningLSTM has a custom batch sampler that Lightning's ddp cannot shard;
    every mpi_* name deals its batches to the ranks (W=3: 26 batches -> 8 per rank)."""
    import inspect
    import argparse
    import collections

    import lightning_mpi

    (tmp_path / "data").mkdir()
    # The demo's WikiText2 reads data/wikitext-2.txt (and would download it if absent): Python's own source.
    (tmp_path / "data" / "wikitext-2.txt").write_text(inspect.getsource(argparse) + inspect.getsource(collections))
    out = tmp_path / "out.json"
    run_mpi(3, [str(SCRIPTS / "demo_lstm.py"), str(out)], timeout=360, cwd=tmp_path,
            env={"LIGHTNING_PACKAGE": "lightning.pytorch", "DEMO_SMALL": "1", "DEMO_STEPS": "2"})
    report = json.loads(out.read_text())
    per_rank = report["batches_in_sampler"] // 3
    assert set(report["results"]) == set(lightning_mpi.STRATEGIES)
    for name, result in report["results"].items():
        seen = result["seen"]
        assert result["batches_per_rank"] == per_rank, (name, result)
        assert result["global_step"] == 2 and all(len(s) == 2 for s in seen), (name, result)
        firsts = [digest for rank in seen for digest in rank]
        assert len(set(firsts)) == len(firsts), f"{name}: ranks trained on the same batch: {seen}"
        assert result["identical"] and result["finite"], (name, result)
    shutil.rmtree(tmp_path / "data")
