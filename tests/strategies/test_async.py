"""Elastic, averaging, parameter-server and gossip strategies on real ranks.

- No lost update: W ranks commit K known deltas to the sharded center at once; the center must
  end exactly at initial + Σ deltas and the server clock at W·K.
- Every rule trains a small MLP on scikit-learn digits at W = 2 and 3 to near single-process
  accuracy in the same epochs (lr scaled linearly with W, with warm-up: see rules_train.py), and
  leaves identical weights (the center / consensus) on every rank, with no thread left behind.
  The parameter-server rules (TURNS) are checked with their commits taking turns (rules_train.py
  "turns"): every commit then sees W − 1 others since its pull, the worst case (DOWNPOUR: every
  rank pulls again at the end of a round), and the same interleaving in every run, so their
  accuracy is reproducible rather than a draw of the thread timing under load (ADAG once fell to
  0.820 in CI). The gossip rule is checked in lockstep (its "turns"): a rank's pushes are merged by
  their receivers in the step they were made, in order of source rank (free-running, GoSGD once
  fell to 0.756 in CI). Every accuracy run is therefore deterministic; the free-running order is
  exercised by the uneven-steps, stop and checkpoint scenarios, which check exact agreement.
- Lifecycle: ranks that run different numbers of steps still end on the same weights; a stop
  decided by one rank (Timer-like broadcast, EarlyStopping-like reduce) stops every rank.
- Checkpoints: a checkpoint written mid-training at W = 2 resumes at W = 3 (new mpiexec run) with
  the center, clock, momentum and gossip weights restored, not re-initialised.

Each mpiexec launch costs 10-20 s of imports on a loaded 2-core machine, so the W = 3 launch runs
the accuracy, uneven-steps and stop scenarios together.
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
UNEVEN = ["uneven/mpi_downpour", "uneven/mpi_aeasgd", "uneven/mpi_gosgd"]
STOP = ["stop/mpi_dynsgd", "stop/mpi_gosgd"]
TIMED = ["timed/mpi_downpour", "timed/mpi_gosgd"]
RESUMED = ["mpi_downpour", "mpi_eamsgd", "mpi_gosgd"]
#: Checked with commits in turns (deterministic). DOWNPOUR sums stale deltas as they are, so with a
#: pull per commit the turns are exactly what it cannot absorb (0.618 at W = 3): its rounds end with
#: every rank pulling the center again (rules_train.Turns "together"). Free-running it ranged
#: 0.716-0.929 at W = 3.
TURNS = ["mpi_aeasgd", "mpi_eamsgd", "mpi_agn", "mpi_adag", "mpi_dynsgd", "mpi_downpour"]
#: Accuracy runs in a deterministic order: TURNS, and the gossip rule in lockstep.
ORDERED = [*TURNS, "mpi_gosgd"]


def accuracy_run(name):
    """The name a rule's accuracy run has in a launch: "turns/NAME" for ORDERED."""
    return f"turns/{name}" if name in ORDERED else name


#: Allowed gap to one process (same 8 epochs). The target (benchmarks/convergence.py) is 2 points;
#: the synchronous rules are deterministic here, the asynchronous ones get more room for the
#: worst-case staleness of turns (measured on 2 cores: W = 3 ADAG 0.918, DynSGD 0.918, AGN
#: 0.913, AEASGD 0.909, EAMSGD 0.960, DOWNPOUR 0.882; W = 2 DOWNPOUR 0.936; one process 0.913). A
#: broken rule (lost commits, no pull) stays far below.
#: GoSGD in lockstep (p = 0.1: each rank pushes 11-17 times in these runs): W = 2 0.942, W = 3
#: 0.909, in every run (free-running it ranged 0.756-0.916 at W = 3).
GAP = {**{n: 0.04 for n in SYNC_RULES}, **{n: 0.08 for n in ASYNC_RULES}}


def _train(world, names, tmp_path, scenario="accuracy", timeout=280, env=None):
    out = tmp_path / f"{scenario}{world}.json"
    args = [TRAIN, str(out), ",".join(names), scenario]
    if world == 1:
        subprocess.run([sys.executable, *args], env=mpi_env(env), check=True, timeout=timeout, capture_output=True)
    else:
        run_mpi(world, args, timeout=timeout, env=env)
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


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def world2(tmp_path_factory, ckpt_dir):
    """W = 2: every rule for accuracy, and checkpoints written mid-training for RESUMED."""
    names = [accuracy_run(n) for n in RULES] + [f"save/{n}" for n in RESUMED]
    return _train(2, names, tmp_path_factory.mktemp("w2"), timeout=560, env={"RULES_CKPT_DIR": str(ckpt_dir)})


@pytest.fixture(scope="module")
def world3(tmp_path_factory, ckpt_dir, world2):
    """W = 3: every rule, uneven steps, stop votes, and the W = 2 checkpoints resumed at W = 3."""
    names = [accuracy_run(n) for n in RULES] + UNEVEN + STOP + TIMED + [f"resume/{n}" for n in RESUMED]
    return _train(3, names, tmp_path_factory.mktemp("w3"), timeout=560, env={"RULES_CKPT_DIR": str(ckpt_dir)})


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_every_rule_trains_digits(world, single, world2, world3):
    results = world3 if world == 3 else world2
    failures = []
    for name in RULES:
        r = results[accuracy_run(name)]
        assert r["max_rank_diff"] == 0.0, f"{name}: ranks hold different weights after fit"
        assert r["leaked_threads"] == 0, f"{name}: a background thread outlived fit"
        if r["acc"] < single["acc"] - GAP[name]:
            failures.append(f"{name}: {r['acc']:.3f} vs single {single['acc']:.3f}")
    assert not failures, failures
    for name in TURNS:
        # every rank committed every `period` steps (the rule's), and once more for the steps left at the end
        r = results[accuracy_run(name)]
        expected = -(-r["global_step"] // r["period"])
        assert r["commits"] == [expected] * world, (name, r["commits"], r["global_step"])
    for name in ASYNC_RULES[:-1]:
        keys = set(results[accuracy_run(name)]["stat_keys"])
        rule = name.removeprefix("mpi_")
        for stat in ("staleness_mean", "staleness_max", "commits_per_s", "bytes_sent", "wait_seconds"):
            assert f"mpi/{rule}/{stat}" in keys, (name, stat)
    gossip = results[accuracy_run("mpi_gosgd")]["gossip"]
    # ~0.1 x 120 steps x W pushes expected; every one of them merged by its receiver before fit ends
    assert sum(gossip["pushes"]) >= 3 * world, gossip
    assert sum(gossip["pushes"]) == sum(gossip["received"]), gossip


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_uneven_steps_end_on_the_center(world3):
    for name in UNEVEN:
        r = world3[name]
        assert len(set(r["steps_per_rank"])) == 3, f"{name}: the scenario must give ranks different step counts"
        assert r["max_rank_diff"] == 0.0, f"{name}: ranks do not share the center/consensus after fit"
        assert r["leaked_threads"] == 0


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_one_rank_stop_decision_stops_every_rank(world3):
    for name in STOP:
        r = world3[name]
        # max_epochs=50 would be ~750 steps per rank; rank 0 stops after 4, the last rank after 6
        assert max(r["steps_per_rank"]) < 60, f"{name}: a rank did not see the stop decision {r['steps_per_rank']}"
        assert r["max_rank_diff"] == 0.0
        assert r["leaked_threads"] == 0
    assert {"center", "clock", "steps", "commits", "momentum", "ranks"} <= set(world3["stop/mpi_dynsgd"]["rule_state_keys"])
    assert {"weight", "pushes", "ranks"} <= set(world3["stop/mpi_gosgd"]["rule_state_keys"])
    for name in STOP:  # each at its own pace, but soon after the decision (no rank catches up on another's steps)
        steps = world3[name]["steps_per_rank"]
        assert max(steps) - min(steps) <= 2 * 8 + 6, (name, steps)  # two leases of the board, and the vote's spread


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_max_time_with_validation_and_metrics_stops_every_rank_after_the_same_validations(world3):
    """Trainer(max_time=...), a validation every 5 batches with sync_dist logging and a torchmetrics
    metric: the asynchronous ranks stop having run the same validations, between the same two of
    them (each at its own step), never in different collectives."""
    for name in TIMED:
        r = world3[name]
        steps = r["steps_per_rank"]
        assert max(steps) - min(steps) < 5, ("each rank stops between the same two validations", name, steps)
        assert len(set(r["validations_per_rank"])) == 1 and r["validations_per_rank"][0] > 0, (name, r)
        assert r["max_rank_diff"] == 0.0 and r["leaked_threads"] == 0, name


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_checkpoint_resumes_rule_state_at_another_world_size(ckpt_dir, world3):
    import torch

    for name in RESUMED:
        saved = torch.load(ckpt_dir / name / "k12.ckpt", weights_only=False)["lightning_mpi"]
        state, r = saved["state"], world3[f"resume/{name}"]
        assert saved["world_size"] == 2 and len(state["ranks"]) == 2
        assert any("world size 2, resuming at 3" in w for w in r["warnings"]), r["warnings"]
        assert r["global_step"] == 24, f"{name}: training did not continue to max_steps"
        assert r["max_rank_diff"] == 0.0 and r["leaked_threads"] == 0
        for rank, seen in enumerate(r["seen"]):
            assert seen["global_step_at_start"] == 12 and seen["restored"], (name, rank)
            if name == "mpi_gosgd":
                # another world size: every rank starts from the saved weighted consensus, weight 1/W
                thetas = [x["theta"].double() for x in state["ranks"]]
                ws = [x["weight"] for x in state["ranks"]]
                consensus = sum(w * t for w, t in zip(ws, thetas)) / sum(ws)
                assert seen["weight"] == pytest.approx(1 / 3)
                assert torch.allclose(torch.tensor(seen["theta"], dtype=torch.float64), consensus, atol=1e-6)
            else:
                # the center, re-sharded over 3 ranks, holds exactly the saved values; so does the clock
                assert torch.equal(torch.tensor(seen["center"]), state["center"]), (name, rank)
                assert seen["clock"] == state["clock"] > 0 and seen["steps"] == 12
        if name == "mpi_eamsgd":
            assert all(seen["momentum_norm"] > 0 for seen in r["seen"]), "momentum was re-initialised"


def test_async_names_are_registered():
    from pytorch_lightning.strategies import StrategyRegistry

    import lightning_mpi  # noqa: F401
    from lightning_mpi import EASGDStrategy, GoSGDStrategy

    for name in RULES:
        assert name in StrategyRegistry, name
    assert StrategyRegistry["mpi_easgd"]["strategy"] is EASGDStrategy
    assert StrategyRegistry["mpi_gosgd"]["strategy"] is GoSGDStrategy
