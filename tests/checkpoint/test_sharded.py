"""Sharded checkpoints: the file-level guarantees in one process; save at W = 3, resume at W = 3 and
W = 2, and consolidate into a plain Lightning checkpoint that loads without lightning_mpi."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_mpi.checkpoint import consolidate_checkpoint, is_sharded_checkpoint, load_sharded, save_sharded
from lightning_mpi.checkpoint.files import publish_dir, resolve_dir, write_atomic
from lightning_mpi.rules.zero_state import SHARD_FORMAT
from tests.mpi_utils import REPO, mpi_env, run_mpi

SCRIPTS = REPO / "tests" / "scripts"
ONE_RANK = SimpleNamespace(rank=0, size=1)


def shard(value):
    return {"format": SHARD_FORMAT, "world_size": 1, "rank": 0, "param_groups": [{"lr": 0.1, "params": [0]}],
            "param_shapes": [[3]], "pieces": [[0, 0, 3]], "state": [{"step": torch.tensor(1.0), "exp_avg": value}]}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_take_the_umask_not_0600(tmp_path, umask_022):
    target = tmp_path / "a.ckpt"
    write_atomic(target, lambda f: f.write(b"x"))
    assert target.stat().st_mode & 0o777 == 0o644
    save_sharded(tmp_path / "s.ckpt", {"optimizer_states": [shard(torch.ones(3))], "epoch": 1}, ONE_RANK)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "s.ckpt").iterdir()}
    assert (tmp_path / "s.ckpt").stat().st_mode & 0o777 == 0o755
    assert set(modes.values()) == {0o644} and "manifest.json" in modes


def test_a_save_replaces_the_previous_one_and_leaves_nothing_behind(tmp_path):
    for value in (1.0, 2.0):
        save_sharded(tmp_path / "s.ckpt", {"optimizer_states": [shard(torch.full((3,), value))], "epoch": 1}, ONE_RANK)
    assert sorted(os.listdir(tmp_path)) == ["s.ckpt"]
    loaded = load_sharded(tmp_path / "s.ckpt")
    assert loaded["epoch"] == 1 and loaded["optimizer_states"][0][0]["state"][0]["exp_avg"].tolist() == [2.0] * 3
    full = consolidate_checkpoint(tmp_path / "s.ckpt")["optimizer_states"][0]
    assert full["state"][0]["exp_avg"].tolist() == [2.0] * 3 and full["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_partial_one(tmp_path):
    save_sharded(tmp_path / "s.ckpt", {"optimizer_states": [shard(torch.ones(3))]}, ONE_RANK)
    bad = shard(torch.ones(3))
    bad["state"][0]["oops"] = lambda: None  # cannot be pickled
    with pytest.raises(RuntimeError, match="rank 0"):
        save_sharded(tmp_path / "s.ckpt", {"optimizer_states": [bad]}, ONE_RANK)
    assert sorted(os.listdir(tmp_path)) == ["s.ckpt"] and is_sharded_checkpoint(tmp_path / "s.ckpt")


def test_an_interrupted_publish_is_found_under_its_old_name(tmp_path):
    target = tmp_path / "s.ckpt"
    save_sharded(target, {"optimizer_states": [shard(torch.ones(3))]}, ONE_RANK)
    os.rename(target, tmp_path / ".s.ckpt.old-123")  # the crash came between publish_dir's two renames
    assert is_sharded_checkpoint(target)
    assert load_sharded(target)["optimizer_states"][0][0]["state"][0]["exp_avg"].tolist() == [1.0] * 3
    assert resolve_dir(tmp_path / "other", lambda p: p.is_dir()) is None
    staging = tmp_path / "new"
    staging.mkdir()
    publish_dir(staging, target)
    assert target.is_dir() and not staging.exists()


def test_consolidate_command_names_a_wrong_directory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lightning_mpi.checkpoint", "consolidate", str(tmp_path), "x.ckpt"],
                            capture_output=True, text=True, timeout=60, env=mpi_env())
    assert result.returncode == 2 and "is not a sharded checkpoint" in result.stderr


LOAD_PLAIN = """
import json, sys
sys.path.insert(0, {scripts!r})
import torch
from zero_task import ZeroNet
model = ZeroNet.load_from_checkpoint({out!r})
checkpoint = torch.load({out!r}, weights_only=True)
[optimizer], [scheduler] = model.configure_optimizers()
optimizer.load_state_dict(checkpoint["optimizer_states"][0])
scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
plain = torch.load({plain!r}, weights_only=True)
reference = plain["optimizer_states"][0]
state_diff = max((reference["state"][i][k].double() - v.double()).abs().max().item()
                 for i, s in optimizer.state_dict()["state"].items() for k, v in s.items() if v.dim() > 0)
weight_diff = max((plain["state_dict"][k] - v).abs().max().item() for k, v in model.state_dict().items())
print(json.dumps({{"lightning_mpi_imported": any(m.startswith("lightning_mpi") for m in sys.modules),
                   "state_diff": state_diff, "weight_diff": weight_diff, "hidden": model.hparams.hidden,
                   "lr": [g["lr"] for g in optimizer.param_groups], "groups_equal": 
                   [{{k: v for k, v in g.items() if k != "params"}} for g in optimizer.state_dict()["param_groups"]]
                   == [{{k: v for k, v in g.items() if k != "params"}} for g in reference["param_groups"]]}}))
"""


def test_save_at_3_resume_at_3_and_2_and_consolidate(tmp_path):
    run_mpi(3, [str(SCRIPTS / "zero_checkpoint.py"), "save", str(tmp_path)], timeout=180)
    run_mpi(2, [str(SCRIPTS / "zero_checkpoint.py"), "resume", str(tmp_path)], timeout=180)
    saved = json.loads((tmp_path / "save.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert saved["is_sharded"] and saved["entries"] == ["plain.ckpt", "sharded.ckpt"]
    assert saved["same_w_resume_diff"] == 0.0  # exact resume at the same W
    assert saved["saved_weights_diff"] <= 1e-6 and saved["zero_vs_plain_diff"] <= 1e-6
    shards = sorted(v for k, v in saved["shard_bytes"].items() if k.startswith("shard-"))
    assert len(shards) == 3
    # resumed at W = 2 from the W = 3 shards, and from the plain checkpoint: equal to the plain run
    assert resumed["restored_weights_diff"] <= 1e-6
    assert resumed["resharded_diff"] <= 1e-6 and resumed["from_plain_diff"] <= 1e-6 and resumed["state_diff"] <= 1e-6
    assert resumed["restored_lr"][0] == resumed["restored_lr"][1] == resumed["restored_lr"][2]
    # one plain Lightning checkpoint, loaded in a process that never imports lightning_mpi
    out = tmp_path / "consolidated.ckpt"
    subprocess.run([sys.executable, "-m", "lightning_mpi.checkpoint", "consolidate", str(tmp_path / "sharded.ckpt"), str(out)],
                   check=True, capture_output=True, text=True, timeout=120, env=mpi_env())
    code = LOAD_PLAIN.format(scripts=str(SCRIPTS), out=str(out), plain=str(tmp_path / "plain.ckpt"))
    env = {k: v for k, v in mpi_env().items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert not loaded["lightning_mpi_imported"] and loaded["hidden"] == 13 and loaded["groups_equal"]
    assert loaded["state_diff"] <= 1e-6 and loaded["weight_diff"] <= 1e-6
