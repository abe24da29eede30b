"""LMSOffload under the mpi_asa strategy on two ranks: same weights, no files left."""
from __future__ import annotations

import json

import pytest

from tests.mpi_utils import run_mpi_code


def _mpi_asa_registered() -> bool:
    import lightning_mpi  # noqa: F401  (importing registers the strategies)
    from pytorch_lightning.strategies import StrategyRegistry

    return "mpi_asa" in StrategyRegistry


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_with_mpi_asa_on_two_ranks(tmp_path):
    if not _mpi_asa_registered():
        pytest.skip("strategy 'mpi_asa' is not registered yet (lightning_mpi.strategy has not landed)")
    spill = tmp_path / "spill"
    code = f"""
    import hashlib, json, os
    import torch
    import lightning_mpi
    import pytorch_lightning as pl
    from mpi4py import MPI
    from lightning_mpi.offload import LMSOffload
    from tests.offload.helpers import TinyUNet3d, volume_loader, SEED
    from tests.quiet_trainer import QUIET_NO_VAL

    torch.set_num_threads(1)
    def run(callbacks):
        pl.seed_everything(SEED, verbose=False)
        model = TinyUNet3d()
        trainer = pl.Trainer(strategy="mpi_asa", accelerator="cpu", max_steps=3, callbacks=callbacks,
                             **QUIET_NO_VAL)
        trainer.fit(model, volume_loader())
        # Parameters: BatchNorm running stats are per-rank (each rank normalises its own shard).
        blob = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        return hashlib.sha256(blob).hexdigest()

    plain = run([])
    lms = LMSOffload(target="disk", directory={str(spill)!r}, min_bytes=4096, keep_last=1)
    offloaded = run([lms])
    rank = MPI.COMM_WORLD.Get_rank()
    with open(f"result_{{rank}}.json", "w") as f:  # a file per rank: stdout lines of ranks interleave
        json.dump(dict(rank=rank, plain=plain, offloaded=offloaded, bytes=lms.last_stats.offloaded_bytes,
                       left=os.listdir({str(spill)!r})), f)
    """
    result = run_mpi_code(2, code, tmp_path, timeout=150)
    files = sorted(tmp_path.glob("result_*.json"))
    assert len(files) == 2, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(f.read_text()) for f in files]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert rows[0]["plain"] == rows[1]["plain"]  # the strategy keeps ranks in step
    assert all(r["offloaded"] == r["plain"] for r in rows)  # and offloading changes nothing
    assert all(r["bytes"] > 0 and r["left"] == [] for r in rows)
