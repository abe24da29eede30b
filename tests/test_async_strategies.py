"""Elastic, averaging, parameter-server and gossip strategies on real ranks.

- No lost update: W ranks commit K known deltas to the sharded center at once; the center must
  end exactly at initial + Σ deltas and the server clock at W·K.
- Every rule trains a small MLP on scikit-learn digits at W = 2 and 3 to near single-process
  accuracy (same epochs), and leaves identical weights (the center / consensus) on every rank,
  with no thread left behind.
- Lifecycle: ranks that run different numbers of steps still end on the same weights; a stop
  decided by one rank (Timer-like broadcast, EarlyStopping-like reduce) stops every rank.
"""
import json
import subprocess
import sys

import pytest

from tests.mpi_utils import REPO, mpi_env, run_mpi

SCRIPTS = REPO / "tests" / "scripts"
TRAIN = str(SCRIPTS / "rules_train.py")
SYNC_RULES = ["mpi_easgd", "mpi_model_avg"]
ASYNC_RULES = ["mpi_aeasgd", "mpi_eamsgd", "mpi_downpour", "mpi_agn", "mpi_adag", "mpi_dynsgd", "mpi_gosgd"]
RULES = SYNC_RULES + ASYNC_RULES
#: Floor on test accuracy after 8 epochs (chance is 0.10; one process reaches about 0.91).
#: In this 8-epoch, lr 0.1 setting W ranks take W× fewer steps than one process, so even the
#: synchronous mpi_asa trails it at W = 3; the gap to one process is measured in
#: benchmarks, not asserted here. A broken rule (lost commits, no pull) stays near chance.
FLOOR = 0.5


def _train(world, names, tmp_path, scenario="accuracy", timeout=280):
    out = tmp_path / f"{scenario}{world}.json"
    args = [TRAIN, str(out), ",".join(names), scenario]
    if world == 1:
        subprocess.run([sys.executable, *args], env=mpi_env(), check=True, timeout=timeout, capture_output=True)
    else:
        run_mpi(world, args, timeout=timeout)
    return json.loads(out.read_text())["results"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(1, ["single"], tmp_path_factory.mktemp("single"), scenario="single")["single"]


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_no_lost_update_on_sharded_center(tmp_path):
    out = tmp_path / "nlu.json"
    run_mpi(3, [str(SCRIPTS / "rules_no_lost_update.py"), str(out)], timeout=110)
    r = json.loads(out.read_text())
    assert r["max_abs_err"] == 0.0, "a concurrent commit was lost or torn"
    assert r["ranks_agree"]
    assert r["clock"] == 3 * 40 and r["ticks_unique"], "Fetch_and_op clock skipped or repeated a tick"
    assert r["thread_alive"] is False


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_every_rule_trains_digits(world, single, tmp_path):
    results = _train(world, RULES, tmp_path, timeout=560)
    failures = []
    for name in RULES:
        r = results[name]
        assert r["max_rank_diff"] == 0.0, f"{name}: ranks hold different weights after fit"
        assert r["leaked_threads"] == 0, f"{name}: a background thread outlived fit"
        if r["acc"] < FLOOR or r["acc"] < 0.5 * single["acc"]:
            failures.append(f"{name}: {r['acc']:.3f} vs single {single['acc']:.3f}")
    assert not failures, failures
    for name in ASYNC_RULES[:-1]:
        keys = set(results[name]["stat_keys"])
        rule = name.removeprefix("mpi_")
        for stat in ("staleness_mean", "staleness_max", "commits_per_s", "bytes_sent", "wait_seconds"):
            assert f"mpi/{rule}/{stat}" in keys, (name, stat)


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_uneven_steps_end_on_the_center(tmp_path):
    results = _train(3, ["mpi_downpour", "mpi_aeasgd", "mpi_gosgd"], tmp_path, scenario="uneven")
    for name, r in results.items():
        assert len(set(r["steps_per_rank"])) == 3, f"{name}: the scenario must give ranks different step counts"
        assert r["max_rank_diff"] == 0.0, f"{name}: ranks do not share the center/consensus after fit"
        assert r["leaked_threads"] == 0


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_one_rank_stop_decision_stops_every_rank(tmp_path):
    results = _train(3, ["mpi_dynsgd", "mpi_gosgd"], tmp_path, scenario="stop")
    for name, r in results.items():
        # max_epochs=50 would be ~750 steps per rank; rank 0 stops after 4, the last rank after 6
        assert max(r["steps_per_rank"]) < 60, f"{name}: a rank did not see the stop decision {r['steps_per_rank']}"
        assert r["max_rank_diff"] == 0.0
        assert r["leaked_threads"] == 0
    assert {"center", "clock", "steps", "commits", "momentum"} <= set(results["mpi_dynsgd"]["rule_state_keys"])
    assert {"weight", "pushes"} <= set(results["mpi_gosgd"]["rule_state_keys"])


def test_async_names_are_registered():
    from pytorch_lightning.strategies import StrategyRegistry

    import lightning_mpi  # noqa: F401
    from lightning_mpi.async_strategies import EASGDStrategy, GoSGDStrategy

    for name in RULES:
        assert name in StrategyRegistry, name
    assert StrategyRegistry["mpi_easgd"]["strategy"] is EASGDStrategy
    assert StrategyRegistry["mpi_gosgd"]["strategy"] is GoSGDStrategy
