"""benchmarks/time_to_quality.py: its smoke mode runs end to end and writes every field the tables
need (no timing is asserted); the summary's arithmetic; a hung job is killed with its children."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.mpi_utils import REPO, mpi_env

sys.path.insert(0, str(REPO))

from benchmarks import time_to_quality as ttq  # noqa: E402
from benchmarks.ttq_report import summarize  # noqa: E402
from benchmarks.ttq_worker import exchange_bytes, parse_arm  # noqa: E402

ARM_FIELDS = {"curve", "final_loss", "seconds", "steps", "samples", "world", "params", "same_weights",
              "peak_exchange_bytes", "steps_per_rank", "status", "wall_seconds"}


@pytest.mark.mpi
@pytest.mark.timeout(420)
def test_smoke_run_writes_every_field_and_reports_a_missing_arm(tmp_path):
    out = tmp_path / "ttq.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "time_to_quality.py"), "--smoke", "--budget", "2",
         "--peer-factor", "1.5", "--arms", "local", "ddp_fp16", "mpi_asa16", "mpi_no_such_rule", "--out", str(out)],
        env=mpi_env(), capture_output=True, text=True, timeout=400, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["local"]["status"] == "ok" and ARM_FIELDS <= set(report["local"])
    arms = report["settings"]["shm:2"]
    assert arms["mpi_no_such_rule"]["status"] == "not available"
    for arm in ("ddp_fp16", "mpi_asa16"):
        r = arms[arm]
        assert r["status"] == "ok", r
        assert ARM_FIELDS <= set(r), set(r)
        assert r["world"] == 2 and len(r["steps_per_rank"]) == 2 and r["same_weights"] is True
        assert r["curve"][0]["t"] == 0 and r["curve"][0]["steps"] == 0
        assert all(a["t"] <= b["t"] for a, b in zip(r["curve"], r["curve"][1:]))
        assert 0 < r["final_loss"] < 6.0  # below nothing learnt would be ln 256 = 5.55 plus init noise
    assert arms["ddp_fp16"]["seconds"] >= 1.5 * 2  # the long peer ran peer_factor x T
    assert arms["mpi_asa16"]["peak_exchange_bytes"] > 0  # its rule reports wire bytes
    summary = report["summary"]["shm:2"]
    assert summary["mpi_asa16"]["samples_vs_local"] > 0
    assert summary["mpi_no_such_rule"]["status"] == "not available"
    assert "| mpi_no_such_rule | not available" in out.with_suffix(".md").read_text()
    assert (tmp_path / "ttq_shm_2.png").exists()


def test_arm_specs_and_exchange_bytes():
    assert parse_arm("mpi_diloco") == ("mpi_diloco", {})
    assert parse_arm("mpi_diloco:period=20,wire=int8") == ("mpi_diloco", {"period": 20, "wire": "int8"})
    with pytest.raises(ValueError, match="arm="):
        parse_arm("mpi_diloco:period")
    assert exchange_bytes({"wire_bytes": 10.0, "exchange_seconds": 1.0}) == 10.0
    assert exchange_bytes({"dense_bytes": 99.0, "fragment_bytes": 7.0}) == 7.0
    assert exchange_bytes({"averages": 3.0}) is None
    assert ttq.snapshot_marks(100.0, 20.0)[:3] == [10.0, 20.0, 30.0] and 60.0 in ttq.snapshot_marks(100.0, 20.0)
    assert max(ttq.snapshot_marks(20.0, 20.0)) < 20.0


def _arm(curve, final, seconds, steps, samples, world=2):
    return {"status": "ok", "curve": [{"t": t, "loss": loss} for t, loss in curve], "final_loss": final,
            "seconds": seconds, "steps": steps, "samples": samples, "world": world, "same_weights": True}


def test_summary_reads_losses_times_and_rates_off_the_curves():
    local = _arm([(0, 5.5)], 3.0, 10.0, 100, 1600, world=1)
    results = {
        "ddp": _arm([(0, 5.5), (5, 4.5)], 4.0, 10.0, 20, 640),
        "ddp_fp16": _arm([(0, 5.5), (10.2, 3.9), (30.1, 3.5)], 3.2, 50.0, 200, 6400),
        "mpi_x": _arm([(0, 5.5), (4, 3.95)], 3.4, 10.0, 50, 1600),
        "mpi_y": {"status": "hung", "reason": "killed"},
    }
    s = summarize(results, local, budget=10.0, peer_factor=5.0)
    assert s["_reference"]["ddp_best_loss_in_T"] == 4.0
    assert s["ddp_fp16"]["loss_T"] == 3.9  # its curve's point at T, not its final loss at 5T
    assert s["mpi_x"]["loss_T"] == 3.4 and s["mpi_x"]["time_to_ddp_best"] == 4
    assert s["ddp"]["time_to_ddp_best"] == 10.0
    assert s["mpi_x"]["le_ddp_fp16_3T"] is True and s["mpi_x"]["le_ddp_fp16_last"] is False
    assert s["mpi_x"]["samples_vs_local"] == pytest.approx(1.0) and s["mpi_x"]["steps_vs_local"] == pytest.approx(0.5)
    assert s["mpi_y"] == {"status": "hung", "reason": "killed"}


def test_a_hung_job_is_killed_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        ttq._run_killable([sys.executable, "-c", script], dict(os.environ), timeout=3)
    assert time.monotonic() - start < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {grandchild} survived the kill")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that may never come counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
