"""Tests of ``lightning-mpi --max-restarts`` / ``--min-ranks``: the restart policy and the host
checks before a relaunch (no MPI), and real jobs that lose a rank mid-epoch and must end on the
weights of an uninterrupted run (single-process math) with at most one checkpoint interval lost.
"""
from __future__ import annotations

import re
import signal
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_mpi.launcher import cli
from lightning_mpi.launcher.errors import LaunchError
from lightning_mpi.launcher.hosts import HostEntry
from lightning_mpi.launcher.restarts import (
    RESTART_ENV,
    RestartPolicy,
    describe_exit,
    lost_hosts,
    ranks_left,
    should_restart,
)
from tests.launcher.helpers import finish, launch, needs_venv_mpiexec, run_main
from tests.mpi_utils import REPO
from tests.scripts.tiny_task import dataset, make_net

SCRIPT = REPO / "tests" / "scripts" / "restart_train.py"
BOGUS = "no-such-host.invalid"  # .invalid never resolves (RFC 2606)


def test_describe_exit_names_signals():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(128 + signal.SIGKILL) == "exit code 137 (128 + SIGKILL)"


def test_only_failures_are_restarted_while_restarts_are_left():
    policy = RestartPolicy(max_restarts=2)
    assert should_restart(9, None, 0, policy) and should_restart(1, None, 1, policy)
    assert not should_restart(1, None, 2, policy)  # all restarts used
    assert not should_restart(0, None, 0, policy)  # finished (or stopped cleanly when preempted)
    assert not should_restart(143, signal.SIGTERM, 0, policy)  # the launcher was asked to stop
    assert not should_restart(1, None, 0, RestartPolicy())


def test_policy_checks_name_the_option():
    RestartPolicy(1, 2).check(4)
    with pytest.raises(LaunchError, match="--min-ranks: 5 is not between 1 and -n 4"):
        RestartPolicy(1, 5).check(4)


def test_lost_hosts_are_those_gone_from_the_hostfile_or_not_resolving(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    entries = [HostEntry("localhost", 2), HostEntry("127.0.0.1", 1), HostEntry(BOGUS, 1)]
    lost = lost_hosts(entries, str(hostfile))
    assert set(lost) == {"127.0.0.1", BOGUS}
    assert "no longer in" in lost["127.0.0.1"]
    assert lost_hosts(entries[:2], None) == {}
    # hydra's placement: localhost takes ranks 0-1 and 3-4, 127.0.0.1 takes rank 2
    assert ranks_left(5, entries[:2], None, ["127.0.0.1"]) == 4
    assert ranks_left(4, entries[:2], 1, ["localhost"]) == 2


@needs_venv_mpiexec
@pytest.mark.timeout(60)
def test_relaunch_plan_drops_the_ranks_of_lost_hosts_within_min_ranks(capsys, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n127.0.0.1:1\n")
    args = cli.build_parser().parse_args(["-n", "3", "--hostfile", str(hostfile), "--max-restarts", "1",
                                          "--min-ranks", "2", str(script)])
    plan = cli._prepare(args, {"PATH": ""})
    hostfile.write_text("localhost:2\n")
    again = cli._relaunch_plan(plan, 1, RestartPolicy(1, 2), str(hostfile), {})
    assert again.spec.nprocs == 2 and again.spec.hosts == ("localhost:2",)
    assert again.command[again.command.index("-genv") + 1:][:2] == [RESTART_ENV, "1"]
    assert "127.0.0.1 no longer in" in again.notes[0]
    with pytest.raises(LaunchError, match="fewer than --min-ranks 3"):
        cli._relaunch_plan(plan, 1, RestartPolicy(1, None), str(hostfile), {})
    code, _, err = run_main(capsys, ["-n", "2", "--min-ranks", "3", "--dry-run", script])
    assert code == 2 and "--min-ranks: 3 is not between 1 and -n 2" in err


def reference_weights(samples: int, worlds: list[int], batches_per_epoch: int) -> dict[str, torch.Tensor]:
    """Synchronous training of restart_train.py in one process, epoch e on ``worlds[e]`` ranks.

    Lightning shards a training loader with a shuffling ``DistributedSampler`` (seed 0, reseeded
    by epoch); averaging the ranks' gradients of equal batches is the gradient of their union."""
    torch.manual_seed(0)
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    data = dataset(samples)
    for epoch, world in enumerate(worlds):
        batch = samples // world // batches_per_epoch
        shards = []
        for rank in range(world):
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for j in range(batches_per_epoch):
            union = [i for shard in shards for i in shard[j * batch:(j + 1) * batch]]
            x, y = data[union]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
    return net.state_dict()


def steps_trained(out, launches: int) -> list[list[int]]:
    """Per launch, the optimizer steps rank 0 trained (every rank logs the same ones)."""
    return [[int(s) for s in (out / f"steps.{k}.0").read_text().split()] for k in range(launches)]


def assert_equal_weights(out, reference) -> dict:
    final = torch.load(out / "final.pt")
    for name, value in reference.items():
        assert torch.allclose(final["state"][name], value, atol=1e-5, rtol=1e-5), name
    return final


def kill_rank_2_and_drop_its_host(tmp_path, max_restarts: int, *job: str) -> tuple[int, str, str]:
    """``lightning-mpi -n 3 --min-ranks 2`` with ranks 0-1 on localhost and rank 2 alone on
    127.0.0.1; the job (``job``: the script's own arguments) SIGKILLs rank 2 and removes its host
    from the hostfile. Returns (exit code, stdout, stderr) once the launcher ends."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n127.0.0.1:1\n")
    job = (*job, "--kill-rank", "2", "--drop-host", "127.0.0.1", "--hostfile", hostfile)
    proc = launch([sys.executable, "-m", "lightning_mpi", "-n", "3", "--hostfile", hostfile, "--max-restarts",
                   str(max_restarts), "--min-ranks", "2", SCRIPT, tmp_path, *job], REPO)
    return finish(proc, 220)


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(240)
def test_max_restarts_resumes_a_rank_killed_mid_epoch_on_the_hosts_left(tmp_path):
    # 3 ranks, the third alone on 127.0.0.1; 2 batches per epoch and a checkpoint every 2 epochs
    # (4 steps). In step 6 (mid-epoch 3) the third rank's node "goes away": it leaves the hostfile
    # and the rank is SIGKILLed. The relaunch goes on with localhost's 2 ranks from step 4.
    code, out, err = kill_rank_2_and_drop_its_host(
        tmp_path, 2, "--batches-per-epoch", "2", "--epochs", "6", "--every-n-epochs", "2", "--kill-at", "6")
    assert code == 0, err[-3000:]
    # hydra reports the SIGKILL as exit code 9, or 255 when the proxy of the other host fails first;
    # Open MPI as 137 (128 + SIGKILL)
    assert re.search(r"the job failed \(exit code \d+( \(128 \+ SIGKILL\))?\); restart 1 of 2", err)
    assert "127.0.0.1 no longer in" in err and "relaunching on 2 of 3 ranks" in err
    assert "restart 1: resuming from" in err and "epoch=1-step=4.ckpt" in err
    assert "written at world size 3, resuming at 2" in err
    # The weights of a run that trained epochs 0-1 on 3 ranks and 2-5 on 2, uninterrupted: the
    # relaunch resumed at the checkpoint boundary, with the data order of the epochs it redid.
    final = assert_equal_weights(tmp_path, reference_weights(24, [3, 3, 2, 2, 2, 2], 2))
    assert final["step"] == 12 and final["world"] == 2
    first, second = steps_trained(tmp_path, 2)
    assert first == list(range(7)) and second == list(range(4, 12))  # resumed at the checkpoint
    assert len(first) + len(second) - 12 <= 4  # lost work: at most one checkpoint interval


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(240)
def test_compressed_rule_resumes_a_w3_checkpoint_at_w2(tmp_path):
    # As above for the compressed rule, whose error-feedback residuals differ per rank.
    code, out, err = kill_rank_2_and_drop_its_host(
        tmp_path, 1, "--strategy", "compressed", "--epochs", "6", "--every-n-epochs", "2", "--kill-at", "3")
    assert code == 0, err[-3000:]
    assert "relaunching on 2 of 3 ranks" in err and "epoch=1-step=2.ckpt" in err
    assert "restored on 2: residuals are averaged" in err
    first, second = steps_trained(tmp_path, 2)
    assert first == list(range(4)) and second == list(range(2, 6))
    final = torch.load(tmp_path / "final.pt")
    assert final["world"] == 2 and final["step"] == 6
    assert all(torch.isfinite(t).all() for t in final["state"].values())
