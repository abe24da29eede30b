"""benchmarks/rule_overhead.py on 2 ranks: one JSON line with every rank's figures, and a clear
error for an arm it does not measure."""
import json
import subprocess
import sys

import pytest

from tests.mpi_utils import REPO, mpi_env, mpiexec_command


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_rule_overhead_prints_both_ranks_blocks_with_and_without_the_hooks():
    result = subprocess.run(
        mpiexec_command(2, [str(REPO / "benchmarks" / "rule_overhead.py"),
                            "mpi_streaming_diloco:period=8,fragments=2,overlap_steps=1", "--blocks", "1", "--block", "9"]),
        env=mpi_env(), capture_output=True, text=True, timeout=220, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["ranks"] == 2 and line["blocks"] == 1 and line["block"] == 9
    for key in ("with_hooks_ms", "without_ms", "overhead_ms", "overhead_spread_ms"):
        assert len(line[key]) == 2, key
    assert all(ms > 0 for ms in line["with_hooks_ms"] + line["without_ms"])


@pytest.mark.timeout(120)
def test_rule_overhead_names_the_arms_it_measures():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rule_overhead.py"), "mpi_asa16"],
                            env=mpi_env(), capture_output=True, text=True, timeout=100, cwd=REPO)
    assert result.returncode == 2 and "arm='mpi_asa16': choose one of" in result.stderr
