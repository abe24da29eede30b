"""benchmarks/ttq_fixed_steps.py: one process's JSON line with its step time, its CPU per step and
the held-out loss; and the per-step reading of two ``getrusage`` samples."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.mpi_utils import REPO, mpi_env


@pytest.mark.timeout(180)
def test_a_short_local_run_prints_its_step_time_cpu_and_loss(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ttq_fixed_steps.py"), "local", "14", "--marks", "12",
         "--data", str(tmp_path / "data.pt")],
        env=mpi_env(), capture_output=True, text=True, timeout=160, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["arm"] == "local" and line["steps"] == 14
    assert line["step_ms"] > 0 and line["user_ms"] > 0 and line["sys_ms"] >= 0 and line["page_faults"] >= 0
    assert 0 < line["final_loss"] < 6 and set(line["marks"]) == {"12"}


def test_usage_per_step_divides_the_difference_of_two_readings():
    sys.path.insert(0, str(REPO))
    from benchmarks.ttq_fixed_steps import usage_per_step

    first = SimpleNamespace(ru_utime=1.0, ru_stime=0.5, ru_minflt=100, ru_majflt=1)
    last = SimpleNamespace(ru_utime=1.8, ru_stime=0.7, ru_minflt=500, ru_majflt=5)
    assert usage_per_step([first, last], 4) == {"user_ms": 200.0, "sys_ms": 50.0, "page_faults": 101}
    assert usage_per_step([first], 4) == {}  # a run too short for the second reading
