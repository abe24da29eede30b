"""benchmarks/step_timeline.py runs end to end and its events are consistent (a smoke test, not a
timing assertion): both ``ddp`` (timed through a DDP comm hook) and ``mpi_allreduce`` (timed by
wrapping the exchanger) report every bucket's launch and arrival inside the step."""
import re
import subprocess
import sys

import pytest

from tests.mpi_utils import REPO, mpi_env


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_step_timeline_times_every_bucket_of_ddp_and_mpi_allreduce():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "step_timeline.py"), "--settings", "shm:2",
         "--strategies", "ddp", "mpi_allreduce", "--steps", "6", "--timeout", "200"],
        env=mpi_env({"GLOO_SOCKET_IFNAME": "lo"}), capture_output=True, text=True, timeout=230, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0] != "event" and re.fullmatch(r"[a-z_]+\d*", cells[0]):
            rows[cells[0]] = [None if c == "-" else float(c) for c in cells[1:]]
    assert "launch0" in rows and "arrive0" in rows, result.stdout
    for column in (0, 1):  # ddp, mpi_allreduce
        value = {k: v[column] for k, v in rows.items() if v[column] is not None}
        buckets = sorted(k for k in value if k.startswith("launch"))
        assert len(buckets) >= 2, value  # 71 MB of gradients in 25 MiB buckets
        for launch in buckets:
            arrive = "arrive" + launch.removeprefix("launch")
            assert value["first_launch"] <= value[launch] < value[arrive] <= value["last_arrival"], value
        assert value["backward_start"] <= value["first_launch"], value
        assert value["last_arrival"] <= value["optimizer_start"] <= value["step_end"], value
