"""Tests of :mod:`lightning_mpi.launcher.command`: the launch spec's validation and the pure
command builder for MPICH hydra, Open MPI and srun.

srun is only checked as a command line here; Open MPI runs for real in
tests/launcher/test_openmpi.py (in the Open MPI environment).
"""
from __future__ import annotations

import sys

import pytest

from lightning_mpi.launcher.command import LaunchSpec, build_command


def spec(**kw) -> LaunchSpec:
    base = dict(nprocs=4, script="train.py", script_args=("fit", "--x=1"), python="py")
    base.update(kw)
    return LaunchSpec(**base)


@pytest.mark.timeout(10)
class TestBuildCommand:
    def test_mpich_local(self):
        assert build_command(spec(nprocs=2), "mpich") == [
            "mpiexec", "-n", "2", "py", "train.py", "fit", "--x=1",
        ]

    def test_mpich_hosts_ppn_env(self):
        cmd = build_command(
            spec(hosts=("a", "b:3"), ppn=2, env=(("A", "1"), ("B", "x y")), launcher="/m/mpiexec"),
            "mpich",
        )
        assert cmd == [
            "/m/mpiexec", "-n", "4", "-hosts", "a,b:3", "-ppn", "2",
            "-genv", "A", "1", "-genv", "B", "x y",
            "py", "train.py", "fit", "--x=1",
        ]

    def test_mpich_hostfile(self):
        assert build_command(spec(hostfile="hf"), "mpich")[:5] == ["mpiexec", "-n", "4", "-f", "hf"]

    def test_openmpi_hosts_ppn_env(self):
        cmd = build_command(spec(hosts=("a", "b"), ppn=2, env=(("A", "1"),), launcher="mpirun"), "openmpi")
        assert cmd == [
            "mpirun", "-np", "4", "--bind-to", "none", "--host", "a:2,b:2", "--map-by", "ppr:2:node",
            "-x", "A=1", "py", "train.py", "fit", "--x=1",
        ]

    def test_openmpi_hosts_without_slots_go_round_robin(self):
        # 3 ranks on 2 hosts: enough slots on each (ceil(3/2) = 2) and mapped by node, as hydra does.
        cmd = build_command(spec(nprocs=3, hosts=("a", "b"), launcher="mpirun"), "openmpi")
        assert cmd[:9] == ["mpirun", "-np", "3", "--bind-to", "none", "--host", "a:2,b:2", "--map-by", "node"]

    def test_openmpi_explicit_slots_fill_by_slot(self):
        cmd = build_command(spec(nprocs=5, hosts=("a:4", "b"), launcher="mpirun"), "openmpi")
        assert cmd[:7] == ["mpirun", "-np", "5", "--bind-to", "none", "--host", "a:4,b:3"]
        assert "--map-by" not in cmd

    def test_openmpi_one_slot_hosts_wrap_round_robin(self):
        # 5 ranks (3 training, 2 spares) on 3 hosts of 1 slot: by node, as the plan prints them
        # (by slot, Open MPI put ranks 0 and 1 on the first host).
        hosts = ("a:1", "b:1", "c:1")
        cmd = build_command(spec(nprocs=5, hosts=hosts, oversubscribe=True, launcher="mpirun"), "openmpi")
        assert cmd[cmd.index("--host") : cmd.index("--host") + 4] == ["--host", "a:1,b:1,c:1", "--map-by", "node"]

    def test_openmpi_hostfile(self):
        cmd = build_command(spec(hostfile="hf", ppn=8, launcher="mpirun"), "openmpi")
        assert cmd[:9] == ["mpirun", "-np", "4", "--bind-to", "none", "--hostfile", "hf", "--map-by", "ppr:8:node"]

    def test_openmpi_heal_oversubscribe_root(self):
        # Healing, more ranks than slots and running as root: Open MPI does each only when told.
        cmd = build_command(spec(nprocs=3, heal=True, oversubscribe=True, as_root=True, launcher="mpirun"), "openmpi")
        assert cmd == [
            "mpirun", "-np", "3", "--with-ft", "ulfm",
            # no hierarchical collectives (their node communicators deadlocked on a healed one)
            "--mca", "coll", "^han",
            # the heartbeat detector: a rank silent for hang_timeout (8 s) is declared failed
            "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_period", "1.6",
            "--mca", "mpi_ft_detector_timeout", "8",
            # what it finds reaches every rank (a spare that detected a loss told no training rank)
            "--mca", "mpi_ft_propagator_with_rbcast", "true",
            # every peer's endpoint made in MPI_Init: a first message to a peer cut off does not
            # wait for its address (and miss heartbeats meanwhile)
            "--mca", "mpi_add_procs_cutoff", "1000000",
            # a rank that does not run for 2 s while the others run is killed beside it (comm.watchdog)
            "-x", "LIGHTNING_MPI_FREEZE_TIMEOUT=1",
            "--oversubscribe",
            # a rank that waits sleeps between polls (sched_yield left ranks off their core for seconds)
            "--mca", "threads_pthreads_yield_strategy", "nanosleep",
            "--allow-run-as-root", "--bind-to", "none", "py", "train.py", "fit", "--x=1",
        ]
        quiet = build_command(spec(nprocs=3, heal=True, hang_timeout=None, launcher="mpirun"), "openmpi")
        assert "mpi_ft_detector" not in quiet  # no detector: a lost rank is noticed when its process ends
        with pytest.raises(ValueError, match=r"hang_timeout=0: must be a number of seconds > 0, or None"):
            spec(heal=True, hang_timeout=0)
        off = build_command(spec(nprocs=3, heal=True, freeze_timeout=None, launcher="mpirun"), "openmpi")
        assert off[off.index("LIGHTNING_MPI_FREEZE_TIMEOUT=0") - 1] == "-x"  # 0: the ranks keep no watchdog
        with pytest.raises(ValueError, match=r"freeze_timeout=-1: must be a number of seconds > 0, or None"):
            spec(heal=True, freeze_timeout=-1)

    def test_openmpi_heal_numbers_ranks_round_robin_over_hosts(self):
        # Open MPI's detector is a ring (rank r + 1 watches rank r): with a host's ranks consecutive, a
        # host cut off was found one timeout per rank. Under heal with the detector every rank is
        # watched from another host, whatever the slots.
        slots = build_command(spec(nprocs=10, hosts=("a:2", "b:2"), heal=True, launcher="mpirun"), "openmpi")
        assert slots[slots.index("--host") : slots.index("--host") + 4] == ["--host", "a:2,b:2", "--map-by", "node"]
        ppn = build_command(spec(nprocs=4, hosts=("a", "b"), ppn=2, heal=True, launcher="mpirun"), "openmpi")
        assert ppn[ppn.index("--map-by") : ppn.index("--map-by") + 4] == ["--map-by", "ppr:2:node", "--rank-by", "node"]
        hostfile = build_command(spec(hostfile="hf", heal=True, launcher="mpirun"), "openmpi")
        assert hostfile[hostfile.index("--hostfile") :][:4] == ["--hostfile", "hf", "--map-by", "node"]
        # one machine, or no detector: nothing to watch across hosts, placement as without heal
        assert "--map-by" not in build_command(spec(heal=True, launcher="mpirun"), "openmpi")
        quiet = spec(nprocs=10, hosts=("a:2", "b:2"), heal=True, hang_timeout=None, launcher="mpirun")
        assert not quiet.ranks_by_node and "--map-by" not in build_command(quiet, "openmpi")

    def test_mpich_needs_no_permission_and_cannot_heal(self):
        # Hydra oversubscribes and runs as root by itself: the same spec gives the plain command.
        assert build_command(spec(nprocs=2, oversubscribe=True, as_root=True), "mpich") == build_command(
            spec(nprocs=2), "mpich"
        )
        for flavor in ("mpich", "srun"):
            with pytest.raises(ValueError, match="heal=True: .* cannot keep a job running when a rank dies"):
                build_command(spec(heal=True, launcher="x"), flavor)

    def test_srun(self):
        cmd = build_command(
            spec(hosts=("n1:4", "n2"), ppn=2, env=(("A", "1"), ("B", "2")), launcher="srun"), "srun"
        )
        assert cmd == [
            "srun", "--ntasks=4", "--nodes=2", "--nodelist=n1,n2", "--ntasks-per-node=2",
            "--export=ALL,A=1,B=2", "--kill-on-bad-exit=1", "py", "train.py", "fit", "--x=1",
        ]

    def test_srun_overcommits_when_oversubscribed(self):
        cmd = build_command(spec(nprocs=4, script_args=(), oversubscribe=True, launcher="srun"), "srun")
        assert cmd == ["srun", "--ntasks=4", "--overcommit", "--kill-on-bad-exit=1", "py", "train.py"]

    def test_srun_inside_allocation_minimal(self):
        assert build_command(spec(nprocs=2, script_args=(), launcher="srun"), "srun") == [
            "srun", "--ntasks=2", "--kill-on-bad-exit=1", "py", "train.py",
        ]

    def test_srun_rejects_hostfile_and_comma_values(self):
        with pytest.raises(ValueError, match="hostfile"):
            build_command(spec(hostfile="hf"), "srun")
        with pytest.raises(ValueError, match="A"):
            build_command(spec(env=(("A", "x,y"),)), "srun")

    def test_unknown_flavor(self):
        with pytest.raises(ValueError, match="flavor='intel'"):
            build_command(spec(), "intel")  # type: ignore[arg-type]

    def test_default_python_is_sys_executable(self):
        assert LaunchSpec(nprocs=1, script="s.py").python == sys.executable


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(nprocs=0), "nprocs=0"),
        (dict(nprocs=True), "nprocs=True"),
        (dict(ppn=0), "ppn=0"),
        (dict(hosts=("a",), hostfile="hf"), "at most one"),
        (dict(hosts=("a:zero",)), "slots of host 'a'"),
        (dict(env=(("1BAD", "x"),)), "env key '1BAD'"),
        (dict(script=""), "script"),
    ],
)
def test_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        spec(**kwargs)


@pytest.mark.timeout(10)
def test_spec_is_frozen_and_hashable():
    s = spec(hosts=["a", "b"], env=[("A", "1")])
    assert s.hosts == ("a", "b") and s.env == (("A", "1"),)
    hash(s)
    with pytest.raises(AttributeError):
        s.nprocs = 3  # type: ignore[misc]
