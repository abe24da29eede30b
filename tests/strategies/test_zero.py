"""``mpi_zero`` (``SyncStrategy(shard_optimizer=True)``) under the Trainer and Fabric, on real ranks.

One launch at W = 2 and one at W = 3 compare with plain ASA and the full optimizer: Adam with two
param groups and a scheduler, AdamW with clipping by norm, SGD with momentum and gradient
accumulation, Adam in ``bf16-mixed`` with ``LMSOffload`` (W = 2 only), and a Fabric loop with
``fabric.clip_gradients`` and a sharded save and load. Each rank holds 1/W of the optimizer state;
a sharded checkpoint resumes exactly; one saved at W = 3 resumes at W = 2 as a plain-ASA run that
changed its world size there. One job under ``lightning-mpi --max-restarts`` resumes by itself
from a sharded ``last.ckpt`` (``ModelCheckpoint(save_last=True)``), then is preempted into a
sharded ``preempted.ckpt``. The rule's own math is tested in tests/rules/test_zero.py, the
checkpoint format in tests/checkpoint/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lightning_mpi
from lightning_mpi.checkpoint import consolidate_checkpoint, is_sharded_checkpoint
from tests.launcher.helpers import finish, launch, needs_venv_mpiexec
from tests.launcher.test_restarts import SCRIPT as RESTART_SCRIPT
from tests.launcher.test_restarts import reference_weights, steps_trained
from tests.mpi_utils import REPO, mpi_env, run_mpi

SCRIPT = str(REPO / "tests" / "scripts" / "zero_train.py")


def test_the_names_and_the_argument():
    assert lightning_mpi.STRATEGIES["mpi_zero"][1]["shard_optimizer"] is True
    assert lightning_mpi.STRATEGIES["mpi_zero_bf16"][1]["wire"] == "bf16"
    with pytest.raises(ValueError, match=r"shard_optimizer=True needs exchange='asa'"):
        lightning_mpi.SyncStrategy(shard_optimizer=True)
    with pytest.raises(TypeError):  # the lossy codecs' residuals are what sharding frees: not offered
        lightning_mpi.CompressedSyncStrategy(shard_optimizer=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    out = {}
    for world in (2, 3):
        ckpt = root / f"w{world}"
        ckpt.mkdir()
        run_mpi(world, [SCRIPT, str(root / f"train{world}.json"), str(ckpt), "train"], timeout=400)
        out[world] = json.loads((root / f"train{world}.json").read_text())
    # the W = 3 saves, resumed at W = 2
    run_mpi(2, [SCRIPT, str(root / "resume.json"), str(root / "w3"), "resume"], timeout=300)
    out["resume"] = json.loads((root / "resume.json").read_text())
    out["root"] = root
    return out


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_training_equals_plain_asa_with_a_full_optimizer(runs, world):
    r = runs[world]
    assert r["world_size"] == world
    for case in ("adam", "adamw_clip", "sgd_accumulate"):
        assert r[case]["diff"] <= 1e-6, (case, r[case])
        assert r[case]["identical"], case
    # Each rank holds 1/W of the optimizer state, up to one shard's padding.
    adam = r["adam"]
    assert sum(adam["shares"]) >= adam["full"]
    for share in adam["shares"]:
        assert abs(share - adam["full"] / world) <= adam["full"] * 0.05 + 64, adam
    assert r["fabric"]["diff"] <= 1e-6 and r["fabric"]["load_ok"] and r["fabric"]["sharded_dir"], r["fabric"]
    if world == 2:  # bf16-mixed, and LMSOffload on the sharded side
        assert r["bf16_lms"]["diff"] <= 1e-6 and r["bf16_lms"]["identical"], r["bf16_lms"]
        assert r["bf16_lms"]["offloaded"] > 0, r["bf16_lms"]


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_a_sharded_checkpoint_resumes_exactly_and_at_another_world_size(runs):
    for world in (2, 3):
        assert runs[world]["resume"]["sharded_dir"] and runs[world]["resume"]["diff"] == 0.0, runs[world]["resume"]
    assert runs["resume"]["world_size"] == 2
    assert runs["resume"]["changed_world"]["diff"] <= 1e-6, runs["resume"]


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_a_consolidated_checkpoint_loads_in_plain_lightning(runs, tmp_path):
    out = tmp_path / "plain.ckpt"
    subprocess.run([sys.executable, "-m", "lightning_mpi.checkpoint", "consolidate",
                    str(runs["root"] / "w3" / "zero" / "last.ckpt"), str(out)], check=True, env=mpi_env(), timeout=120)
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO / "tests" / "scripts")!r})
from tiny_task import make_net
ckpt = torch.load({str(out)!r}, weights_only=False)
net = make_net()
net.load_state_dict({{k.removeprefix("net."): v for k, v in ckpt["state_dict"].items()}})
opt = torch.optim.Adam(net.parameters())
state = ckpt["optimizer_states"][0]
assert len(state["state"]) == len(list(net.parameters())), state.keys()
assert "lightning_mpi" not in sys.modules
print("ok", ckpt["epoch"], ckpt["global_step"])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-3000:]


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(300)
def test_restart_preemption_and_save_last_with_sharded_checkpoints(tmp_path):
    # mpi_zero under ``lightning-mpi --max-restarts 1``, W = 2, one step per epoch, a checkpoint
    # every 2 epochs and ModelCheckpoint(save_last=True). Rank 1 is SIGKILLed in step 5: the restart
    # resumes by itself from the sharded last.ckpt (step 4); there rank 1 alone gets SIGTERM in step
    # 6: every rank writes a sharded preempted.ckpt and the job ends with 0. Its weights are those of
    # an uninterrupted run at its step (resuming from it is the restart's path, tested above).
    job = [RESTART_SCRIPT, tmp_path, "--strategy", "zero", "--save-last", "--epochs", "14", "--every-n-epochs", "2"]
    first = launch([sys.executable, "-m", "lightning_mpi", "-n", "2", "--max-restarts", "1", *job, "--kill-rank", "1",
                    "--kill-at", "5", "--signal", "SIGTERM", "--signal-rank", "1", "--signal-at", "6",
                    "--signal-on-restart"], REPO)
    code, out, err = finish(first, 250)
    assert code == 0, err[-3000:]
    assert "restart 1: resuming from" in err and "last.ckpt" in err, err[-3000:]
    assert "lightning_mpi: preempted (SIGTERM) at step" in err, err[-3000:]
    ckpts = tmp_path / "ckpt"
    assert {"last.ckpt", "preempted.ckpt", "epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt"} <= set(os.listdir(ckpts))
    assert all(is_sharded_checkpoint(ckpts / name) for name in os.listdir(ckpts))
    killed, restarted = steps_trained(tmp_path, 2)
    assert killed == list(range(6)) and restarted[0] == 4
    preempted = consolidate_checkpoint(ckpts / "preempted.ckpt")
    step = preempted["global_step"]
    assert step == restarted[-1] + 1 and step < 14
    reference = reference_weights(24, [2] * step, 1)
    for name, value in reference.items():
        assert torch.allclose(preempted["state_dict"][f"net.{name}"], value, atol=1e-5, rtol=1e-5), name
    assert len(preempted["optimizer_states"][0]["state"]) == len(reference)  # every momentum buffer
