"""Tests of the ``lightning-mpi`` launcher: the pure command builder for MPICH hydra, Open MPI and
srun; hostfile parsing and topology; each sanity check failing with its message and fix; and real
launches with the venv's MPICH (ranks run, exit codes propagate, SIGINT/SIGTERM stop every rank).

Open MPI and srun are only checked as command lines here: neither is installed on these machines.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_mpi.launcher import cli as launcher
from lightning_mpi.launcher import (
    HostEntry,
    LaunchError,
    LaunchSpec,
    build_command,
    check_hosts_resolve,
    check_mpi_match,
    find_mpiexec,
    flavor_from_version,
    format_topology,
    main,
    parse_host,
    parse_hostfile,
    plan_topology,
    read_hostfile,
    run_command,
)
from tests.mpi_utils import mpi_env

VENV_MPIEXEC = Path(sys.executable).parent / "mpiexec"
needs_venv_mpiexec = pytest.mark.skipif(
    not VENV_MPIEXEC.exists(), reason="needs the mpich wheel's mpiexec next to sys.executable"
)


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Tests run as if outside a Slurm allocation (so CI under Slurm picks mpiexec too);
    the Slurm tests set the variables themselves."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


# ------------------------------------------------------------------------------------------
# Pure command builder
# ------------------------------------------------------------------------------------------


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
            "mpirun", "-np", "4", "--host", "a:2,b:2", "--map-by", "ppr:2:node", "-x", "A=1",
            "py", "train.py", "fit", "--x=1",
        ]

    def test_openmpi_hosts_without_slots_go_round_robin(self):
        # 3 ranks on 2 hosts: enough slots on each (ceil(3/2) = 2) and mapped by node, as hydra does.
        cmd = build_command(spec(nprocs=3, hosts=("a", "b"), launcher="mpirun"), "openmpi")
        assert cmd[:7] == ["mpirun", "-np", "3", "--host", "a:2,b:2", "--map-by", "node"]

    def test_openmpi_explicit_slots_fill_by_slot(self):
        cmd = build_command(spec(nprocs=5, hosts=("a:4", "b"), launcher="mpirun"), "openmpi")
        assert cmd[:5] == ["mpirun", "-np", "5", "--host", "a:4,b:3"]
        assert "--map-by" not in cmd

    def test_openmpi_hostfile(self):
        cmd = build_command(spec(hostfile="hf", ppn=8, launcher="mpirun"), "openmpi")
        assert cmd[:7] == ["mpirun", "-np", "4", "--hostfile", "hf", "--map-by", "ppr:8:node"]

    def test_srun(self):
        cmd = build_command(
            spec(hosts=("n1:4", "n2"), ppn=2, env=(("A", "1"), ("B", "2")), launcher="srun"), "srun"
        )
        assert cmd == [
            "srun", "--ntasks=4", "--nodes=2", "--nodelist=n1,n2", "--ntasks-per-node=2",
            "--export=ALL,A=1,B=2", "--kill-on-bad-exit=1", "py", "train.py", "fit", "--x=1",
        ]

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


# ------------------------------------------------------------------------------------------
# Flavor detection
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text, flavor",
    [
        ("HYDRA build details:\n    Version: 4.2.0", "mpich"),
        ("MPICH Version:      5.0.2\nMPICH ABI: 18:2:6", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
        ("MVAPICH2 Version      :\t2.3.7", "mpich"),
        ("mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi"),
        ("mpiexec (OpenRTE) 4.0.3", "openmpi"),
        ("prterun (PRRTE) 3.0.2", "openmpi"),
        ("Open MPI v5.0.3, package: Open MPI builder, ident: 5.0.3", "openmpi"),
        ("slurm 23.02.7", "srun"),
        ("FooMPI 1.0: supported, short, reported", None),
        ("", None),
    ],
)
def test_flavor_from_version(text, flavor):
    assert flavor_from_version(text) == flavor


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_venv_mpiexec_is_found_first_and_is_mpich():
    found = find_mpiexec()
    assert found == str(VENV_MPIEXEC)
    assert flavor_from_version(launcher.mpiexec_version(found)) == "mpich"


@pytest.mark.timeout(10)
def test_find_mpiexec_explicit_name_on_path(tmp_path):
    fake = fake_launcher(tmp_path, "my-mpirun", "mpirun (Open MPI) 4.1.6")
    assert find_mpiexec("my-mpirun", environ={"PATH": str(tmp_path)}) == str(fake)
    assert find_mpiexec(str(fake)) == str(fake)
    with pytest.raises(LaunchError, match="argument --mpiexec: 'nope'"):
        find_mpiexec("nope", environ={"PATH": str(tmp_path)})


# ------------------------------------------------------------------------------------------
# Hostfiles and topology
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
class TestHostfile:
    def test_mpich_syntax(self):
        hf = parse_hostfile("# cluster\nnode1:4\nnode2:2 ifhn=eth0   # fast nic\n\nnode3\n")
        assert hf.syntax == "mpich"
        assert hf.entries == (HostEntry("node1", 4), HostEntry("node2", 2), HostEntry("node3"))

    def test_openmpi_syntax(self):
        hf = parse_hostfile("node1 slots=4 max_slots=8\nnode2\nnode3 max_slots=2\n")
        assert hf.syntax == "openmpi"
        assert hf.entries == (HostEntry("node1", 4), HostEntry("node2"), HostEntry("node3"))

    def test_plain(self):
        hf = parse_hostfile("a\nb\n")
        assert hf.syntax == "plain" and [str(e) for e in hf.entries] == ["a", "b"]

    @pytest.mark.parametrize(
        "text, match",
        [
            ("a\nb:x\n", r"line 2 \('b:x'\): slots of host 'b' must be a positive integer"),
            ("a slots=0\n", "line 1.*slots must be a positive integer"),
            ("a:2 slots=2\n", "line 1.*mixes"),
            ("a:2\nb slots=2\n", "mixes MPICH"),
            ("a foo\n", "line 1.*key=value"),
            ("# nothing\n\n", "lists no hosts"),
        ],
    )
    def test_errors(self, text, match):
        with pytest.raises(ValueError, match=match):
            parse_hostfile(text)

    def test_read_hostfile_errors_name_the_argument(self, tmp_path):
        with pytest.raises(LaunchError, match="argument --hostfile: cannot read"):
            read_hostfile(str(tmp_path / "missing"))
        bad = tmp_path / "hosts"
        bad.write_text("a:-1\n")
        with pytest.raises(LaunchError, match=r"argument --hostfile: .*line 1.*fix: write one host per line"):
            read_hostfile(str(bad))

    def test_parse_host(self):
        assert parse_host("n1:8") == HostEntry("n1", 8) and str(parse_host(" n1 ")) == "n1"
        for bad in ("", ":2", "a:0", "a b"):
            with pytest.raises(ValueError):
                parse_host(bad)


@pytest.mark.timeout(10)
class TestTopology:
    def test_single_machine(self):
        assert plan_topology(3, []) == [("localhost", [0, 1, 2])]
        assert format_topology(plan_topology(3, [])) == ["localhost: 3 ranks (0-2)"]
        assert format_topology(plan_topology(1, [])) == ["localhost: 1 rank (0)"]

    def test_round_robin_without_slots(self):
        assert plan_topology(3, [HostEntry("a"), HostEntry("b")]) == [("a", [0, 2]), ("b", [1])]

    def test_ppn_blocks(self):
        hosts = [HostEntry("a", 8), HostEntry("b")]
        assert plan_topology(4, hosts, ppn=2) == [("a", [0, 1]), ("b", [2, 3])]

    def test_slots_fill_then_wrap(self):
        hosts = [HostEntry("a", 2), HostEntry("b", 1)]
        assert plan_topology(5, hosts) == [("a", [0, 1, 3, 4]), ("b", [2])]
        assert format_topology(plan_topology(5, hosts)) == ["a: 4 ranks (0-1,3-4)", "b: 1 rank (2)"]

    def test_duplicate_hosts_and_idle_hosts(self):
        hosts = [HostEntry("a"), HostEntry("b"), HostEntry("a"), HostEntry("c")]
        assert plan_topology(3, hosts) == [("a", [0, 2]), ("b", [1]), ("c", [])]
        assert format_topology(plan_topology(3, hosts))[-1] == "c: 0 ranks"


# ------------------------------------------------------------------------------------------
# Sanity checks through main(): exit code 2, the bad argument and the fix on stderr
# ------------------------------------------------------------------------------------------


def fake_launcher(directory: Path, name: str, version_text: str) -> Path:
    """An executable that answers ``--version`` like some MPI launcher, and fails otherwise."""
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then printf "%s\\n" {shlex.quote(version_text)}; exit 0; fi\n'
        "echo 'fake launcher must not run a job' >&2; exit 99\n"
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def script(tmp_path) -> Path:
    """A rank script that leaves a marker file, so a test can tell whether it ran."""
    path = tmp_path / "job.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


def run_main(capsys, argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0", "S"], r"argument -n/-np/--np: '0' is not an integer >= 1"),
        (["-n", "two", "S"], r"argument -n/-np/--np: 'two' is not an integer >= 1"),
        (["S"], r"the following arguments are required: -n"),
        (["-n", "2", "--ppn", "0", "S"], r"argument --ppn: '0'"),
        (["-n", "2", "--env", "NOVALUE", "S"], r"argument --env: 'NOVALUE' is not KEY=VALUE.*example"),
        (["-n", "2", "--env", "1A=2", "S"], r"argument --env: '1A=2'"),
        (["-n", "2", "--hosts", "a:0", "S"], r"argument --hosts: slots of host 'a'.*example"),
        (["-n", "2", "--hosts", "a", "--hostfile", "f", "S"], r"argument --hostfile: not allowed with argument --hosts"),
        (["-n", "2", "missing.py"], r"argument script: 'missing.py' not found.*fix:"),
        (["-n", "2", "--hostfile", "nofile", "S"], r"argument --hostfile: cannot read 'nofile'"),
        (["-n", "2", "--hosts", "localhost,no-such-host.invalid", "S"],
         r"host does not resolve: 'no-such-host.invalid'.*fix: correct the name"),
        (["-n", "2", "--mpiexec", "/nonexistent/mpiexec", "S"], r"argument --mpiexec: '/nonexistent/mpiexec'.*fix:"),
    ],
)
def test_argument_errors(capsys, script, argv, message):
    code, out, err = run_main(capsys, [str(script) if a == "S" else a for a in argv])
    assert code == 2
    assert out == ""
    assert err.startswith("usage: lightning-mpi -n N")
    assert re.search(message, err), err
    assert not (script.parent / "ran").exists()


@pytest.mark.timeout(30)
def test_mpi_mismatch_names_the_mpiexec_and_the_fix(capsys, tmp_path, script):
    fake = fake_launcher(tmp_path, "mpirun", "mpirun (Open MPI) 4.1.6")
    code, _, err = run_main(capsys, ["-n", "2", "--mpiexec", fake, "--dry-run", script])
    assert code == 2
    assert f"the mpiexec found, {fake}, is Open MPI" in err
    assert "mpi4py uses MPICH" in err
    assert "fix: pip install mpich" in err and "--mpiexec PATH" in err


@pytest.mark.timeout(30)
def test_mismatch_found_on_path_without_venv_mpiexec(capsys, monkeypatch, tmp_path, script):
    # Without a venv mpiexec, PATH decides; an Open MPI mpirun there must be refused.
    fake_launcher(tmp_path, "mpiexec", "mpiexec (OpenRTE) 4.0.3")
    monkeypatch.setattr(launcher.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(launcher, "check_mpi4py", lambda python=None: "MPICH Version: 5.0.2")
    code, _, err = run_main(capsys, ["-n", "2", "--dry-run", script])
    assert code == 2
    assert f"the mpiexec found, {tmp_path / 'mpiexec'}, is Open MPI" in err


@pytest.mark.timeout(30)
def test_unknown_mpiexec_flavor(capsys, tmp_path, script):
    fake = fake_launcher(tmp_path, "mpiexec", "FooMPI launcher 1.0")
    code, _, err = run_main(capsys, ["-n", "2", "--mpiexec", fake, script])
    assert code == 2
    assert f"cannot tell which MPI {fake} belongs to" in err and "fix: pass --mpiexec PATH" in err


@pytest.mark.timeout(10)
def test_check_mpi_match_directly():
    assert check_mpi_match("MPICH Version: 5.0.2", "mpiexec", "mpich") == []
    assert check_mpi_match("Open MPI v5.0.3", "mpirun", "openmpi") == []
    assert check_mpi_match("Open MPI v5.0.3", "srun", "srun") == []
    with pytest.raises(LaunchError, match="fix: pass --mpiexec PATH of Open MPI's mpirun"):
        check_mpi_match("Open MPI v5.0.3", "/usr/bin/mpiexec", "mpich")
    warnings = check_mpi_match("Exotic MPI 1.0", "mpiexec", "mpich")
    assert len(warnings) == 1 and "Exotic MPI 1.0" in warnings[0]


SHADOW_NO_MPI4PY = "raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n"
SHADOW_NO_LIBMPI = "import types\nrc = types.SimpleNamespace()\n__version__ = '0'\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "init, mpi, message",
    [
        (SHADOW_NO_MPI4PY, None, r"mpi4py does not import in .*No module named 'mpi4py'.*fix: pip install mpi4py"),
        (SHADOW_NO_LIBMPI, "raise ImportError('libmpi.so.12: cannot open shared object file')\n",
         r"MPI library does not load in .*libmpi\.so\.12.*fix: pip install mpich"),
    ],
)
def test_mpi4py_check_failures(capsys, monkeypatch, tmp_path, script, init, mpi, message):
    # A package earlier on PYTHONPATH shadows the real mpi4py in the probe subprocess.
    shadow = tmp_path / "shadow" / "mpi4py"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(init)
    if mpi is not None:
        (shadow / "MPI.py").write_text(mpi)
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    code, _, err = run_main(capsys, ["-n", "2", "--dry-run", script])
    assert code == 2
    assert re.search(message, err), err


@pytest.mark.timeout(30)
def test_check_mpi4py_reports_the_library():
    assert flavor_from_version(launcher.check_mpi4py()) == "mpich"


@pytest.mark.timeout(30)
def test_check_hosts_resolve():
    check_hosts_resolve(["localhost", "127.0.0.1", "localhost"])
    with pytest.raises(LaunchError) as info:
        check_hosts_resolve(["localhost", "a.invalid", "b.invalid"])
    assert "'a.invalid'" in str(info.value) and "'b.invalid'" in str(info.value)
    assert "'localhost'" not in str(info.value)


# ------------------------------------------------------------------------------------------
# Dry runs: the command that would run, the topology, flavor choice, no launch
# ------------------------------------------------------------------------------------------


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_dry_run_prints_command_and_topology_without_launching(capsys, script):
    code, out, err = run_main(
        capsys, ["-n", "3", "--hosts", "localhost", "--env", "A=1 2", "--dry-run", script, "-n", "5", "--flag"]
    )
    assert code == 0
    assert shlex.split(out) == [
        str(VENV_MPIEXEC), "-n", "3", "-hosts", "localhost", "-genv", "A", "1 2",
        sys.executable, str(script), "-n", "5", "--flag",
    ]
    assert "lightning-mpi: localhost: 3 ranks (0-2)" in err
    assert "via MPICH (hydra)" in err
    assert not (script.parent / "ran").exists()


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_hostfile_pass_through_and_translation(capsys, tmp_path, script):
    mpich_file = tmp_path / "hosts.mpich"
    mpich_file.write_text("localhost:2\n127.0.0.1:1\n")
    code, out, err = run_main(capsys, ["-n", "3", "--hostfile", mpich_file, "--dry-run", script])
    assert code == 0
    assert shlex.split(out)[3:5] == ["-f", str(mpich_file)]
    assert "localhost: 2 ranks (0-1)" in err and "127.0.0.1: 1 rank (2)" in err

    # Open MPI syntax given to hydra: handed over as a host list that hydra understands.
    ompi_file = tmp_path / "hosts.ompi"
    ompi_file.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    code, out, err = run_main(capsys, ["-n", "3", "--hostfile", ompi_file, "--dry-run", script])
    assert code == 0
    assert shlex.split(out)[3:5] == ["-hosts", "localhost:2,127.0.0.1:1"]
    assert "passed as a host list" in err


@pytest.mark.timeout(30)
def test_slurm_allocation_uses_srun(capsys, monkeypatch, tmp_path, script):
    srun = fake_launcher(tmp_path, "srun", "slurm 23.02.7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    code, out, err = run_main(capsys, ["-n", "4", "--ppn", "2", "--env", "A=1", "--dry-run", script])
    assert code == 0
    assert shlex.split(out) == [
        str(srun), "--ntasks=4", "--ntasks-per-node=2", "--export=ALL,A=1", "--kill-on-bad-exit=1",
        sys.executable, str(script),
    ]
    assert "via Slurm srun" in err and "Slurm places them on node[1-2], at most 2 per node" in err

    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n127.0.0.1:2\n")
    code, out, err = run_main(capsys, ["-n", "4", "--hostfile", hostfile, "--ppn", "2", "--dry-run", script])
    assert code == 0
    assert "--nodelist=localhost,127.0.0.1" in shlex.split(out)
    assert "localhost: 2 ranks (0-1)" in err and "127.0.0.1: 2 ranks (2-3)" in err


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_explicit_mpiexec_wins_over_slurm(capsys, monkeypatch, tmp_path, script):
    fake_launcher(tmp_path, "srun", "slurm 23.02.7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code, out, _ = run_main(capsys, ["-n", "2", "--mpiexec", VENV_MPIEXEC, "--dry-run", script])
    assert code == 0
    assert shlex.split(out)[:3] == [str(VENV_MPIEXEC), "-n", "2"]


@pytest.mark.timeout(30)
def test_help_exits_zero(capsys):
    code, out, _ = run_main(capsys, ["--help"])
    assert code == 0
    assert out.startswith("usage: lightning-mpi -n N [--hosts a,b | --hostfile F]")


# ------------------------------------------------------------------------------------------
# Real launches with the venv's MPICH
# ------------------------------------------------------------------------------------------

RANK_SCRIPT = r"""
import os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
# One write per line: print() writes text and newline separately, and hydra may interleave them.
sys.stdout.write(f"rank {comm.Get_rank()} of {comm.Get_size()} args={sys.argv[1:]} env={os.environ.get('LM_TEST_VAR')}\n")
sys.stdout.flush()
if comm.Get_rank() == 1 and "--fail" in sys.argv:
    sys.exit(3)
"""

SLEEP_SCRIPT = """
import os, signal, sys, time
if "--ignore-signals" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
path = os.path.join(sys.argv[1], f"pid.{rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(120)
"""


def write(tmp_path: Path, name: str, code: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


# launcher.py loaded as a module of its own, without the lightning_mpi package: the package's
# __init__ imports torch and Lightning (seconds per process on 2 busy cores), which the
# exit-code and signal tests do not need. The console script and ``python -m lightning_mpi``
# tests below do go through the package.
STANDALONE = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('standalone_launcher', {str(Path(launcher.__file__))!r})\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module  # dataclasses look their module up here\n"
    "spec.loader.exec_module(module)\n"
)


MAIN = "sys.exit(module.main(sys.argv[1:]))"


def standalone(statement: str, *argv) -> list[str]:
    """argv running ``statement`` (with ``module`` = launcher.py loaded standalone) on ``argv``."""
    return [sys.executable, "-c", STANDALONE + statement, *argv]


def launch(args: list, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [str(a) for a in args],
        cwd=cwd,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a failed test can kill the launcher's group
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # a surviving grandchild may hold the pipes open: don't wait for it forever
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        raise AssertionError(f"launcher did not finish in {timeout}s\n{out}\n{err}")
    return proc.returncode, out, err


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def rank_pids():
    """Pids the test saw; any still alive at teardown are killed so a failure leaks nothing."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def wait_for_pid_files(directory: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    files = [directory / f"pid.{r}" for r in range(n)]
    while not all(f.exists() for f in files):
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("ranks did not start")
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(240)  # pays `import lightning_mpi` (torch + Lightning) on busy cores
def test_console_script_runs_two_ranks(tmp_path):
    console = Path(sys.executable).parent / "lightning-mpi"
    if not console.exists():
        pytest.skip("console script not installed next to sys.executable")
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    proc = launch([console, "-n", "2", "--env", "LM_TEST_VAR=hello", script, "a b", "--c"], tmp_path)
    code, out, err = finish(proc, 200)
    assert code == 0, err
    for r in range(2):
        assert f"rank {r} of 2 args=['a b', '--c'] env=hello" in out
    assert "lightning-mpi: localhost: 2 ranks (0-1)" in err


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(240)  # pays `import lightning_mpi` (torch + Lightning) on busy cores
def test_python_m_runs_three_ranks(tmp_path):
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    code, out, err = finish(launch([sys.executable, "-m", "lightning_mpi", "-n", "3", script], tmp_path), 200)
    assert code == 0, err
    assert sorted(re.findall(r"rank \d+ of \d+", out)) == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"]
    assert "localhost: 3 ranks (0-2)" in err


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
def test_exit_code_of_a_failing_rank_propagates(tmp_path):
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    code, out, err = finish(launch(standalone(MAIN, "-n", "2", script, "--fail"), tmp_path), 60)
    assert code != 0
    assert code == 3, err  # hydra returns the failing rank's code
    assert "rank 1 of 2" in out


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_rank(tmp_path, rank_pids, signum):
    script = write(tmp_path, "sleep.py", SLEEP_SCRIPT)
    proc = launch(standalone(MAIN, "-n", "2", script, tmp_path), tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signum)
    code, _, err = finish(proc, 30)
    assert code == 128 + signum, err
    # The launcher returns once mpiexec is gone; give the ranks' exit a moment under load.
    while any(alive(p) for p in rank_pids) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not any(alive(p) for p in rank_pids)


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path, rank_pids):
    # hydra forwards SIGTERM and waits; the ranks ignore it and live in sessions of their own,
    # so only the launcher's escalation (descendants tracked via /proc) can stop them.
    script = write(tmp_path, "sleep.py", SLEEP_SCRIPT)
    run = "sys.exit(module.run_command(sys.argv[1:], grace_s=1.0))"
    cmd = standalone(run, VENV_MPIEXEC, "-n", "2", sys.executable, script, tmp_path, "--ignore-signals")
    proc = launch(cmd, tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    elapsed = time.monotonic() - t0
    assert code == 128 + signal.SIGTERM, err
    assert 0.9 <= elapsed < 10
    assert not any(alive(p) for p in rank_pids)


TREE_SCRIPT = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
directory, role = sys.argv[1], sys.argv[2]
if role == "parent":
    # Like hydra's proxy: the child gets a session of its own, out of reach of killpg.
    subprocess.Popen([sys.executable, __file__, directory, "child"], start_new_session=True)
rank = 0 if role == "parent" else 1
with open(os.path.join(directory, f"pid.{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(directory, f"pid.{rank}.tmp"), os.path.join(directory, f"pid.{rank}"))
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_escalation_kills_descendants_in_other_sessions(tmp_path, rank_pids):
    # Without MPI, so nothing but the launcher's own escalation can stop the child: it ignores
    # SIGTERM, lives in another session, and survives its parent's death.
    script = write(tmp_path, "tree.py", TREE_SCRIPT)
    run = "sys.exit(module.run_command(sys.argv[1:], grace_s=1.0))"
    proc = launch(standalone(run, sys.executable, script, tmp_path, "parent"), tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    assert code == 128 + signal.SIGTERM, err
    deadline = time.monotonic() + 5
    while any(alive(p) for p in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in rank_pids)


@pytest.mark.timeout(30)
def test_run_command_exit_codes():
    assert run_command([sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert run_command([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]) == 128 + 9


@pytest.mark.timeout(30)
def test_launcher_module_imports_nothing_heavy():
    # Loaded on its own (the package __init__ may import torch): the launcher must start fast
    # and must not load MPI itself.
    heavy = ("torch", "pytorch_lightning", "lightning", "mpi4py", "numpy", "lightning_mpi")
    statement = f"assert callable(module.main); print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(standalone(statement), capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
