"""Checkpoint files get the permissions a plain write gives (issue 27, item 1).

``tempfile.mkstemp`` creates 0600 files, so an atomic write through it hid checkpoints from
teammates and from evaluation jobs running as another account. Trainer and Fabric saves go through
``AtomicCheckpointIO``; both must leave ``0o666 & ~umask`` for a new file, exactly what plain
Lightning leaves in the same directory, and keep the mode of a file they overwrite.
"""

import os
import stat

import pytest
import torch

import lightning_mpi
from tests.quiet_trainer import QUIET_NO_VAL

pytestmark = pytest.mark.timeout(120)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    from fsspec.implementations import local

    previous = os.umask(request.param)
    # Plain Lightning writes through fsspec, which reads the umask once per process (lru_cache):
    # forget it, so that the reference files below see this umask too.
    local.get_umask.cache_clear()
    yield request.param
    os.umask(previous)
    local.get_umask.cache_clear()


def test_a_new_checkpoint_gets_0666_less_the_umask(tmp_path, umask):
    io = lightning_mpi.AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "model.ckpt")
    assert mode(tmp_path / "model.ckpt") == 0o666 & ~umask
    assert os.listdir(tmp_path) == ["model.ckpt"]


def test_an_overwrite_keeps_the_files_mode(tmp_path):
    target = tmp_path / "last.ckpt"
    io = lightning_mpi.AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, target)
    os.chmod(target, 0o640)
    io.save_checkpoint({"step": 2}, target)
    assert mode(target) == 0o640 and torch.load(target)["step"] == 2


def test_trainer_checkpoints_have_plain_lightnings_mode(tmp_path, umask):
    import pytorch_lightning as pl
    from pytorch_lightning.demos.boring_classes import BoringModel

    for strategy in ("auto", "mpi_asa16"):
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, **QUIET_NO_VAL)
        trainer.fit(BoringModel())
        trainer.save_checkpoint(tmp_path / f"{strategy}.ckpt")
    assert mode(tmp_path / "mpi_asa16.ckpt") == mode(tmp_path / "auto.ckpt") == 0o666 & ~umask


def test_fabric_saves_have_plain_fabrics_mode(tmp_path, umask):
    import lightning as L

    for strategy in ("auto", "mpi_gosgd"):
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1)
        fabric.launch()
        model = fabric.setup(torch.nn.Linear(2, 2))
        fabric.save(tmp_path / f"{strategy}.ckpt", {"model": model})
    assert mode(tmp_path / "mpi_gosgd.ckpt") == mode(tmp_path / "auto.ckpt") == 0o666 & ~umask


def test_fabric_saves_before_and_after_finish_training_hold_the_rules_state(tmp_path):
    # What the README's Fabric snippet and docs/checkpoints.md say.
    import lightning as L

    fabric = L.Fabric(strategy="mpi_easgd", accelerator="cpu", devices=1)
    fabric.launch()
    net = torch.nn.Linear(2, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(4, 2)).sum())
    optimizer.step()
    fabric.save(tmp_path / "last.ckpt", {"model": model, "optimizer": optimizer})
    fabric.strategy.finish_training()
    fabric.save(tmp_path / "final.ckpt", {"model": model, "optimizer": optimizer})
    assert "lightning_mpi" in torch.load(tmp_path / "last.ckpt", weights_only=False)
    final = torch.load(tmp_path / "final.ckpt", weights_only=False)
    assert set(final) == {"model", "optimizer", "lightning_mpi"}
    assert final["lightning_mpi"]["state"]["steps"] == 1  # the state the rule ended with
