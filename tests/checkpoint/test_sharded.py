"""Sharded checkpoints: the file-level guarantees in one process. Saving at W = 3, resuming at W = 3
and W = 2, and consolidating into a plain Lightning checkpoint that loads without lightning_mpi run
end to end under the Trainer in tests/strategies/test_zero.py."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_mpi.checkpoint import consolidate_checkpoint, is_sharded_checkpoint, load_sharded, save_sharded
from lightning_mpi.checkpoint.files import publish_dir, resolve_dir, write_atomic
from lightning_mpi.checkpoint.sharded import spread_tensors
from lightning_mpi.rules.zero.state import SHARD_FORMAT
from tests.mpi_utils import REPO, mpi_env

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


def test_spread_tensors_are_written_by_one_rank_each_and_load_back(tmp_path):
    # Balanced by bytes, largest first, the same choice on every rank; a tensor not named stays replicated.
    state = {"a": torch.zeros(6), "b": torch.zeros(4), "c": torch.zeros(3), "buffer": torch.ones(2)}
    names = {"state_dict/a", "state_dict/b", "state_dict/c"}
    replicated, shares = spread_tensors({"state_dict": state, "epoch": 1}, names, 3)
    assert [sorted(share) for share in shares] == [["state_dict/a"], ["state_dict/b"], ["state_dict/c"]]
    assert replicated["state_dict"]["buffer"] is state["buffer"] and replicated["epoch"] == 1
    assert replicated["state_dict"]["c"]["rank"] == 2 and torch.is_tensor(state["c"])  # the input is untouched
    checkpoint = {"state_dict": {"w": torch.arange(4.0), "buffer": torch.ones(2)},
                  "optimizer_states": [shard(torch.ones(3))]}
    save_sharded(tmp_path / "s.ckpt", checkpoint, ONE_RANK, spread={"state_dict/w"})
    plain = torch.load(tmp_path / "s.ckpt" / "replicated.pt", weights_only=False)
    assert not torch.is_tensor(plain["state_dict"]["w"]) and torch.is_tensor(plain["state_dict"]["buffer"])
    for loaded in (load_sharded(tmp_path / "s.ckpt"), consolidate_checkpoint(tmp_path / "s.ckpt")):
        assert loaded["state_dict"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert list(loaded["state_dict"]) == ["w", "buffer"]
