"""Fixtures of the launcher tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Tests run as if outside a Slurm allocation (so CI under Slurm picks mpiexec too);
    the Slurm tests set the variables themselves."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.fixture
def script(tmp_path) -> Path:
    """A rank script that leaves a marker file, so a test can tell whether it ran."""
    path = tmp_path / "job.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path
