"""``devices=`` and ``num_nodes=`` against what MPI started (issue 27, item 2): the rules, and
world size 1 in this process. Under ``mpiexec -n 2``: ``tests/strategies/test_first_steps.py``."""

import pytest

from lightning_mpi.strategies.flags import (
    MPILayout,
    RankDevices,
    check_devices_flag,
    check_num_nodes_flag,
    devices_of_local_ranks,
)

pytestmark = pytest.mark.timeout(120)

TWO_RANKS = MPILayout(world_size=2, num_nodes=1, ranks_on_this_node=2)
FOUR_ON_TWO_HOSTS = MPILayout(world_size=4, num_nodes=2, ranks_on_this_node=2)
UNEVEN = MPILayout(world_size=3, num_nodes=2, ranks_on_this_node=2)


@pytest.mark.parametrize(
    "layout, count, auto",
    [
        (TWO_RANKS, 2, 1),  # devices=2: the ranks per node
        (TWO_RANKS, 1, 1),  # devices="auto" (or 1) on the CPU
        (FOUR_ON_TWO_HOSTS, 2, 4),  # devices=2 on hosts with 4 GPUs each
        (FOUR_ON_TWO_HOSTS, 4, 4),  # devices="auto": every visible GPU
        (UNEVEN, 1, 1),  # "auto" with ranks spread unevenly
    ],
)
def test_devices_that_agree_with_mpi_or_auto_pass(layout, count, auto):
    check_devices_flag(count, auto, layout)


def test_devices_that_contradict_mpi_name_the_flag_what_mpi_gave_and_the_fix():
    with pytest.raises(ValueError) as error:
        check_devices_flag(4, 1, TWO_RANKS)
    message = str(error.value)
    assert "`devices=4`" in message and "MPI started 2 ranks on 1 node (2 on this host)" in message
    assert "mpiexec -n" in message and "`devices=2`" in message
    with pytest.raises(ValueError, match="spread unevenly over the nodes"):
        check_devices_flag(2, 1, UNEVEN)  # every rank decides alike: 2 x 2 nodes is not 3 ranks


@pytest.mark.parametrize("num_nodes, layout", [(1, TWO_RANKS), (1, FOUR_ON_TWO_HOSTS), (2, FOUR_ON_TWO_HOSTS)])
def test_num_nodes_of_one_or_mpis_count_pass(num_nodes, layout):
    check_num_nodes_flag(num_nodes, layout)


def test_num_nodes_that_contradict_mpi_name_the_flag_and_the_fix():
    with pytest.raises(ValueError, match=r"`num_nodes=3`.*MPI started 4 ranks on 2 nodes.*`num_nodes=2`"):
        check_num_nodes_flag(3, FOUR_ON_TWO_HOSTS)


def test_each_local_rank_keeps_its_device():
    devices = devices_of_local_ranks(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 2)
    assert devices == ["cuda:0", "cuda:1"] and isinstance(devices, RankDevices)
    assert devices_of_local_ranks(["cuda:0", "cuda:1"], 4) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert devices_of_local_ranks(["cpu"], 2) == ["cpu", "cpu"]


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"])
def test_world_size_one_refuses_devices_4_and_num_nodes_2_and_reports_the_truth(package):
    import importlib

    frontend = importlib.import_module(package)
    make = frontend.Trainer if hasattr(frontend, "Trainer") else frontend.Fabric
    with pytest.raises(ValueError, match=r"`devices=4`.*MPI started 1 rank on 1 node"):
        make(strategy="mpi_asa16", accelerator="cpu", devices=4)
    with pytest.raises(ValueError, match=r"`num_nodes=2`.*`num_nodes=1`"):
        make(strategy="mpi_asa16", accelerator="cpu", num_nodes=2)
    made = make(strategy="mpi_asa16", accelerator="cpu", devices=1, num_nodes=1)
    strategy = made.strategy
    assert len(strategy.parallel_devices) == 1 and strategy.num_nodes == 1
    if hasattr(made, "num_devices"):
        assert made.num_devices == 1 and made.num_nodes == 1
