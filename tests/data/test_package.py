"""Tests for the lightning_mpi.data package: its public names and where Lightning may be imported."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_mpi
import lightning_mpi.data
from tests.mpi_utils import REPO

pytestmark = pytest.mark.timeout(60)

DATA_DIR = REPO / "lightning_mpi" / "data"
LIGHTNING = ("pytorch_lightning", "lightning_fabric", "lightning")

# Imports the package's Lightning-free modules while any Lightning import raises. The stub
# stands in for lightning_mpi/__init__.py, which registers the strategies and so imports
# Lightning itself.
NO_LIGHTNING_SCRIPT = r"""
import importlib, importlib.abc, sys, types

BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("Lightning import blocked: " + name)

sys.meta_path.insert(0, Block())
package = types.ModuleType("lightning_mpi")
package.__path__ = [{package_dir!r}]
sys.modules["lightning_mpi"] = package
for name in {modules!r}:
    importlib.import_module(name)
data = sys.modules["lightning_mpi.data"]
for name in data.__all__:
    if name != "PrefetchDataModule":
        getattr(data, name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, loaded
try:  # the Lightning class is lightning_mpi.PrefetchDataModule's alias: the package alone cannot make it
    data.PrefetchDataModule
except (ImportError, AttributeError):
    pass
else:
    raise AssertionError("PrefetchDataModule imported without Lightning")
try:
    import pytorch_lightning
except ImportError as err:  # the blocker really works
    assert "Lightning import blocked" in str(err), err
print("OK")
"""


def lightning_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [n for n in names if n.split(".")[0] in LIGHTNING]
    return found


def test_no_data_module_imports_lightning_itself():
    # The DataModule class is built on the user's Lightning package by lightning_mpi.strategies.build.
    modules = sorted(DATA_DIR.glob("*.py"))
    assert {p.name for p in modules} >= {"sharding.py", "loader.py", "transforms.py", "hooks.py"}
    importers = {p.name: lightning_imports(p) for p in modules if lightning_imports(p)}
    assert importers == {}


def test_lightning_free_modules_import_without_lightning():
    modules = ["lightning_mpi.data"] + [
        f"lightning_mpi.data.{p.stem}" for p in sorted(DATA_DIR.glob("*.py")) if p.stem not in ("__init__", "module")
    ]
    script = NO_LIGHTNING_SCRIPT.format(blocked=LIGHTNING, package_dir=str(DATA_DIR.parent), modules=modules)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]


def test_public_names_resolve_to_one_class():
    from lightning_mpi.data import PrefetchDataHooks, PrefetchDataModule

    assert lightning_mpi.PrefetchDataModule is PrefetchDataModule
    assert issubclass(PrefetchDataModule, PrefetchDataHooks)
    for name in lightning_mpi.data.__all__:
        assert getattr(lightning_mpi.data, name).__name__ == name
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        lightning_mpi.data.NoSuchName  # noqa: B018


def test_datamodule_is_the_hooks_on_a_lightning_datamodule():
    import pytorch_lightning as pl

    from lightning_mpi.data import PrefetchDataHooks, PrefetchDataModule

    mro = PrefetchDataModule.__mro__
    # the hooks come first, so they override LightningDataModule's default hooks
    assert mro.index(PrefetchDataHooks) < mro.index(pl.LightningDataModule)
    assert PrefetchDataModule.__doc__ == PrefetchDataHooks.__doc__
    for hook in ("setup", "train_dataloader", "val_dataloader", "test_dataloader", "teardown", "on_exception"):
        assert getattr(PrefetchDataModule, hook) is getattr(PrefetchDataHooks, hook), hook
