"""Compressed synchronous strategies (mpi_asa_int8, mpi_topk, mpi_onebit) on 2 ranks."""
import json

import pytest
import pytorch_lightning as pl

import lightning_mpi  # noqa: F401  (registers the names)
from lightning_mpi import CompressedSyncStrategy
from lightning_mpi.rules.compressed import CompressedSyncRule
from tests.mpi_utils import REPO, run_mpi
from tests.quiet_trainer import QUIET

EXCHANGE = str(REPO / "tests" / "scripts" / "compressed_exchange.py")
TRAIN = str(REPO / "tests" / "scripts" / "compressed_train.py")
NAMES = {"mpi_asa_int8": "int8", "mpi_topk": "topk", "mpi_onebit": "onebit"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [0, -0.5, 1.01, float("nan"), "1%"])
def test_bad_ratio_raises_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=r"ratio="):
        CompressedSyncStrategy(wire="topk", ratio=bad)
    with pytest.raises(ValueError, match=r"ratio="):
        CompressedSyncRule(wire="topk", ratio=bad)


@pytest.mark.timeout(60)
def test_other_bad_arguments():
    with pytest.raises(ValueError, match="wire="):
        CompressedSyncRule(wire="int4")
    with pytest.raises(ValueError, match="momentum_correction="):
        CompressedSyncRule(wire="int8", momentum_correction=True)
    with pytest.raises(ValueError, match="momentum="):
        CompressedSyncRule(wire="topk", momentum=1.0)
    with pytest.raises(ValueError, match="ratio_warmup_steps="):
        CompressedSyncRule(wire="topk", ratio_warmup_steps=-1)


@pytest.mark.timeout(60)
def test_ratio_warmup_is_geometric_from_one():
    rule = CompressedSyncRule(wire="topk", ratio=0.01, ratio_warmup_steps=4)
    ratios = [rule.ratio_at(s) for s in range(6)]
    assert ratios[0] == 1.0 and ratios[4] == ratios[5] == 0.01
    assert all(a > b for a, b in zip(ratios[:4], ratios[1:5]))
    assert abs(ratios[2] - 0.1) < 1e-12


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(NAMES))
def test_names_are_registered(name):
    trainer = pl.Trainer(strategy=name, **QUIET)
    assert isinstance(trainer.strategy, CompressedSyncStrategy)
    assert trainer.strategy.rule.wire == NAMES[name]
    assert trainer.strategy.rule.error_feedback


@pytest.fixture(scope="module")
def exchange(tmp_path_factory):
    out = tmp_path_factory.mktemp("cx") / "out.json"
    run_mpi(2, [EXCHANGE, str(out)], timeout=240)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("ct")
    out = scratch / "out.json"
    run_mpi(2, [TRAIN, str(scratch), str(out)], timeout=280)
    return json.loads(out.read_text())


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["topk_ratio1", "int8_exact"])
def test_lossless_cases_match_fp32_asa_bitwise(exchange, case):
    assert exchange[case]["equal"], f"{case} differs from mpi_asa"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_topk_momentum_correction_with_a_momentum_optimizer_applies_momentum_once(exchange):
    # ratio 1, no masking: DGC's local velocity + the compensation = fp32 ASA with SGD(momentum=0.9)
    r = exchange["topk_momentum_ratio1"]
    assert r["momentum"] == 0.9 and r["compensated_steps"] == 6
    assert r["max_abs_diff"] < 1e-5


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", ["int8", "topk", "onebit", "topk_delta16"])
def test_error_feedback_conserves_mass_over_many_steps(exchange, wire):
    # sum of applied updates + pending residuals == mean of all gradients, to the last bit
    # (delta16: the bfloat16 rounding in the residuals adds low bits that fp32 sums may round)
    r = exchange[f"mass_{wire}"]
    assert r["max_abs_diff"] <= (1e-5 if wire == "topk_delta16" else 0.0)
    assert r["wire_bytes"] < r["dense_bytes"]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_state_dict_restores_momentum_correction_beside_a_momentum_optimizer(exchange):
    r = exchange["checkpoint"]["topk_momentum"]
    assert r["next_step_equal"] and r["previous_nonzero"] and r["momentum"] == 0.8


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", ["int8", "topk", "onebit"])
def test_state_dict_restores_residuals(exchange, wire):
    r = exchange["checkpoint"][wire]
    assert r["residuals_nonzero"] and r["residuals_equal"]
    assert r["next_step_equal"] and r["fresh_differs"]
    assert r["step"] == 5  # warm-up clock resumed (4 steps + the one after restore)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["mpi_asa_int8", "mpi_topk", "mpi_topk_mc", "mpi_onebit"])
def test_trainer_fit_and_checkpoint_resume(trained, name):
    r = trained[name]
    assert r["ranks_equal"], "ranks ended with different weights"
    assert r["last_loss"] < r["first_loss"]
    assert r["residuals_nonzero"] and r["restored_equal"], "checkpoint did not restore the residuals"
    assert r["restored_step"] == r["steps"] == 12 and r["resumed_steps"] == 16
    assert r["compression"] > (3.5 if name == "mpi_asa_int8" else 4)
