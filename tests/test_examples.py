"""Smoke tests: the examples run end to end under mpiexec and learn."""
import re

import pytest

from tests.mpi_utils import REPO, run_mpi


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_digits_example_trains_on_two_ranks(tmp_path):
    result = run_mpi(
        2,
        [str(REPO / "examples" / "digits.py"), "fit", "--trainer.strategy=mpi_asa16", "--trainer.max_epochs=4",
         "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"],
        timeout=200,
        cwd=tmp_path,
    )
    match = re.search(r"final val_acc=([0-9.]+) world_size=2", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) > 0.85


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_straggler_example_async_rule_keeps_fast_rank_busy(tmp_path):
    result = run_mpi(
        2,
        [str(REPO / "examples" / "straggler.py"), "--strategies", "mpi_adag,mpi_asa", "--seconds", "6"],
        timeout=220,
        cwd=tmp_path,
    )
    rows = {}
    for m in re.finditer(r"^(mpi_\w+)\s+budget=6s samples per rank=\[(\d+), (\d+)\] total=\d+ val_acc=([0-9.]+)$",
                         result.stdout, re.M):
        rows[m.group(1)] = (int(m.group(2)), int(m.group(3)), float(m.group(4)))
    assert set(rows) == {"mpi_adag", "mpi_asa"}, result.stdout[-2000:]
    fast, slow, acc = rows["mpi_adag"]
    assert fast > 1.3 * slow, f"async: the fast rank should not wait for the straggler: {rows}"
    assert acc > 0.5, rows
    fast, slow, acc = rows["mpi_asa"]
    assert fast == slow, f"sync: every step is a barrier, so both ranks process the same samples: {rows}"
    assert acc > 0.5, rows


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_config_file_example_trains_on_two_ranks(tmp_path):
    result = run_mpi(
        2,
        [str(REPO / "examples" / "digits.py"), "fit", "--config", str(REPO / "examples" / "configs" / "digits_easgd.yaml"),
         "--trainer.max_epochs=3", f"--trainer.default_root_dir={tmp_path}"],
        timeout=200,
        cwd=tmp_path,
    )
    assert "strategy=EASGDStrategy rule=easgd period=2 alpha=0.4" in result.stdout, result.stdout[-2000:]
    match = re.search(r"final val_acc=([0-9.]+) world_size=2", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) > 0.5


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_segmentation3d_example_offloads_under_mpi_asa(tmp_path):
    result = run_mpi(
        2,
        [str(REPO / "examples" / "segmentation3d.py"), "--side", "16", "--epochs", "1", "--train-size", "8"],
        timeout=200,
        cwd=tmp_path,
    )
    match = re.search(r"world_size=2 strategy=mpi_asa offload=\w+ .*offloaded_per_step=([0-9.]+) MiB", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) > 0  # the callback really moved saved activations out


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["mpi_asa16", "mpi_gosgd"])
def test_fabric_example_trains_on_two_ranks(tmp_path, strategy):
    checkpoint = tmp_path / "digits.ckpt"
    result = run_mpi(
        2,
        [str(REPO / "examples" / "fabric_digits.py"), "--strategy", strategy, "--epochs", "6", "--accumulate", "2",
         "--checkpoint", str(checkpoint)],
        timeout=200,
        cwd=tmp_path,
    )
    final = [line for line in result.stdout.splitlines() if line.startswith("final accuracy")]
    assert len(final) == 1, result.stdout  # rank 0 prints, once
    assert float(final[0].split()[-1]) > 0.8, result.stdout
    import torch

    saved = torch.load(checkpoint, weights_only=False)
    assert {"model", "optimizer"} <= set(saved)
    assert "lightning_mpi" in saved  # saved after finish_training: the final weights and the rule's end state (README)
