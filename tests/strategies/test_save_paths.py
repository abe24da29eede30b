"""Nothing lost on any save path: every way a user saves, under every family of rules, on real ranks.

Two launches of ``tests/scripts/save_paths.py`` (about 20 s each on 2 cores): W = 2 saves with the
Trainer (before, during and after ``fit``, a ``ModelCheckpoint``, after ``test``/``validate``/
``predict``) and with Fabric (before ``fabric.setup``, after it, in the loop, after
``finish_training``), reads every file back, and resumes from each; W = 3 resumes from the same
files. A file holds the whole state when it has the weights every rank ends with, Adam's whole
state for every parameter (ZeRO's shards included), and the rule's state, and when a resume from it
continues where the saving run was: bitwise where the rule is deterministic and synchronous, and
against one process's Adam where a value is exact.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_mpi.checkpoint.__main__ import main as checkpoint_cli
from tests.mpi_utils import REPO, run_mpi
from tests.scripts.tiny_task import dataset, make_net

SCRIPT = str(REPO / "tests" / "scripts" / "save_paths.py")
B, STEPS_PER_EPOCH, LR = 4, 3, 0.01  # as in the script

FAMILIES = ("allreduce", "asa16", "topk", "powersgd", "zero", "easgd", "model_avg", "downpour", "gosgd",
            "diloco", "streaming_diloco", "auto")
#: same data, same weights, no timing in the rule: a resume ends bitwise where the saving run ended
DETERMINISTIC = ("allreduce", "asa16", "topk", "powersgd", "zero", "easgd", "model_avg", "diloco",
                 "streaming_diloco")
#: whose end of training leaves the weights as they are (so the state after fit is the state at its last step)
END_CHANGES_NOTHING = ("allreduce", "asa16", "topk", "powersgd", "zero")

TRAINER_CALLS = ("validate_before", "save_before", "fit", "save_after", "test", "validate", "predict",
                 "save_after_eval")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_paths")
    run_mpi(2, [SCRIPT, str(root / "save.json"), str(root), "save"], timeout=240)
    run_mpi(3, [SCRIPT, str(root / "resume.json"), str(root), "resume"], timeout=240)
    return {"root": root, "save": json.loads((root / "save.json").read_text()),
            "resume": json.loads((root / "resume.json").read_text())}


def ok(result):
    assert not (isinstance(result, dict) and "error" in result), result
    return result


def one_process_adam(world, epochs):
    """Adam on one process with the world's batch, the samples in the order Lightning's
    DistributedSampler gives the ranks (epoch e: randperm seeded e; step k of all ranks together
    covers perm[k·W·B : (k+1)·W·B]). Returns the flat weights and the moments in the checkpoint's order."""
    torch.manual_seed(3)
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    data = dataset(world * B * STEPS_PER_EPOCH)
    for epoch in range(epochs):
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
        for k in range(STEPS_PER_EPOCH):
            x, y = data[perm[k * world * B:(k + 1) * world * B]]
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    params = list(net.parameters())
    moments = torch.cat([opt.state[p][k].reshape(-1) for p in params for k in ("exp_avg", "exp_avg_sq")])
    return torch.cat([p.detach().reshape(-1) for p in params]), moments


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_a_zero_save_after_fit_holds_every_shard_consolidates_and_resumes_at_another_world_size(runs, tmp_path):
    """Defect: after ``fit`` the optimizer was no longer treated as sharded, so
    ``trainer.save_checkpoint`` wrote a plain file with rank 0's shard (``exp_avg`` of 3 or 47
    values for a 16x10 weight), which ``consolidate`` refused and no resume could load."""
    zero = runs["save"]["families"]["zero"]
    for name in ("during", "mc-epoch=0", "after", "after_eval"):
        report = ok(zero["files"][name])
        assert report["sharded"], name  # the same format as a ModelCheckpoint during fit
        assert report["optimizers"][0]["whole"], name
    # the CLI takes it, and the plain file holds Adam's whole state and the final weights
    out = tmp_path / "after.ckpt"
    assert checkpoint_cli(["consolidate", str(runs["root"] / "zero" / "after.ckpt"), str(out)]) == 0
    plain = torch.load(out, map_location="cpu", weights_only=False)
    shapes = [tuple(p.shape) for p in make_net().parameters()]
    assert [tuple(s["exp_avg"].shape) for _, s in sorted(plain["optimizer_states"][0]["state"].items())] == shapes
    assert torch.cat([v.reshape(-1) for v in plain["state_dict"].values()]).tolist() == zero["final"]["weights"]
    # resumed at W = 2 and at W = 3 (where it continues as a plain run from the allreduce save does)
    assert ok(zero["resume_after_3"])["weights"] == ok(zero["resume_mc-epoch=0_3"])["weights"]
    at3 = ok(runs["resume"]["families"]["zero"]["resume_after_3"])
    plain3 = ok(runs["resume"]["families"]["allreduce"]["resume_after_3"])
    assert at3["step"] == 9 and at3["agree"]
    assert torch.allclose(torch.tensor(at3["weights"]), torch.tensor(plain3["weights"]), atol=1e-5)
    # Fabric after finish_training: the same
    fafter = ok(zero["fabric_files"]["fafter"])
    assert fafter["sharded"] and fafter["optimizer"]["whole"]
    assert ok(runs["resume"]["families"]["zero"]["fabric_load_fafter"])["step"] == 6


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_fabric_load_of_a_sharded_checkpoint_restores_plain_values_and_returns_the_rest(runs):
    """Defect: under ``mpi_zero`` ``fabric.load(path, state)`` loaded the plain values into a copy of
    ``state``, so ``state["step"]`` kept its old value and nothing was returned."""
    for world, run in ((2, runs["save"]), (3, runs["resume"])):
        zero = run["families"]["zero"]
        names = ("fraw", "fbefore", "fduring", "fafter") if world == 2 else ("fraw", "fduring", "fafter")
        for name in names:
            loaded = ok(zero[f"fabric_load_{name}"])
            expected = {"fraw": (0, 0), "fbefore": (0, 0), "fduring": (3, 1), "fafter": (6, 2)}[name]
            assert (loaded["step"], loaded["epoch"]) == expected, (world, name)
            assert loaded["remainder"] == ["note"], (world, name)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_trainer_save_path_holds_the_whole_state_and_resumes(runs, family):
    out = runs["save"]["families"][family]
    for call in TRAINER_CALLS:
        ok(out[call])
    final = out["final"]
    assert final["agree"] and final["step"] == 2 * STEPS_PER_EPOCH  # every rank on the consensus
    assert out["eval_left_weights"]
    files = {name: ok(report) for name, report in out["files"].items()}
    numel = sum(p.numel() for p in make_net().parameters())
    # before fit (after validate): the weights it was given, no optimizer, no rule yet
    assert files["before"]["optimizers"] == [] and files["before"]["rule"] is None
    assert files["before"]["global_step"] == 0
    for name, step in (("during", 2), ("mc-epoch=0", 3), ("mc-epoch=1", 6), ("after", 6), ("after_eval", 6)):
        report = files[name]
        assert report["global_step"] == step, name
        assert report["optimizers"] and report["optimizers"][0]["whole"], name  # every parameter, whole
        assert report["rule"] is not None and report["rule"]["world_size"] == 2, name
        assert report["sharded"] == (family == "zero"), name
        assert len(report["weights"]) == numel, name
    # after fit: the weights every rank ends with; test/validate/predict change nothing
    assert files["after"]["weights"] == final["weights"]
    assert files["after_eval"] == files["after"]
    if family in END_CHANGES_NOTHING:  # the last ModelCheckpoint (before fit's end) holds them too
        assert files["mc-epoch=1"]["weights"] == final["weights"]
    if family == "downpour":  # the server clock after fit: every commit counted (3 per rank), not 0
        assert files["after"]["rule"]["clock"] == files["mc-epoch=1"]["rule"]["clock"] == 2 * 3
    if family == "gosgd":
        assert files["after"]["rule"]["weight_sum"] == pytest.approx(1.0)
    # resumes at the same world size: every rank agrees, and the step count goes on
    for name, epochs in (("before", 2), ("mc-epoch=0", 2), ("during", 2), ("after", 3), ("mc-epoch=0", 3)):
        resumed = ok(out[f"resume_{name}_{epochs}"])
        assert resumed["agree"] and resumed["step"] == epochs * STEPS_PER_EPOCH, name
    if family in DETERMINISTIC:  # from before fit and from the end of epoch 1: where the straight run ended
        assert out["resume_before_2"]["weights"] == final["weights"]
        if family not in ("easgd", "model_avg"):  # their ranks resume from rank 0's local weights
            assert out["resume_mc-epoch=0_2"]["weights"] == final["weights"]
    if family in END_CHANGES_NOTHING:  # after fit = its last step: a resume from it is one from epoch 1 on
        assert out["resume_after_3"]["weights"] == out["resume_mc-epoch=0_3"]["weights"]
    # another world size
    elsewhere = runs["resume"]["families"][family]
    for name in ("during", "mc-epoch=0", "after"):
        resumed = ok(elsewhere[f"resume_{name}_3"])
        assert resumed["agree"] and resumed["step"] == 3 * STEPS_PER_EPOCH, name


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_fabric_save_path_holds_the_whole_state_and_loads(runs, family):
    out = runs["save"]["families"][family]
    first = ok(out["fabric_first"])
    assert first["agree"]
    files = {name: ok(report) for name, report in out["fabric_files"].items()}
    assert files["fraw"]["rule"] is None  # before fabric.setup: no rule yet
    for name in ("fbefore", "fduring", "fafter"):  # after finish_training too: the state the rule ended with
        assert files[name]["rule"] is not None, name
        assert files[name]["sharded"] == (family == "zero"), name
    assert files["fduring"]["optimizer"]["whole"] and files["fafter"]["optimizer"]["whole"]
    assert files["fafter"]["weights"] == first["weights"]
    if family == "downpour":
        assert files["fafter"]["rule"]["clock"] == 2 * 3
    for world, run in ((2, runs["save"]), (3, runs["resume"])):
        for name in ("fraw", "fbefore", "fduring", "fafter"):
            if world == 3 and name == "fbefore":
                continue
            loaded = ok(run["families"][family][f"fabric_load_{name}"])
            expected = {"fraw": (0, 0), "fbefore": (0, 0), "fduring": (3, 1), "fafter": (6, 2)}[name]
            assert (loaded["step"], loaded["epoch"]) == expected, (world, name)
            assert loaded["remainder"] == ["note"] and loaded["agree"], (world, name)
    # loaded into a fresh setup with other initial weights, the loop goes on where it was
    same = {name: out[f"fabric_load_{name}"]["weights"] == first["weights"] for name in
            ("fraw", "fbefore", "fduring", "fafter")}
    if family in DETERMINISTIC:
        assert same["fraw"] and same["fbefore"], same  # the rule starts on the loaded weights
        if family not in ("easgd", "model_avg"):
            assert same["fduring"], same
    if family not in ("streaming_diloco", "auto"):  # (their final average feeds the saved residual back)
        assert same["fafter"], same
    # weights without the rule's state, loaded into a running rule, are what it ends on
    assert ok(out["fabric_hold_fraw"])["weights"] == files["fraw"]["weights"]


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_saves_hold_what_one_process_computes(runs):
    """Adam on one process with the world's batch: the weights and moments that the synchronous
    rules' after-fit checkpoints hold (ZeRO's consolidated from its shards)."""
    weights, moments = one_process_adam(2, 2)
    for family in ("allreduce", "zero"):
        after = runs["save"]["families"][family]["files"]["after"]
        assert torch.allclose(torch.tensor(after["weights"]), weights, atol=2e-6), family
        assert torch.allclose(torch.tensor(after["optimizers"][0]["moments"]), moments, atol=2e-6), family


def test_a_save_without_a_model_is_refused_by_lightning_naming_the_fix(runs):
    error = runs["save"]["save_without_model"]["error"]
    assert error.startswith("AttributeError") and "Trainer.save_checkpoint()" in error
