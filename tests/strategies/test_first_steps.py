"""What a new user's first script meets on 2 ranks (issue 27), in one ``mpiexec -n 2`` launch
(``tests/scripts/first_steps.py``):

- item 2: ``devices=``/``num_nodes=`` that contradict MPI are refused on every rank, naming the flag,
  what MPI started and the fix; unset, ``"auto"`` and agreeing values pass, and
  ``trainer.num_devices``/``num_nodes`` report what MPI started; Fabric alike;
- item 5: ``trainer.test``/``validate`` warn, on rank 0 only, as Lightning's ``ddp`` does when a
  ``DistributedSampler`` may evaluate samples twice, and when a custom batch sampler loses batches;
- item 6: before any Trainer exists, "No seed found" prints once and "Seed set to 0" once per rank,
  labelled ``[rank: r]``.
"""

import inspect
import json

import pytest

from lightning_mpi.strategies.uneven_evaluation import repeated_samples_message
from tests.mpi_utils import REPO, run_mpi

SCRIPT = str(REPO / "tests" / "scripts" / "first_steps.py")
AGREEING = ["unset", "devices=auto", "devices=2", "devices=1", "num_nodes=1", "fabric unset"]


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("first_steps") / "out.json"
    # warnings on, as for a user: "No seed found" is a warning
    result = run_mpi(2, [SCRIPT, str(out)], timeout=240, env={"PYTHONWARNINGS": "default"}, cwd=out.parent)
    return json.loads(out.read_text()), result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_devices_and_num_nodes_that_agree_report_what_mpi_started(first_steps):
    flags = first_steps[0]["flags"]
    for case in AGREEING:
        assert flags[case] == {"num_devices": 2, "num_nodes": 1, "world_size": 2}, (case, flags[case])
    assert first_steps[0]["flags_agree"]  # both ranks saw the same outcome for every case


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case, flag, fix",
    [
        ("devices=4", "`devices=4`", "`devices=2`"),
        ("instance devices=4", "`devices=4`", "`devices=2`"),
        ("fabric devices=4", "`devices=4`", "`devices=2`"),
        ("num_nodes=3", "`num_nodes=3`", "`num_nodes=1`"),
        ("fabric num_nodes=3", "`num_nodes=3`", "`num_nodes=1`"),
    ],
)
def test_devices_and_num_nodes_that_contradict_mpi_are_refused(first_steps, case, flag, fix):
    error = first_steps[0]["flags"][case]["error"]
    assert flag in error and "MPI started 2 ranks on 1 node" in error and fix in error and "mpiexec -n" in error


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case, seen, extra",
    [
        ("test 301", 302, "Here 301 samples are padded to 302 for 2 ranks: 1 of them is evaluated twice."),
        ("validate 301", 302, "1 of them is evaluated twice."),
        ("test 300", 300, None),  # Lightning warns whenever it shards an evaluation over ranks; so do we
    ],
)
def test_evaluation_on_several_ranks_warns_as_ddp_does(first_steps, case, seen, extra):
    result = first_steps[0]["evaluation"][case]
    assert result["seen"] == seen
    rank0, rank1 = result["warnings"]
    assert len(rank0) == 1 and rank1 == [], result["warnings"]
    fn = case.split()[0]
    assert rank0[0].startswith(f"Using `DistributedSampler` with the dataloaders. During `trainer.{fn}()`, it is")
    assert "`mpiexec -n 1`" in rank0[0]
    assert (extra in rank0[0]) if extra else rank0[0].endswith("in case of uneven inputs.")
    assert result["categories"] == ["PossibleUserWarning"]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_custom_batch_sampler_that_drops_batches_in_test_warns(first_steps):
    result = first_steps[0]["evaluation"]["test custom batches"]
    assert result["seen"] == 12  # 5 batches of 3 dealt to 2 ranks: the fifth is left out
    assert result["warnings"][1] == []
    assert "the last 1 of the 5 batches is not evaluated" in result["warnings"][0][0]


def test_the_warning_keeps_lightnings_text():
    # Only the remedy differs: Trainer(devices=1, num_nodes=1) does not change the number of MPI ranks.
    from pytorch_lightning.trainer.connectors.data_connector import _DataConnector

    lightning_source = " ".join(inspect.getsource(_DataConnector._resolve_sampler).replace('"', "").split())
    ours = repeated_samples_message(301, 302, 2, "test")
    before, after = ours.split(" it is recommended to run on one rank (`mpiexec -n 1`, or plain `python`) ")
    assert (
        "Using `DistributedSampler` with the dataloaders. During `trainer.{trainer_fn.value}()`, it is"
        in lightning_source
    )
    lightning_after = (
        "to ensure each sample/batch gets evaluated exactly once. Otherwise, multi-device settings use "
        "`DistributedSampler` that replicates some samples to make sure all devices have same batch size in case of "
        "uneven inputs."
    )
    assert lightning_after in " ".join(lightning_source.split())
    assert after.startswith(lightning_after)
    assert (
        repeated_samples_message(301, 302, 2, "fit") is None and repeated_samples_message(301, 301, 1, "test") is None
    )


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_messages_before_the_trainer_print_once_or_labelled_by_rank(first_steps):
    output = first_steps[1]
    assert output.count("No seed found") == 1, output[-3000:]
    seeds = [line for line in output.splitlines() if "Seed set to 0" in line and "No seed" not in line]
    assert sorted(seeds) == ["[rank: 0] Seed set to 0", "[rank: 1] Seed set to 0"], seeds
