"""Errors that say what the user meant (issue 27, items 3 and 4): a lightning_mpi class of the other
Lightning package (LightningCLI class path, DataModule), and the submodules reachable as
``lightning_mpi.lightning`` etc. without importing them. Lightning's own "invalid strategy" error is
left as it is (issue 38: no patching of Lightning's private methods)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

import lightning_mpi
from lightning_mpi.strategies.registry import class_path_names
from tests.mpi_utils import REPO, mpi_env
from tests.quiet_trainer import QUIET

pytestmark = pytest.mark.timeout(120)

FRONTENDS = {  # package -> how to build its Trainer or Fabric with a strategy
    "pytorch_lightning": lambda s: importlib.import_module("pytorch_lightning").Trainer(strategy=s, **QUIET),
    "lightning.pytorch": lambda s: importlib.import_module("lightning.pytorch").Trainer(strategy=s, **QUIET),
    "lightning_fabric": lambda s: importlib.import_module("lightning_fabric").Fabric(strategy=s, accelerator="cpu"),
    "lightning.fabric": lambda s: importlib.import_module("lightning.fabric").Fabric(strategy=s, accelerator="cpu"),
}
#: package -> the module of lightning_mpi's classes built on it
CLASSES = {
    "pytorch_lightning": "lightning_mpi",
    "lightning.pytorch": "lightning_mpi.lightning",
    "lightning_fabric": "lightning_mpi.lightning_fabric",
    "lightning.fabric": "lightning_mpi.fabric",
}


@pytest.mark.parametrize("package", list(FRONTENDS))
def test_an_unknown_name_gets_lightnings_own_error(package):
    # Nothing of lightning_mpi runs in Lightning's check of a strategy string, and nothing wraps it.
    with pytest.raises(ValueError) as error:
        FRONTENDS[package]("mpi_asa61")
    assert str(error.value).startswith("You selected an invalid strategy name: `strategy='mpi_asa61'`.")


@pytest.mark.parametrize(
    "package, given, right",
    [
        ("lightning.pytorch", "lightning_mpi.EASGDStrategy", "lightning_mpi.lightning.EASGDStrategy"),
        ("pytorch_lightning", "lightning_mpi.lightning.SyncStrategy", "lightning_mpi.SyncStrategy"),
        ("lightning.pytorch", "lightning_mpi.MPIStrategy", "lightning_mpi.lightning.MPIStrategy"),
    ],
)
def test_the_other_trainers_class_path_as_a_name_names_the_class_to_use(package, given, right):
    message = class_path_names(package)[given.lower()]  # Lightning lower-cases the flag
    assert f"the class `{given}` is not built on {package}" in message
    assert f"--trainer.strategy={right}" in message
    with pytest.raises(ValueError) as error:
        FRONTENDS[package](given)  # a plain string in Python too
    assert str(error.value) == message


def test_only_the_other_trainers_class_paths_are_registered():
    names = class_path_names("lightning.pytorch")
    assert "lightning_mpi.easgdstrategy" in names and "lightning_mpi.asyncmpistrategy" in names
    assert "'mpi_easgd'" in names["lightning_mpi.easgdstrategy"]
    assert "or the name" not in names["lightning_mpi.mpistrategy"]  # no mpi_* name builds the base class
    assert all(path.startswith("lightning_mpi.lightning.") for path in class_path_names("pytorch_lightning"))
    assert not any(path.startswith("lightning_mpi.lightning.") for path in names)


@pytest.mark.parametrize(
    "cli_package, given, right",
    [
        ("lightning.pytorch", "lightning_mpi.EASGDStrategy", "lightning_mpi.lightning.EASGDStrategy"),
        ("pytorch_lightning", "lightning_mpi.lightning.EASGDStrategy", "lightning_mpi.EASGDStrategy"),
    ],
)
def test_lightning_cli_with_the_other_packages_class_path_names_the_right_one(cli_package, given, right):
    cli = importlib.import_module(f"{cli_package}.cli").LightningCLI
    model = importlib.import_module(f"{cli_package}.demos.boring_classes").BoringModel
    with pytest.raises(ValueError) as error:
        cli(model, run=False, save_config_callback=None, args=[f"--trainer.strategy={given}", "--trainer.logger=false"])
    assert f"the class `{given}` is not built on {cli_package}" in str(error.value)
    assert f"--trainer.strategy={right}" in str(error.value) and "'mpi_easgd'" in str(error.value)


@pytest.mark.parametrize(
    "trainer_package, built_on",
    [("lightning.pytorch", "pytorch_lightning"), ("pytorch_lightning", "lightning.pytorch")],
)
def test_a_datamodule_of_the_other_package_names_the_class_to_use(trainer_package, built_on):
    from lightning.pytorch.demos.boring_classes import BoringModel as LBoring
    from pytorch_lightning.demos.boring_classes import BoringModel as PLBoring

    data = TensorDataset(torch.randn(8, 32))
    datamodule = importlib.import_module(CLASSES[built_on]).PrefetchDataModule(data, data, batch_size=4)
    trainer = importlib.import_module(trainer_package).Trainer(strategy="mpi_allreduce", max_steps=1, **QUIET)
    model = LBoring() if trainer_package == "lightning.pytorch" else PLBoring()
    with pytest.raises(TypeError, match=rf"use `{CLASSES[trainer_package]}\.PrefetchDataModule`"):
        trainer.fit(model, datamodule=datamodule)
    datamodule.close()


def test_a_callback_of_the_other_package_works():
    # Lightning calls callback hooks by name, so LMSOffload built on pytorch_lightning runs in L.Trainer.
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    callback = lightning_mpi.LMSOffload(target="disk")
    L.Trainer(strategy="mpi_allreduce", max_steps=2, callbacks=[callback], **QUIET).fit(BoringModel())
    assert callback.last_stats is not None


PROGRAM = textwrap.dedent("""
    import json, sys, warnings
    import lightning_mpi
    before = sorted(m for m in ("torch", "lightning", "pytorch_lightning", "lightning_fabric") if m in sys.modules)
    import lightning as L
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # a class path with arguments fails inside jsonargparse, before any Trainer
            LightningCLI(BoringModel, run=False, save_config_callback=None, args=[
                "--trainer.strategy=lightning_mpi.EASGDStrategy", "--trainer.strategy.alpha=0.5"])
        except SystemExit as exit:
            code = exit.code
    hints = [str(w.message) for w in caught if "lightning_mpi" in str(w.message)]
    strategy = lightning_mpi.lightning.EASGDStrategy(alpha=0.5)  # the attribute, no import statement
    fabric = lightning_mpi.fabric.SyncStrategy
    print(json.dumps({"before": before, "code": code, "hints": hints, "class": type(strategy).__module__,
                      "fabric": fabric.__module__, "dir": "lightning" in dir(lightning_mpi)}))
""")


def test_a_lightning_program_reaches_the_submodules_and_hears_about_a_wrong_class_path():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        cwd=REPO,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["before"] == []  # import lightning_mpi imports neither torch nor Lightning
    assert seen["code"] == 2
    assert len(seen["hints"]) == 1 and "use `lightning_mpi.lightning.EASGDStrategy`" in seen["hints"][0]
    assert seen["class"] == "lightning_mpi.lightning" and seen["fabric"] == "lightning_mpi.fabric" and seen["dir"]
