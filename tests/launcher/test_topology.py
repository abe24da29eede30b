"""Tests of :mod:`lightning_mpi.launcher.topology`: hydra's placement of ranks over hosts and
its summary lines.
"""
from __future__ import annotations

import pytest

from lightning_mpi.launcher.hosts import HostEntry
from lightning_mpi.launcher.topology import format_topology, oversubscribed, plan_topology


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

    def test_by_node_as_open_mpi_numbers_them(self):
        # what Open MPI 5.0.11 did on 4 simulated hosts of 2 slots (--map-by node; --map-by ppr:3:node
        # --rank-by node), read back from each rank's network namespace
        hosts = [HostEntry(h, 2) for h in "abcd"]
        assert plan_topology(10, hosts, by_node=True) == [
            ("a", [0, 4, 8]), ("b", [1, 5, 9]), ("c", [2, 6]), ("d", [3, 7]),
        ]
        assert plan_topology(10, hosts, ppn=3, by_node=True) == [
            ("a", [0, 4, 7]), ("b", [1, 5, 8]), ("c", [2, 6, 9]), ("d", [3]),
        ]

    def test_duplicate_hosts_and_idle_hosts(self):
        hosts = [HostEntry("a"), HostEntry("b"), HostEntry("a"), HostEntry("c")]
        assert plan_topology(3, hosts) == [("a", [0, 2]), ("b", [1]), ("c", [])]
        assert format_topology(plan_topology(3, hosts))[-1] == "c: 0 ranks"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "nprocs, hosts, ppn, why",
    [
        (2, [], None, None),
        (3, [], None, "3 ranks on 2 CPUs"),
        (3, ["a", "b"], None, None),  # slots made to fit: ceil(3 / 2) each
        (5, ["a:4", "b"], None, None),  # b gets ceil(5 / 2) = 3
        (5, ["a:2", "b:2"], None, "5 ranks on 4 slots"),
        (4, ["a", "b"], 2, None),
        (5, ["a", "b"], 2, "5 ranks on 4 slots"),
    ],
)
def test_oversubscribed_is_where_open_mpi_needs_permission(nprocs, hosts, ppn, why):
    from lightning_mpi.launcher.hosts import parse_host

    assert oversubscribed(nprocs, [parse_host(h) for h in hosts], ppn, local_cpus=2) == why
