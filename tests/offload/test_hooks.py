"""LMSOffloadHooks without Lightning: the offload package imports none, and the hooks run on any
trainer and module that offer Lightning's common API."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_mpi

PACKAGE_DIR = Path(lightning_mpi.__file__).parent

# Run in a fresh interpreter where Lightning cannot be imported. `lightning_mpi` is stood in for by
# an empty package with the real path, so that its __init__ (which registers strategies with
# Lightning) does not run: what is checked is the offload package alone.
_WITHOUT_LIGHTNING = """
import importlib.abc, sys, types

class BlockLightning(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytorch_lightning", "lightning", "lightning_fabric"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, BlockLightning())
package = types.ModuleType("lightning_mpi")
package.__path__ = [PACKAGE_DIR]
sys.modules["lightning_mpi"] = package
"""


def _run_without_lightning(code: str) -> subprocess.CompletedProcess:
    prelude = _WITHOUT_LIGHTNING.replace("PACKAGE_DIR", repr(str(PACKAGE_DIR)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.timeout(90)
def test_no_offload_module_imports_lightning():
    # lightning_mpi.LMSOffload (alias lightning_mpi.offload.LMSOffload) is built by the strategy layer.
    modules = sorted(p.stem for p in (PACKAGE_DIR / "offload").glob("*.py") if p.stem != "__init__")
    assert {"hooks", "session", "pool", "tiers", "disk", "tensors"} <= set(modules)
    result = _run_without_lightning(
        f"""
        import importlib
        import lightning_mpi.offload
        for name in {modules!r}:
            importlib.import_module("lightning_mpi.offload." + name)
        try:
            import pytorch_lightning
        except ImportError as error:
            print("callback:", error)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "callback: pytorch_lightning is blocked" in result.stdout  # the blocker really works


@pytest.mark.timeout(90)
def test_hooks_offload_a_step_for_a_trainer_and_module_without_lightning(tmp_path):
    result = _run_without_lightning(
        f"""
        import torch
        from lightning_mpi.offload import LMSOffloadHooks

        class Module(torch.nn.Module):  # what the hooks use of a LightningModule
            device = torch.device("cpu")
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(256, 256)
                self.logged = {{}}
            def log_dict(self, metrics, **kwargs):
                self.logged.update(metrics)

        class Trainer:  # what the hooks use of a Trainer
            global_rank = 0

        trainer, module = Trainer(), Module()
        hooks = LMSOffloadHooks(target="disk", directory={str(tmp_path)!r}, min_bytes=1024, keep_last=0)
        hooks.setup(trainer, module, "fit")
        x = torch.randn(64, 256)
        expected = None
        for step in range(2):
            hooks.on_train_batch_start(trainer, module, x, step)
            loss = module.lin(module.lin(x).tanh()).tanh().sum()
            hooks.on_before_backward(trainer, module, loss)
            loss.backward()
            hooks.on_train_batch_end(trainer, module, loss, x, step)
        hooks.on_train_epoch_end(trainer, module)
        hooks.teardown(trainer, module, "fit")
        assert hooks.last_stats.offloaded_tensors >= 2, hooks.last_stats
        assert module.logged["lms/offloaded_bytes"] == hooks.last_stats.offloaded_bytes
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_hooks_warn_once_when_saved_tensors_were_captured_in_a_cuda_graph(tmp_path, monkeypatch):
    import warnings

    import torch

    import lightning_mpi.offload.session as session_module
    from lightning_mpi.offload import LMSOffloadHooks

    class Module(torch.nn.Module):
        device = torch.device("cpu")

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(256, 256)

    class Trainer:
        global_rank = 0

    monkeypatch.setattr(session_module, "_in_cuda_graph_capture", lambda t: True)
    trainer, module = Trainer(), Module()
    hooks = LMSOffloadHooks(target="disk", directory=tmp_path, min_bytes=1024, keep_last=0, log_stats=False)
    hooks.setup(trainer, module, "fit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            hooks.on_train_batch_start(trainer, module, None, step)
            module.lin(torch.randn(64, 256)).tanh().sum().backward()
            hooks.on_train_batch_end(trainer, module, None, None, step)
    hooks.teardown(trainer, module, "fit")
    mine = [w for w in caught if "CUDA graph" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert hooks.last_stats.captured_tensors >= 1 and hooks.last_stats.offloaded_tensors == 0
