"""The PowerSGD strategy: bad arguments, the registered name, and training on 2 and 3 ranks (the
rule's math: tests/rules/test_powersgd.py)."""
from __future__ import annotations

import json

import pytest

from lightning_mpi.rules.powersgd import (
    PowerSGDRule,
)
from tests.mpi_utils import REPO, run_mpi

SCRIPT = REPO / "tests" / "scripts" / "powersgd_train.py"


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, r"rank=0 is out of range: it must be an integer >= 1"),
    ({"rank": 1.5}, r"rank=1.5 is out of range"),
    ({"rank": True}, r"rank=True is out of range"),
    ({"start_step": -1}, r"start_step=-1 is out of range: it must be an integer >= 0"),
    ({"min_compression_rate": -0.5}, r"min_compression_rate=-0.5 is out of range"),
    ({"seed": -3}, r"seed=-3 is out of range"),
    ({"bucket_mb": 0}, r"bucket_mb=0 is out of range"),
    ({"first_bucket_mb": -1.0}, r"first_bucket_mb=-1.0 is out of range"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, message):
    import lightning_mpi
    import lightning_mpi.fabric

    with pytest.raises(ValueError, match=message):
        PowerSGDRule(**kwargs)
    with pytest.raises(ValueError, match=message):
        lightning_mpi.PowerSGDStrategy(**kwargs)
    with pytest.raises(ValueError, match=message):
        lightning_mpi.fabric.PowerSGDStrategy(**kwargs)


def test_the_name_is_registered_with_every_frontend():
    import lightning as L
    from pytorch_lightning.strategies import StrategyRegistry

    import lightning_mpi
    import lightning_mpi.fabric
    import lightning_mpi.lightning

    assert StrategyRegistry["mpi_powersgd"]["strategy"] is lightning_mpi.PowerSGDStrategy
    assert L.pytorch.strategies.StrategyRegistry["mpi_powersgd"]["strategy"] is lightning_mpi.lightning.PowerSGDStrategy
    assert "PowerSGDStrategy" in lightning_mpi.__all__ and "PowerSGDRule" in lightning_mpi.__all__
    strategy = lightning_mpi.PowerSGDStrategy(rank=4, start_step=10, warm_start=False)
    assert isinstance(strategy.rule, PowerSGDRule)
    assert (strategy.rule.rank, strategy.rule.start_step, strategy.rule.warm_start) == (4, 10, False)


# -- W ranks through the Trainer and Fabric ----------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"W{w}")
def trained(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"powersgd{world}") / "out.json"
    # Resume once (W = 2): it trains 6 fits, the costliest part.
    run_mpi(world, [str(SCRIPT), str(out)] + (["resume"] if world == 2 else []), timeout=400, cwd=out.parent)
    return world, json.loads(out.read_text())


@pytest.mark.mpi
@pytest.mark.timeout(450)
def test_full_rank_powersgd_equals_one_process_with_the_world_batch(trained):
    world, results = trained
    r = results["full_rank"]
    assert r["compressed"] == 2 and r["plain"] == 2  # both weights compressed, both biases not
    assert r["diff"] <= 1e-5, f"W={world}: max |Δw| = {r['diff']}"
    assert r["mismatches"] == 0 and r["global_step"] == 6
    fabric = results["fabric"]["full_rank_accumulate2"]
    assert fabric["diff"] <= 1e-5 and fabric["mismatches"] == 0
    assert fabric["exchanges"] == 6 and fabric["hook_launches"] == 6  # no exchange while accumulating
    replayed = results["fabric"]["full_rank_replayed"]
    assert replayed["diff"] <= 1e-5 and replayed["mismatches"] == 0
    assert replayed["hook_launches"] == 6  # left after each first micro-batch, redone in before_step


@pytest.mark.mpi
@pytest.mark.timeout(450)
def test_the_registered_name_compresses_from_hooks_on_identical_replicas(trained):
    world, results = trained
    r = results["default"]
    assert r["rule"] == "PowerSGDRule" and r["finite"]
    assert r["mismatches"] == 0 and r["global_step"] == 6 == r["steps"]
    assert r["hook_launches"] == 6 * r["buckets"]  # every bucket left during backward
    assert r["compression"] > 3  # rank 1 on a 16×10 and a 3×16 weight
    assert r["diff_from_plain"] > 1e-4  # it really is not plain averaging
    named = results["fabric"]["named"]
    assert named["class"] == "lightning_mpi.fabric.PowerSGDStrategy"
    assert named["mismatches"] == 0 and named["finite"] and named["exchanges"] == 6


@pytest.mark.mpi
@pytest.mark.timeout(450)
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(trained):
    world, results = trained
    r = results["nan"]
    assert r["skipped"] == [1] * world
    assert r["mismatches"] == 0 and r["finite"] and r["residuals_finite"]
    assert r["q_ready"]  # the warm Q went non-finite with the step, and was drawn afresh after it


@pytest.mark.mpi
@pytest.mark.timeout(450)
@pytest.mark.parametrize("label", ["rank2", "no_warm_start"])
def test_a_checkpoint_resumes_exactly(trained, label):
    world, results = trained
    if world != 2:
        pytest.skip("resume runs at W = 2")
    r = results["resume"][label]
    assert r["equal"] == [True, True] and r["identical"], r
    assert r["steps"] == 12 and r["saved_steps"] == 6
    assert r["saved_ranks"] == 2 and r["residual_norm"] > 0  # every rank's residuals are in the checkpoint
    assert r["saved_q"] == (1 if label == "rank2" else 0)  # warm Q's only with warm start
