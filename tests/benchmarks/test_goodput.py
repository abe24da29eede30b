"""benchmarks/goodput.py's pure parts: the kill schedule, the progress parsing, the useful-samples
and goodput arithmetic, the commands and the table. No launches."""

import sys

import pytest

from tests.mpi_utils import REPO

sys.path.insert(0, str(REPO))

from benchmarks import goodput as g  # noqa: E402


def test_kills_are_due_every_period_from_the_first_step_and_a_late_one_delays_the_next():
    assert g.next_kill_at(100.0, 20.0, []) == 120.0
    assert g.next_kill_at(100.0, 20.0, [120.1]) == 140.0
    # the second kill had to wait for a restart until 155: the third is due at 165, not 160
    assert g.next_kill_at(100.0, 20.0, [120.1, 155.0]) == 165.0


def test_progress_lines_parse_and_a_line_cut_short_is_skipped():
    text = "10.5 1 3 77\n10.6 2 3 77\n10.7 3 3\n"
    assert g.parse_progress(text) == [(10.5, 1, 3, 77), (10.6, 2, 3, 77)]
    assert g.parse_progress("") == []
    assert g.parse_progress("x 1 2 3\n") == []


def test_useful_samples_count_steps_once_after_a_restart_and_follow_the_world_size():
    # W = 3, batch 2: steps 1..4, killed, resumed from the checkpoint at step 2, then steps 3..5
    entries = [(0, 1, 3, 1), (1, 2, 3, 1), (2, 3, 3, 1), (3, 4, 3, 1), (9, 3, 3, 2), (10, 4, 3, 2), (11, 5, 3, 2)]
    curve = g.useful_curve(entries, batch=2)
    assert [n for _, n in curve] == [6, 12, 18, 24, 18, 24, 30]
    summary = g.summarize(entries, batch=2)
    assert summary["final_step"] == 5 and summary["useful_samples"] == 30  # 5 steps x 3 ranks x 2
    assert summary["seconds"] == 11 and summary["rate"] == 30 / 11
    # a shrink from 3 to 2 ranks after step 2: later steps train smaller global batches
    shrunk = g.summarize([(0, 1, 3, 1), (1, 2, 3, 1), (2, 3, 2, 1), (4, 4, 2, 1)], batch=2)
    assert shrunk["useful_samples"] == 6 + 6 + 4 + 4 and shrunk["world_sizes"] == [3, 2]
    assert g.summarize([], batch=2)["rate"] == 0.0
    # a budget: the steps logged after its end are left out, the seconds are the budget's
    cut = g.summarize(entries, batch=2, end=9.5)
    assert cut["final_step"] == 3 and cut["useful_samples"] == 18 and cut["seconds"] == 9.5


def test_the_pre_fault_rate_is_the_rate_up_to_the_last_step_before_the_first_kill():
    entries = [(0, 1, 3, 1), (1, 2, 3, 1), (2, 3, 3, 1), (9, 3, 3, 2)]
    assert g.pre_fault_rate(entries, batch=2, kills=[2.5, 5.0]) == 12 / 2  # steps 2 and 3 over 2 s
    assert g.pre_fault_rate(entries, batch=2, kills=[]) is None
    assert g.pre_fault_rate(entries, batch=2, kills=[0.5]) is None


def test_recovery_times_the_next_step_and_the_first_step_past_the_one_reached_at_the_kill():
    entries = [(0, 1, 3, 1), (1, 2, 3, 1), (2, 3, 3, 1), (9, 2, 3, 2), (10, 3, 3, 2), (11, 4, 3, 2)]
    assert g.recovery(entries, [2.5]) == [{"resume": 6.5, "regain": 8.5}]  # resumed at 2, past 3 at 4
    healed = [(0, 1, 3, 1), (1, 2, 3, 1), (1.5, 3, 2, 1)]
    assert g.recovery(healed, [1.2]) == [{"resume": pytest.approx(0.3), "regain": pytest.approx(0.3)}]
    assert g.recovery(entries, [20.0]) == [{"resume": None, "regain": None}]
    # rank 0 finished step 4 just after the kill, then the job died and resumed from step 2
    in_flight = [(0, 1, 3, 1), (1, 2, 3, 1), (2, 3, 3, 1), (2.51, 4, 3, 1), (9, 3, 3, 2), (10, 4, 3, 2), (11, 5, 3, 2)]
    assert g.recovery(in_flight, [2.5]) == [{"resume": 6.5, "regain": 7.5}]  # past step 3, reached at the kill


def test_goodput_is_the_rate_over_the_baselines_and_the_time_lost_is_shared_by_the_kills():
    base = {"rate": 100.0, "seconds": 10.0, "useful_samples": 1000}
    arm = {"rate": 80.0, "seconds": 12.5, "useful_samples": 1000, "kills": [3.0, 8.0], "pre_fault_rate": 125.0}
    # 1000 samples at the pre-fault 125/s take 8 s: 4.5 s lost over 2 kills
    assert g.goodput(arm, base) == {"goodput": 0.8, "own_goodput": 0.64, "lost_per_fault": 2.25}
    assert g.goodput({**arm, "kills": [], "pre_fault_rate": None}, base)["lost_per_fault"] is None
    assert g.goodput(arm, {"rate": 0.0})["goodput"] is None


def test_commands_name_the_launcher_and_the_arm_options(tmp_path):
    s = g.Settings()
    heal = g.command(g.ARMS["heal_replace"], s, tmp_path)
    assert heal[heal.index("--steps") + 1] == str(g.MAX_STEPS)  # the budget stops the job, not max_steps
    assert heal[1:6] == ["-m", "lightning_mpi", "-n", "3", "--heal"] and heal[-2:] == ["--heal", "replace"]
    assert "--spares" not in heal
    spares = g.command(g.ARMS["heal_replace_spares"], s, tmp_path)
    assert spares[1:8] == ["-m", "lightning_mpi", "-n", "3", "--heal", "--spares", "2"]
    restarts = g.command(g.ARMS["mpi_restarts"], s, tmp_path)
    assert "--max-restarts" in restarts and "--heal" not in restarts
    ddp = g.command(g.ARMS["ddp_torchrun"], s, tmp_path)
    assert ddp[1:3] == ["-m", "torch.distributed.run"] and "--max-restarts" in ddp and "ddp" in ddp
    assert "--max-restarts" not in g.command(g.ARMS["ddp"], s, tmp_path)
    assert all(g.ARMS[a.baseline].baseline is None for a in g.ARMS.values() if a.baseline)


def test_the_target_is_a_live_nonzero_rank_under_the_launcher(tmp_path):
    (tmp_path / "pids").mkdir()
    for pid, rank in ((11, 0), (12, 1), (13, 2), (14, 2)):
        (tmp_path / "pids" / str(pid)).write_text(str(rank))
    assert g.pick_target(tmp_path, {11: 0, 12: 0, 13: 0}) == 13  # 14 is not (or no longer) running
    assert g.pick_target(tmp_path, {11: 0}) is None  # never rank 0


def test_the_table_reports_a_missing_arm_and_the_goodput():
    results = {
        "mpi": {
            "status": "ok",
            "wall": 50.0,
            "final_step": 10,
            "world_sizes": [3],
            "useful_samples": 960,
            "rate": 24.0,
            "kills": [],
        },
        "mpi_restarts": {
            "status": "ok",
            "wall": 60.0,
            "final_step": 10,
            "world_sizes": [3],
            "useful_samples": 960,
            "rate": 20.0,
            "kills": [1.0],
            "goodput": 20 / 24,
            "own_goodput": 0.9,
            "lost_per_fault": 8.0,
            "baseline": "mpi",
            "recovery": [{"resume": 6.0, "regain": None}],
        },
        "heal_shrink": {"status": "not available", "reason": "SyncStrategy takes no heal= argument"},
    }
    text = g.table(results)
    assert "| mpi | ok | 0 | 50.0 | 10 | 3 | 960 | 24 | baseline | - | - | - | - |" in text
    assert "83.3% (of mpi) | 90.0% | 8.0 | 6.0 | never |" in text
    assert "not available in this checkout: SyncStrategy takes no heal= argument" in text
