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
from benchmarks import ttq_report  # noqa: E402
from benchmarks.ttq_report import (  # noqa: E402
    aggregate,
    effective_speedup,
    effective_speedup_fit,
    headline_arms,
    markdown,
    monotone_curve,
    summarize,
    time_to_reach,
)
from benchmarks.ttq_worker import exchange_bytes, parse_arm  # noqa: E402

ARM_FIELDS = {"curve", "final_loss", "seconds", "steps", "samples", "world", "params", "same_weights",
              "peak_exchange_bytes", "steps_per_rank", "status", "wall_seconds"}


@pytest.mark.mpi
@pytest.mark.timeout(420)
def test_smoke_run_writes_every_field_and_reports_a_missing_arm(tmp_path):
    out = tmp_path / "ttq.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "time_to_quality.py"), "--smoke", "--budget", "2",
         "--peer-factor", "1.5", "--margin", "150", "--arms", "local", "ddp_fp16", "mpi_asa16", "mpi_no_such_rule",
         "--out", str(out)],
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
    assert report["local"]["seconds"] >= 2 * 2  # local ran W x T, its curve the yardstick of the speedups
    assert summary["mpi_asa16"]["speedup"] > 0 and "ddp_fp16" in summary["mpi_asa16"]["vs_peers"]
    assert summary["mpi_no_such_rule"]["status"] == "not available"
    assert "| mpi_no_such_rule | not available" in out.with_suffix(".md").read_text()
    # the figure: test_plot_draws_every_arm_and_the_speedups (matplotlib is not in the test extra)


@pytest.mark.plots
def test_plot_draws_every_arm_and_the_speedups(tmp_path):
    local = _arm([(0, 5.0), (10, 4.0), (20, 3.0)], 2.0, 30.0, 300, 4800, world=1)
    results = {"ddp_fp16": _arm([(0, 5.0), (10.0, 4.5)], 4.2, 10.0, 20, 640),
               "mpi_x": _arm([(0, 5.0), (5.0, 3.5)], 3.0, 10.0, 50, 1600),
               "mpi_gone": {"status": "hung", "reason": "killed"}}
    summary = summarize(results, local, budget=10.0, peer_factor=1.0, local_runs=[local])
    report = {"args": {"budget": 10.0, "peer_factor": 1.0}, "local": local, "settings": {"shm:2": results},
              "summary": {"shm:2": summary}}
    path = tmp_path / "ttq_shm_2.png"
    ttq_report.plot(report, "shm:2", path)
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 1.5 * height  # two panels side by side: the curves and the speedup bars


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


def test_time_to_reach_interpolates_the_first_crossing():
    curve = [(0.0, 5.5), (2.0, 4.5), (4.0, 3.5), (6.0, 3.6), (8.0, 3.0)]
    assert time_to_reach(curve, 5.5) == 0.0 and time_to_reach(curve, 6.0) == 0.0
    assert time_to_reach(curve, 4.0) == pytest.approx(3.0)  # halfway between 4.5 at 2 s and 3.5 at 4 s
    assert time_to_reach(curve, 3.55) == pytest.approx(3.9)  # the first crossing, not the later one
    assert time_to_reach(curve, 3.0) == 8.0
    assert time_to_reach(curve, 2.9) is None and time_to_reach([], 1.0) is None


def test_effective_speedup_averages_the_local_runs_and_flags_a_lower_bound():
    fast = [(0.0, 5.0), (10.0, 4.0), (20.0, 3.0), (30.0, 2.0)]
    slow = [(0.0, 5.0), (10.0, 4.5), (20.0, 3.5), (30.0, 2.5)]
    assert effective_speedup(3.0, [fast], budget=10.0) == (pytest.approx(2.0), False)
    assert effective_speedup(3.0, [fast, slow], budget=10.0) == (pytest.approx((20.0 + 25.0) / 2 / 10.0), False)
    assert effective_speedup(5.5, [fast], budget=10.0) == (0.0, False)  # worse than the initial weights
    assert effective_speedup(1.0, [fast], budget=10.0) == (3.0, True)  # beyond the local run: at least 3
    with pytest.raises(ValueError, match="local"):
        effective_speedup(3.0, [], budget=10.0)


def test_the_monotone_fit_pools_the_local_runs_and_undoes_the_first_dips_bias():
    # one noisy local run: a dip to 3.0 at 10 s, back to 3.6, then a steady fall
    noisy = [(0.0, 5.0), (5.0, 4.0), (10.0, 3.0), (15.0, 3.6), (20.0, 3.4), (25.0, 3.2), (30.0, 2.6)]
    fit = monotone_curve([noisy])
    assert [t for t, _ in fit] == [t for t, _ in noisy]
    assert all(a >= b for (_, a), (_, b) in zip(fit, fit[1:], strict=False))  # never rises
    assert fit[2][1] == fit[3][1] == fit[4][1] == pytest.approx((3.0 + 3.6 + 3.4) / 3)  # the rise pooled
    assert fit[0][1] == 5.0 and fit[-1][1] == 2.6  # points already in order are kept
    # the raw first crossing of 3.2 lands in the dip (9 s); the fit's is after it
    assert effective_speedup(3.2, [noisy], budget=10.0) == (pytest.approx(0.9), False)
    fitted, bound = effective_speedup_fit(3.2, [noisy], budget=10.0)
    assert fitted == pytest.approx(2.5) and not bound
    # two runs are one fit of their pooled points (not an average of two fits)
    other = [(0.0, 5.0), (10.0, 3.4), (20.0, 3.2), (30.0, 3.0)]
    assert monotone_curve([noisy, other]) == monotone_curve([noisy + other])
    with pytest.raises(ValueError, match="local"):
        effective_speedup_fit(3.0, [], budget=10.0)


def test_aggregate_gives_mean_spread_and_count():
    assert aggregate([]) is None
    assert aggregate([2.0]) == {"mean": 2.0, "min": 2.0, "max": 2.0, "std": 0.0, "n": 1}
    a = aggregate([1.0, 2.0, 3.0])
    assert (a["mean"], a["min"], a["max"], a["n"]) == (2.0, 1.0, 3.0, 3) and a["std"] == pytest.approx(1.0)


def test_headline_arms_are_the_peers_auto_and_the_best_fixed_arm():
    results = {
        "ddp": _arm([(0, 5.5)], 4.0, 10.0, 20, 640),
        "ddp_fp16": _arm([(0, 5.5), (10.1, 3.9)], 3.0, 50.0, 20, 640),  # its loss in T is 3.9, not 3.0
        "ddp_powersgd1": _arm([(0, 5.5)], 3.7, 10.0, 20, 640),
        "ddp_powersgd4": _arm([(0, 5.5)], 3.8, 10.0, 20, 640),
        "mpi_auto": _arm([(0, 5.5)], 3.5, 10.0, 20, 640),
        "mpi_diloco": _arm([(0, 5.5)], 3.3, 10.0, 20, 640),
        "mpi_diloco:period=20": _arm([(0, 5.5)], 3.2, 10.0, 20, 640),
        "mpi_streaming_diloco": {"status": "failed", "reason": "x"},
    }
    assert headline_arms(results, budget=10.0) == ["ddp_fp16", "ddp_powersgd1", "mpi_auto", "mpi_diloco:period=20"]


def test_summary_gives_effective_speedups_their_spread_and_the_ratio_to_each_peer():
    local = [_arm([(0, 5.0), (10, 4.0), (20, 3.0)], 2.0, 30.0, 300, 4800, world=1),
             _arm([(0, 5.0), (10, 4.0), (20, 3.0)], 2.5, 30.0, 300, 4800, world=1)]
    results = {"ddp_fp16": _arm([(0, 5.0), (10.0, 4.5)], 4.2, 10.0, 20, 640),
               "mpi_x": _arm([(0, 5.0)], 3.0, 10.0, 50, 1600),
               "mpi_y": _arm([(0, 5.0)], 1.0, 10.0, 50, 1600)}
    repeats = {"mpi_x": [_arm([(0, 5.0)], 3.5, 10.0, 50, 1600), {"status": "hung", "reason": "killed"}]}
    s = summarize(results, local[0], budget=10.0, peer_factor=1.0, repeats=repeats, local_runs=local)
    assert s["ddp_fp16"]["speedup"] == pytest.approx(0.5)  # 4.5 at T: local is there at 5 s
    x = s["mpi_x"]
    assert x["speedup_runs"]["n"] == 2 and x["failed_runs"] == 1
    assert x["speedup_runs"]["max"] == pytest.approx(2.0) and x["speedup_runs"]["min"] == pytest.approx(1.5)
    assert x["speedup"] == pytest.approx(1.75) and x["loss_T_runs"]["mean"] == pytest.approx(3.25)
    assert x["vs_peers"] == {"ddp_fp16": pytest.approx(3.5)} and x["speedup_lower_bound"] is False
    assert s["mpi_y"]["speedup_lower_bound"] is True and s["mpi_y"]["speedup"] == pytest.approx(3.0)
    ref = s["_reference"]
    assert ref["world"] == 2 and ref["peer_bound"] == {"ddp_fp16": pytest.approx(4.0)}
    # an arm run is measured against the local runs of its own invocation (the same load) when there are any
    fast = _arm([(0, 5.0), (10, 3.0)], 2.0, 20.0, 300, 4800, world=1)
    paired = summarize({"mpi_x": {**results["mpi_x"], "invocation": "b"}}, local[0], budget=10.0, peer_factor=1.0,
                       local_runs=[{**local[0], "invocation": "a"}, {**fast, "invocation": "b"}])
    assert paired["mpi_x"]["speedup"] == pytest.approx(1.0)  # fast local reaches 3.0 at 10 s; "a" would say 2.0
    assert ref["local"]["loss_T"] == 4.0 and ref["local"]["loss_last_runs"]["mean"] == pytest.approx(2.25)
    text = markdown({"args": {"budget": 10.0, "peer_factor": 1.0, "batch": 16}, "created": "now", "total_seconds": 60,
                     "load": {"hosts:2:1gbit": "1.00 1.00 1.00"}, "summary": {"hosts:2:1gbit": s}})
    assert "| mpi_x | 3.250 [3.000, 3.500] (2 runs) (1 run(s) failed) | 1.75 [1.50, 2.00] (2 runs) |" in text
    assert x["speedup_fit_runs"]["n"] == 2 and x["speedup_fit"] == pytest.approx(1.75)  # monotone local: the same
    assert "| mpi_y | 1.000 | ≥ 3.00 | ≥ 3.00 |" in text and "x ddp_fp16 (≤ 4.0)" in text and "| mpi_x | 3.50 |" in text


def test_a_later_run_adds_its_runs_to_an_earlier_report():
    old = {"args": {}, "task": {}, "commands": ["a"], "total_seconds": 10.0, "load": {"local": "1", "shm:2": "2"},
           "local_runs": ["L1"],
           "settings": {"shm:2": {"x": {"r": "x1"}, "y": {"r": "y1"}, "n": {"status": "not available"}}},
           "repeats": {"shm:2": {"x": [{"r": "x2"}]}}}
    new = {"created": "now", "commands": ["b"], "total_seconds": 5.0, "load": {"shm:2": "3", "hosts:2:1gbit": "4"},
           "local_runs": ["L2"], "settings": {"shm:2": {"x": {"r": "x3"}, "z": {"r": "z1"}, "n": {"r": "n1"}},
                                              "hosts:2:1gbit": {"x": {"r": "h1"}}},
           "repeats": {"shm:2": {"z": [{"r": "z2"}], "x": [{"r": "x4"}]}, "hosts:2:1gbit": {}}}
    m = ttq.merge_reports(old, new)
    assert m["local_runs"] == ["L1", "L2"] and m["commands"] == ["a", "b"] and m["total_seconds"] == 15.0
    assert m["settings"]["shm:2"] == {"x": {"r": "x1"}, "y": {"r": "y1"}, "z": {"r": "z1"}, "n": {"r": "n1"}}
    assert m["settings"]["hosts:2:1gbit"] == {"x": {"r": "h1"}}
    assert m["repeats"]["shm:2"] == {"x": [{"r": "x2"}, {"r": "x3"}, {"r": "x4"}], "z": [{"r": "z2"}], "n": []}
    assert m["load"] == {"local": "1", "shm:2": "2, then 3", "hosts:2:1gbit": "4"}
    assert old["repeats"]["shm:2"]["x"] == [{"r": "x2"}] and "z" not in old["settings"]["shm:2"]  # old unchanged


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


def test_a_hung_arm_keeps_each_ranks_stacks(tmp_path):
    (tmp_path / "stacks.1").write_text("Thread 0x2 ... in measure")
    (tmp_path / "stacks.0").write_text("Thread 0x1 ... in _dry_runs")
    (tmp_path / "progress.json").write_text("{}")
    assert ttq._stacks(tmp_path) == {"0": "Thread 0x1 ... in _dry_runs", "1": "Thread 0x2 ... in measure"}
