"""DiLoCo and Streaming DiLoCo strategies: bad arguments, the registered names, and the strategies
through the Trainer and Fabric on 2 and 3 ranks (the rules' math: tests/rules/test_diloco.py)."""
from __future__ import annotations

import json

import pytest

from lightning_mpi.rules.diloco import (
    DiLoCoRule,
    StreamingDiLoCoRule,
)
from tests.mpi_utils import REPO, run_mpi

SCRIPTS = REPO / "tests" / "scripts"


# -- bad arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, kwargs, name", [
    (DiLoCoRule, {"period": 0}, "period"),
    (DiLoCoRule, {"period": 2.5}, "period"),
    (DiLoCoRule, {"outer_lr": 0.0}, "outer_lr"),
    (DiLoCoRule, {"outer_momentum": 1.0}, "outer_momentum"),
    (DiLoCoRule, {"wire": "fp16"}, "wire"),
    (StreamingDiLoCoRule, {"fragments": 0}, "fragments"),
    (StreamingDiLoCoRule, {"period": 4, "fragments": 5}, "fragments"),
    (StreamingDiLoCoRule, {"period": 8, "fragments": 4, "overlap_steps": 2}, "overlap_steps"),
    (StreamingDiLoCoRule, {"overlap_steps": -1}, "overlap_steps"),
    (StreamingDiLoCoRule, {"mix_alpha": 1.0}, "mix_alpha"),
    (StreamingDiLoCoRule, {"wire": "onebit"}, "wire"),
])
def test_bad_arguments_raise_value_error_naming_them(make, kwargs, name):
    with pytest.raises(ValueError, match=rf"{name}="):
        make(**kwargs)


def test_strategies_are_registered_and_check_their_arguments():
    import lightning_mpi

    assert lightning_mpi.STRATEGIES["mpi_diloco"][0] == "DiLoCoStrategy"
    assert lightning_mpi.STRATEGIES["mpi_streaming_diloco"][0] == "StreamingDiLoCoStrategy"
    with pytest.raises(ValueError, match="outer_lr="):
        lightning_mpi.DiLoCoStrategy(outer_lr=-1.0)
    with pytest.raises(ValueError, match="mix_alpha="):
        lightning_mpi.StreamingDiLoCoStrategy(mix_alpha=2.0)
    strategy = lightning_mpi.StreamingDiLoCoStrategy(period=6, fragments=3, overlap_steps=1, wire="int8")
    assert isinstance(strategy.rule, StreamingDiLoCoRule) and strategy.rule.fragments == 3


# -- the strategies on 2 and 3 ranks ------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_diloco_strategies_on_ranks(world, tmp_path):
    out = tmp_path / "out.json"
    run_mpi(world, [str(SCRIPTS / "diloco_train.py"), str(out)], timeout=240, cwd=tmp_path)
    r = json.loads(out.read_text())
    # (a) outer_lr=1, no momentum: model averaging, to fp32 rounding
    assert r["model_avg"]["diff"] <= 1e-5 and r["model_avg"]["identical"], r["model_avg"]
    # (b) one fragment, τ = 0, α = 0: DiLoCo, bitwise; and the outer momentum did change the weights
    for wire in ("fp32", "int8"):
        case = r[f"streaming_as_diloco_{wire}"]
        assert case["diff"] == 0.0 and case["identical"] and case["outer_steps"] == 3, case
        assert case["moved"] > 1e-3, case
    # (b') the end folds in the steps since the last outer step by averaging the replicas, not by an outer step
    # (whose momentum moved the weights away from them: 0.2 nats/byte on the time-to-quality task)
    case = r["streaming_as_diloco_fp32"]
    assert case["end_from_mean"] <= 1e-5 and case["end_from_mean_streaming"] <= 1e-5, case
    assert r["end_in_flight"]["end_from_mean"] <= 1e-5 and r["end_in_flight"]["identical"], r["end_in_flight"]
    # (c) every rank ends on the same weights (also with fragments, overlap, mixing and int4)
    assert r["streaming_overlapped"] == {"identical": True, "outer_steps": 5.0, "finite": True}
    # (d) exact resume: mid-period (DiLoCo) and with an exchange in flight at the save (streaming)
    for name, in_flight in (("diloco", [False]), ("streaming", [True, False])):
        case = r[f"resume_{name}"]
        assert case["equal_on_every_rank"] and case["diff"] == 0.0 and case["identical"], case
        assert case["saved_steps"] == 6 and case["in_flight_saved"] == in_flight and case["ranks_saved"] == world, case
    # (f) Fabric
    assert r["fabric_diloco"] == {"identical": True, "outer_steps": 3.0, "class": "lightning_mpi.fabric.DiLoCoStrategy"}
    assert r["fabric_streaming"]["identical"] and r["fabric_streaming"]["outer_steps"] == 4.0


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_sparseloco_wire_on_ranks_is_one_process_math(world, tmp_path):
    """SparseLoCo's wire on 2 and 3 ranks (tests/scripts/sparseloco_train.py): the exchange against one
    process building every rank's row and averaging each entry over its senders (bitwise), and the
    per-chunk reference; DiLoCo's hooks against W replicas in one process; the Trainer: ranks alike,
    the bytes of the formula, an exact resume."""
    out = tmp_path / "out.json"
    run_mpi(world, [str(SCRIPTS / "sparseloco_train.py"), str(out)], timeout=100, cwd=tmp_path)
    r = json.loads(out.read_text())
    assert r["exchange"] == {"bitwise": True, "reference": True, "spread": True, "identical": True}, r["exchange"]
    assert r["diloco"]["diff"] <= 1e-6 and r["diloco"]["identical"], r["diloco"]
    assert r["trainer"] == {"identical": True, "finite": True, "outer_steps": 5.0, "bytes": True}, r["trainer"]
    case = r["resume"]
    assert case["equal_on_every_rank"] and case["diff"] == 0.0 and case["identical"], case
    assert case["in_flight_saved"] == [True, False] and case["accumulators_saved"], case


def test_sparseloco_strategy_arguments():
    import lightning_mpi
    from lightning_mpi.rules.diloco.rule import SPARSE_LR

    strategy = lightning_mpi.StreamingDiLoCoStrategy(wire="sparseloco", topk_per_chunk=32, error_decay=0.9)
    assert strategy.rule.outer_step() == (SPARSE_LR, 0.0) and strategy.rule.decay() == 0.9
    with pytest.raises(ValueError, match="outer_momentum="):
        lightning_mpi.DiLoCoStrategy(wire="sparseloco", outer_momentum=0.9)
    with pytest.raises(ValueError, match="error_decay="):
        lightning_mpi.DiLoCoStrategy(error_decay=0.5)
