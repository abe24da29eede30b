"""benchmarks/goodput.py's pure parts: the fault schedule, the option parsing, the run plan, the
progress parsing, the useful-samples and goodput arithmetic (torchft's lines too), the commands
(here and on simulated hosts), the end-of-run checks and the table. No launches: neither torchft,
nor MPI, nor namespaces."""

import sys
from pathlib import Path
from types import SimpleNamespace

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


def test_the_table_reports_every_arm_fault_and_rank_count():
    runs = [
        {
            "ranks": 3,
            "placement": "local",
            "arm": "mpi",
            "fault": None,
            "status": "ok",
            "verdict": "ok",
            "world_sizes": [3],
            "rate": 24.0,
            "kills": [],
            "steps_lost": 0,
            "replicas": {"identical": True, "finished": 3, "of": 3, "step": 40},
        },
        {
            "ranks": 3,
            "placement": "local",
            "arm": "mpi_restarts",
            "fault": "kill",
            "status": "ok",
            "verdict": "ok",
            "world_sizes": [3],
            "rate": 20.0,
            "kills": [1.0],
            "goodput": 20 / 24,
            "own_goodput": 0.9,
            "baseline": "mpi",
            "recovery": [{"resume": 6.0, "regain": None}],
            "steps_lost": 7,
            "replicas": {"identical": False, "finished": 3, "of": 3, "step": 40},
        },
        {
            "ranks": 8,
            "placement": "hosts",
            "arm": "heal_shrink",
            "fault": "partition",
            "status": "not available",
            "reason": "simulated cluster needs root",
        },
        {
            "ranks": 3,
            "placement": "local",
            "arm": "heal_shrink",
            "fault": "stop",
            "status": "ok",
            "verdict": "no step after the fault at 20 s (of 70 s)",
            "world_sizes": [3],
            "rate": 5.0,
            "kills": [20.0],
            "goodput": 0.2,
            "baseline": "mpi_heal",
            "recovery": [{"resume": None, "regain": None}],
            "replicas": {"identical": None, "finished": 0, "of": 3, "step": None},
        },
    ]
    text = g.table(runs)
    assert "| 3 | none | mpi | ok | 0 | 3 | 24 | baseline | - | - | - | 0 | yes (3 of 3) |" in text
    assert (
        "| 3 | kill | mpi_restarts | ok | 1 | 3 | 20 | 83.3% (of mpi) | 90.0% | 6.0 | never | 7 | NO (3 of 3) |" in text
    )
    assert "| 8 | partition | heal_shrink | not available: simulated cluster needs root |" in text
    assert "| no step after the fault at 20 s (of 70 s) |" in text and "| never | never | - | - |" in text


def test_fault_kinds_and_rank_counts_parse_and_bad_ones_are_refused():
    assert g.parse_faults("kill,stop,partition") == ("kill", "stop", "partition")
    assert g.parse_faults(" stop , kill,stop") == ("stop", "kill")
    for bad in ("", "kill,hang", "sigkill"):
        with pytest.raises(ValueError, match="--faults"):
            g.parse_faults(bad)
    assert g.parse_ranks("3") == (3,) and g.parse_ranks("3,8") == (3, 8)
    for bad in ("", "1", "3,x", "0,3"):
        with pytest.raises(ValueError, match="--ranks"):
            g.parse_ranks(bad)


def test_simulated_hosts_keep_a_majority_when_one_is_cut_off():
    assert g.host_layout(3) == (3, 1) and g.host_layout(2) == (2, 1)
    assert g.host_layout(8) == (4, 2) and g.host_layout(6) == (4, 2)
    for ranks in (3, 4, 5, 8, 16):
        hosts, per_host = g.host_layout(ranks)
        assert hosts * per_host >= ranks and per_host < ranks / 2  # one host is a minority
    assert [g.host_of_rank(8, r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [g.host_of_rank(3, r) for r in range(3)] == [0, 1, 2]


def test_the_plan_runs_each_baseline_before_its_faulted_arms_per_placement_and_rank_count():
    runs = g.plan(["torchft_ddp", "heal_shrink"], ("kill", "partition", "stop"), (3, 8))
    assert runs[:4] == [
        (3, "local", "mpi_heal", None),
        (3, "local", "heal_shrink", "kill"),
        (3, "local", "heal_shrink", "stop"),
        (3, "local", "torchft", None),
    ]
    assert runs[4:9] == [
        (3, "local", "torchft_ddp", "kill"),
        (3, "local", "torchft_ddp", "stop"),
        (3, "hosts", "mpi_heal", None),
        (3, "hosts", "heal_shrink", "partition"),
        (3, "hosts", "torchft", None),
    ]
    assert len(runs) == 20 and runs[10][0] == 8
    assert all(g.PLACEMENT[f] == p for _, p, _, f in runs if f)
    assert g.plan(["torchft_diloco"], ("kill",), (3,)) == [
        (3, "local", "torchft_dl", None),
        (3, "local", "torchft_diloco", "kill"),
    ]
    # --all-on-hosts: kills and hangs on the simulated hosts too, after one baseline there
    assert g.plan(["heal_shrink"], ("kill", "partition"), (8,), on_hosts=True) == [
        (8, "hosts", "mpi_heal", None),
        (8, "hosts", "heal_shrink", "kill"),
        (8, "hosts", "heal_shrink", "partition"),
    ]


def test_torchft_lines_count_the_participants_samples_and_diloco_syncs_count_every_inner_step():
    # torchft DDP: replica 0 logs the manager's committed steps and their participants; a replica
    # killed at step 3 leaves 2 participants until it heals at step 5
    ddp = [(0, 1, 3, 9), (1, 2, 3, 9), (2, 3, 3, 9), (3, 4, 2, 9), (4, 5, 3, 9)]
    assert [n for _, n in g.useful_curve(ddp, batch=2)] == [6, 12, 18, 22, 28]
    # DiLoCo, 10 inner steps per sync: a line advances 10 steps, each of its participants' batch
    diloco = [(0, 10, 3, 9), (1, 20, 3, 9), (2, 30, 2, 9)]
    assert [n for _, n in g.useful_curve(diloco, batch=2)] == [60, 120, 160]
    assert g.summarize(diloco, batch=2)["world_sizes"] == [3, 2]
    # steps torchft did not commit are lost; so are steps trained again after a restart
    discarded = g.parse_progress("5.5 4 1 9\n7.0 30 10 9\n")
    assert discarded == [(5.5, 4, 1, 9), (7.0, 30, 10, 9)]
    assert g.steps_lost(ddp, discarded) == 11
    restarted = [(0, 1, 3, 1), (1, 2, 3, 1), (2, 3, 3, 1), (3, 4, 3, 1), (9, 3, 3, 2), (10, 4, 3, 2)]
    assert g.steps_lost(restarted) == 2 and g.steps_lost([]) == 0


def test_the_step_in_flight_at_a_fault_is_not_the_recovery():
    # a step logged 3 ms after the fault (in flight), then a 5 s stall
    entries = [(0.0, 1, 3, 1), (0.1, 2, 3, 1), (0.2, 3, 3, 1), (0.203, 4, 3, 1), (5.2, 5, 2, 1), (5.3, 6, 2, 1)]
    assert g.step_time(entries, before=0.2) == pytest.approx(0.1)
    assert g.recovery(entries, [0.2])[0]["resume"] == pytest.approx(0.003)
    grace = 2 * g.step_time(entries, before=0.2)
    assert g.recovery(entries, [0.2], grace) == [{"resume": pytest.approx(5.0), "regain": pytest.approx(5.0)}]


def test_the_stop_step_lies_ahead_and_the_final_weights_are_compared():
    assert g.stop_step([(0, 1, 3, 1), (1, 17, 3, 1)], margin=30) == 47 and g.stop_step([]) == g.STOP_MARGIN
    same = ["0 47 abc\n", "1 47 abc\n", "2 47 abc\n"]
    assert g.replicas_identical(same, 3) == {"identical": True, "finished": 3, "of": 3, "step": 47}
    differ = ["0 47 abc", "1 47 abd", "2 40 abc", "garbage"]
    assert g.replicas_identical(differ, 3) == {"identical": False, "finished": 2, "of": 3, "step": 47}
    assert g.replicas_identical([], 2)["identical"] is None


def test_the_outcome_names_the_error_of_a_failed_job_and_a_job_that_never_trained_again():
    log = "lightning-mpi: 3 ranks\nTraceback (most recent call last):\n  File x\nRuntimeError: boom\nmpiexec noticed\n"
    assert g.error_line(log) == "RuntimeError: boom" and g.error_line("all fine\n") is None
    prte = "[sw:26693] plm:ssh: Warning: setpgid(26698,26698) failed in parent with errno=Permission denied(13)\n"
    assert g.error_line(prte) is None  # Open MPI's harmless warning on the simulated hosts
    failed = {"status": "the job failed (exit code 1)", "error": "RuntimeError: boom"}
    assert g.verdict(failed, 70) == "the job failed (exit code 1): RuntimeError: boom"
    hung = {"status": "ok", "kills": [20.0], "recovery": [{"resume": None, "regain": None}]}
    assert g.verdict(hung, 70) == "no step after the fault at 20 s (of 70 s)"
    twice = {"status": "ok", "kills": [20.0, 40.0], "recovery": [{"resume": None, "regain": None}] * 2}
    assert g.verdict(twice, 70) == "no step after the fault at 20 s (of 70 s)"  # the second hit a stuck job
    healed = {"status": "ok", "kills": [20.0], "recovery": [{"resume": 1.0, "regain": 2.0}], "last_step_at": 69.9}
    assert g.verdict(healed, 70) == "ok" and g.verdict({**healed, "end": "stopped"}, 70) == "ok"
    # one step right after the fault, then nothing: a stall, and the job died when asked to stop
    died = {**healed, "last_step_at": 20.2, "end": "the job failed (exit code 1)", "error": "RankFailedError: x"}
    assert (
        g.verdict(died, 70)
        == "stalled from 20 s (of 70 s); at the stop: the job failed (exit code 1): RankFailedError: x"
    )
    spares = (
        "NBC_Progress: an error 75\nlightning_mpi.comm.errors.RankFailedError: rank 2 failed\nrank 1 failed; aborting\n"
    )
    assert g.error_line(spares) == "lightning_mpi.comm.errors.RankFailedError: rank 2 failed"
    # why the side stopped, not the bare MPI error another process's traceback ended with later
    stopped = (
        "lightning_mpi.comm.errors.RunStopped: lightning_mpi: 1 of the 3 ranks remain here, fewer than min_ranks=2\n"
        "Traceback (most recent call last):\nmpi4py.MPI.Exception: MPI_ERR_PROC_FAILED: Process Failure\n"
    )
    assert g.error_line(stopped).startswith("lightning_mpi.comm.errors.RunStopped: lightning_mpi: 1 of the 3")


def test_the_target_skips_stopped_processes_and_cut_off_hosts(tmp_path):
    (tmp_path / "pids").mkdir()
    for pid, rank in ((11, 0), (12, 1), (13, 2)):
        (tmp_path / "pids" / str(pid)).write_text(str(rank))
    tree = {11: 0, 12: 0, 13: 0}
    assert g.pick_target(tmp_path, tree, exclude={13}) == 12
    assert g.pick_target(tmp_path, tree, exclude={12, 13}) is None
    assert g.rank_zero_pids(tmp_path) == {11}


def test_torchft_and_simulated_host_commands(tmp_path):
    s = g.Settings(ranks=8)
    ft = g.command(g.ARMS["torchft_ddp"], s, tmp_path)
    assert ft[1:4] == [str(g.TORCHFT), "supervise", str(tmp_path)] and ft[ft.index("--replicas") + 1] == "8"
    assert ft[ft.index("--algo") + 1] == "ddp" and "--hosts" not in ft
    diloco = g.command(g.ARMS["torchft_diloco"], s, tmp_path)
    assert diloco[diloco.index("--algo") + 1] == "diloco"
    cluster = SimpleNamespace(switch="sw", hosts=["h0", "h1", "h2", "h3"], _launch_dir=Path("/x"))
    ft = g.command(g.ARMS["torchft_ddp"], s, tmp_path, cluster)
    assert ft[:4] == ["ip", "netns", "exec", "sw"]
    assert ft[ft.index("--hosts") + 1] == "h0,h0,h1,h1,h2,h2,h3,h3" and ft[ft.index("--lighthouse-host") + 1] == "sw"
    heal = g.command(g.ARMS["heal_shrink"], s, tmp_path, cluster)
    assert heal[:4] == ["ip", "netns", "exec", "sw"] and heal[heal.index("--hosts") + 1] == "h0:2,h1:2,h2:2,h3:2"
    assert heal[-2:] == ["--heal", "shrink"]
    ddp = g.command(g.ARMS["ddp_torchrun"], s, tmp_path, cluster)
    assert ddp[:2] == ["/bin/sh", "-c"] and ddp[2].count("ip netns exec h") == 4 and ddp[2].endswith("& wait")
    assert "--nnodes 4 --nproc-per-node 2" in ddp[2] and f"--rdzv-endpoint h0:{g.RDZV_PORT}" in ddp[2]
    assert "--max-restarts" in ddp[2]


def test_each_torchft_replica_trains_its_own_share_of_the_data():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import goodput_model
    import goodput_torchft

    shares = [list(goodput_torchft.shard_batches(r, 3, 32, epoch=0)) for r in range(3)]
    assert all(len(batches) == (goodput_model.SAMPLES // 3) // 32 for batches in shares)
    x = goodput_model.dataset().tensors[0]
    rows = [torch.cat([b[0] for b in batches]) for batches in shares]
    index = {tuple(row.tolist()): i for i, row in enumerate(x[:, :4])}
    owners = [{index[tuple(r[:4].tolist())] % 3 for r in share} for share in rows]
    assert owners == [{0}, {1}, {2}]  # replica r trains samples r, r+3, ...
    again = list(goodput_torchft.shard_batches(1, 3, 32, epoch=1))
    assert not torch.equal(again[0][0], shares[1][0][0])  # a new order every epoch
    assert goodput_model.digest(goodput_model.mlp()) == goodput_model.digest(goodput_model.mlp())
