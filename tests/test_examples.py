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
