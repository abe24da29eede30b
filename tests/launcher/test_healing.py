"""Tests of lightning_mpi.launcher.healing: a --heal job that finished is a success, whatever Open
MPI reports for the ranks lost on the way, and a job stuck after it finished is stopped."""

from __future__ import annotations

import sys
import time

import pytest

from lightning_mpi.launcher.healing import OutcomeDir, healed_exit_code, marked_finished
from lightning_mpi.launcher.process import run_job


@pytest.mark.timeout(10)
def test_a_finished_job_ended_by_a_signal_exits_zero_with_a_note(tmp_path):
    assert healed_exit_code(137, str(tmp_path)) == (137, None)  # not marked: a real failure
    (tmp_path / "finished.host.42").touch()
    assert marked_finished(str(tmp_path))
    code, note = healed_exit_code(137, str(tmp_path))
    assert code == 0 and "mpirun reported exit code 137 (128 + SIGKILL) for ranks lost on the way" in note
    assert healed_exit_code(1, str(tmp_path)) == (1, None)  # an exception is never overridden
    assert healed_exit_code(0, str(tmp_path)) == (0, None)
    assert healed_exit_code(137, None) == (137, None)  # without --heal
    code, note = healed_exit_code(137, str(tmp_path), ended_after_finish=True)
    assert code == 0 and "had not ended --grace seconds later" in note


@pytest.mark.timeout(10)
def test_a_job_a_rank_failed_is_a_failure_although_mpirun_reported_success(tmp_path):
    # mpirun --with-ft ulfm exits 0 after a rank's MPI_Abort once ranks died: the rank's mark says
    (tmp_path / "failed.host.7").touch()
    code, note = healed_exit_code(0, str(tmp_path))
    assert code == 1 and "a rank failed the run" in note
    assert healed_exit_code(3, str(tmp_path)) == (3, None)  # a failure reported anyway stays as it is
    (tmp_path / "finished.host.8").touch()  # the run went on and finished elsewhere: a success
    assert healed_exit_code(0, str(tmp_path)) == (0, None)


@pytest.mark.timeout(30)
def test_a_job_stuck_after_it_finished_is_stopped_after_the_grace_period():
    with OutcomeDir() as outcome:
        job = [sys.executable, "-c", f"open({outcome + '/finished.x'!r}, 'w').close(); import time; time.sleep(60)"]
        start = time.monotonic()
        result = run_job(job, grace_s=0.5, finished=lambda: marked_finished(outcome))
        assert result.ended_after_finish and time.monotonic() - start < 15
        assert healed_exit_code(result.code, outcome, result.ended_after_finish)[0] == 0
    quick = run_job([sys.executable, "-c", "pass"], grace_s=0.5, finished=lambda: False)
    assert quick.code == 0 and not quick.ended_after_finish
