"""Tests of :mod:`lightning_mpi.launcher.hosts`: ``--hosts`` entries, hostfiles in MPICH and
Open MPI syntax, and the check that host names resolve.
"""
from __future__ import annotations

import pytest

from lightning_mpi.launcher.errors import LaunchError
from lightning_mpi.launcher.hosts import (
    HostEntry,
    check_hosts_resolve,
    parse_host,
    parse_hostfile,
    read_hostfile,
)


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


@pytest.mark.timeout(30)
def test_check_hosts_resolve():
    check_hosts_resolve(["localhost", "127.0.0.1", "localhost"])
    with pytest.raises(LaunchError) as info:
        check_hosts_resolve(["localhost", "a.invalid", "b.invalid"])
    assert "'a.invalid'" in str(info.value) and "'b.invalid'" in str(info.value)
    assert "'localhost'" not in str(info.value)
