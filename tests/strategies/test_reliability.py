"""Faults end the whole job promptly with the original traceback; checkpoints are atomic and
resumable; bad input gives a clear error or a documented safe behaviour, never a hang or a silent
wrong result.

Bad input (``tests/scripts/edge_cases.py``, every case in one 3-rank launch to save imports):
frozen parameters, parameters without a gradient on some ranks or steps (overlapped exchanges),
a NaN loss on one rank (synchronous, compressed and local-step rules), a worker whose weights turn
NaN under a parameter server, an empty training set and a one-sample training set. In process
(world size 1, no mpiexec): every registered strategy fits, and a model spread over two devices
is refused at bind time. Asynchronous worker death: a checkpoint written before a worker dies holds
exactly the center of that moment, and a new launch resumes from it.
"""
import json
import os
import threading
import time

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpi import AtomicCheckpointIO
import lightning_mpi
from lightning_mpi import STRATEGIES
from tests.mpi_utils import REPO, run_mpi

FAULTS = str(REPO / "tests" / "scripts" / "faults.py")
RESUME = str(REPO / "tests" / "scripts" / "resume.py")
EDGE = str(REPO / "tests" / "scripts" / "edge_cases.py")
EDGE_WORLD = 3
FROZEN = ["mpi_allreduce", "mpi_downpour", "mpi_gosgd"]
#: "sync_one_bucket": every parameter in one bucket; "sync_tiny_buckets": one bucket per parameter
UNUSED = {"sync_one_bucket": 1e-6, "sync_tiny_buckets": 1e-6, "mpi_asa_int8": 0.02}
NAN_SYNC = ["mpi_allreduce", "mpi_asa_int8"]
NAN_LOCAL = ["mpi_easgd", "mpi_model_avg", "mpi_downpour", "mpi_aeasgd", "mpi_gosgd"]
NAN_COMMIT = ["mpi_downpour", "mpi_aeasgd", "mpi_eamsgd"]
DATA = ["mpi_allreduce", "mpi_downpour"]
EDGE_SPECS = (
    [f"frozen/{n}" for n in FROZEN]
    + [f"unused/{n}" for n in UNUSED]
    + [f"nan/{n}" for n in NAN_SYNC + NAN_LOCAL]
    + [f"nan_commit/{n}" for n in NAN_COMMIT]
    + [f"empty/{n}" for n in DATA]
    + [f"tiny/{n}" for n in DATA]
)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode,evidence",
    [
        ("step", "RuntimeError: boom in training_step on rank 1"),
        ("loader", "KeyError: 'corrupt sample"),
        ("callback", "ValueError: callback failed on rank 2"),
        ("stuck", "waited more than 4 s"),
        ("model", "ranks built different models. First difference at tensor #0"),
        ("sigkill", None),
    ],
)
def test_a_failing_rank_ends_every_rank_quickly(mode, evidence):
    start = time.monotonic()
    result = run_mpi(3, [FAULTS, mode], timeout=90, check=False)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "finished normally" not in output
    if evidence is not None:
        assert evidence in output, output[-3000:]
    # Startup (imports on 3 oversubscribed ranks) is part of the elapsed time; the 30 s budget is for the end.
    assert elapsed < 90


def test_atomic_checkpoint_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "model.ckpt"
    io.save_checkpoint({"step": 1}, target)
    assert torch.load(target)["step"] == 1

    def broken_save(obj, handle, *args, **kwargs):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, target)
    monkeypatch.undo()
    assert torch.load(target)["step"] == 1  # the last good checkpoint survived
    assert os.listdir(tmp_path) == ["model.ckpt"]  # no temporary file left behind


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["mpi_asa16"])  # the resume path is the same for every synchronous rule
def test_resume_reaches_the_uninterrupted_weights(tmp_path, strategy):
    for mode in ("full", "first", "resume"):
        run_mpi(2, [RESUME, mode, str(tmp_path), strategy], timeout=120)
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resume.pt")
    first = torch.load(tmp_path / "first.pt")
    assert (full - first).abs().max() > 1e-3  # the second epoch really trained
    assert (full - resumed).abs().max() <= 1e-6


# -- bad input on 3 ranks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    out = tmp_path_factory.mktemp("edge") / "edge.json"
    run_mpi(EDGE_WORLD, [EDGE, str(out), ",".join(EDGE_SPECS)], timeout=280)
    return json.loads(out.read_text())["cases"]


def _identical(ranks, key="weights"):
    return all(r[key] == ranks[0][key] for r in ranks)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", FROZEN)
def test_frozen_parameters_keep_rank0s_values_and_trainable_ones_agree(edge, strategy):
    ranks = edge[f"frozen/{strategy}"]
    for r in ranks:
        # ranks started from different random weights: frozen ones are rank 0's, bitwise, untouched
        assert r["frozen_equals_rank0_initial"] and not r["frozen_requires_grad"]
        assert r["trainable_moved"] > 1e-3, "the trainable layers did not train"
        assert r["global_step"] == 4
    assert _identical(ranks, "trainable"), f"{strategy}: trainable weights differ between ranks"


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(UNUSED))
def test_a_missing_gradient_counts_as_zero_in_the_average(edge, strategy):
    ranks = edge[f"unused/{strategy}"]
    sizes = ranks[0]["sizes"]
    steps = len(ranks[0]["local"])
    assert steps == 6 and all(r["global_step"] == 6 for r in ranks)
    # the branch only the last rank uses on even batches; the layer every rank uses on batches 0, 3
    assert [r["local"][0]["last_rank_branch.weight"] is None for r in ranks] == [True] * (EDGE_WORLD - 1) + [False]
    assert all(r["local"][1]["sometimes.weight"] is None for r in ranks)
    worst = scale = 0.0
    for k in range(steps):
        for name, size in sizes.items():
            local = [torch.tensor(r["local"][k][name]) if r["local"][k][name] is not None else torch.zeros(size) for r in ranks]
            expected = sum(local) / EDGE_WORLD
            scale = max(scale, float(expected.abs().max()))
            for r in ranks:
                got = r["averaged"][k][name]
                assert got is not None, f"{strategy}: {name} has no gradient after the exchange at step {k}"
                worst = max(worst, float((torch.tensor(got) - expected).abs().max()))
    assert worst <= UNUSED[strategy] * max(1.0, scale), f"{strategy}: averaged gradients off by {worst}"
    assert _identical(ranks), f"{strategy}: ranks hold different weights"
    if strategy == "sync_tiny_buckets":
        # buckets went from the gradient hooks where every member had a gradient, from the step
        # otherwise: the last rank launches its branch's buckets from hooks, the others cannot
        assert 0 < ranks[0]["hook_launches"] < ranks[-1]["hook_launches"]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", NAN_SYNC + NAN_LOCAL)
def test_a_nan_loss_on_one_rank_never_reaches_the_weights(edge, strategy):
    ranks = edge[f"nan/{strategy}"]
    assert _identical(ranks), f"{strategy}: ranks hold different weights"
    for rank, r in enumerate(ranks):
        assert r["finite"] and r["global_step"] == 16
        if strategy in NAN_SYNC:  # the NaN reaches everybody through the exchange: all skip that step
            assert r["skipped_steps"] == 1 and len(r["warnings"]) == 1
        else:  # local steps: only the rank with the NaN skips its own update (no barrier)
            assert r["skipped_steps"] == (1 if rank == EDGE_WORLD - 1 else 0)
            assert len(r["warnings"]) == (1 if rank == EDGE_WORLD - 1 else 0)
        if r["center"] is not None:  # parameter server: the center is finite and is what every rank ends on
            assert torch.isfinite(torch.tensor(r["center"])).all()
            assert r["center"] == r["weights"]
            assert r["skipped_commits"] == 0


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", NAN_COMMIT)
def test_a_non_finite_commit_is_dropped_and_the_worker_restarts_from_the_center(edge, strategy):
    ranks = edge[f"nan_commit/{strategy}"]
    assert _identical(ranks)
    for rank, r in enumerate(ranks):
        poisoned = rank == EDGE_WORLD - 1
        assert r["finite"] and r["global_step"] == 16
        assert torch.isfinite(torch.tensor(r["center"])).all() and r["center"] == r["weights"]
        assert r["skipped_commits"] == (1 if poisoned else 0), r
        drops = [w for w in r["warnings"] if "commit holds inf/NaN" in w]
        assert len(drops) == (1 if poisoned else 0)
        if poisoned:  # the dropped commit is the only one it missed: restarted, it committed on schedule
            assert r["commits"] == ranks[0]["commits"] - 1


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", DATA)
def test_an_empty_dataset_trains_nothing_or_raises_a_clear_error(edge, strategy):
    for r in edge[f"empty/{strategy}"]:
        # plain DataLoader: Lightning stops fit before any step ("No training batches") on every rank
        assert r["loader_global_step"] == 0 and r["loader_weights_unchanged"]
        # PrefetchDataModule: a ValueError at construction, the same on every rank, before any MPI call
        assert r["datamodule_error"] == "PrefetchDataModule: train_dataset must hold at least 1 sample, got len(train_dataset) == 0"


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", DATA)
def test_a_dataset_smaller_than_the_world_size_pads_every_rank_to_one_batch(edge, strategy):
    ranks = edge[f"tiny/{strategy}"]
    for r in ranks:
        assert r["loader_global_step"] == 2 and r["loader_finite"]  # 1 batch per epoch, 2 epochs
        assert r["datamodule_error"] is None and r["dm_global_step"] == 2 and r["dm_finite"]
    assert _identical(ranks, "loader_weights") and _identical(ranks, "dm_weights")
    # the one sample is real on exactly one rank per epoch; the others hold a padded repeat
    for epoch in range(2):
        assert sum(v for r in ranks for v in r["dm_valid"][epoch]) == 1


# -- world size 1 and mixed devices, in process --------------------------------------------------------
class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_fits_at_world_size_one(name):
    module = _Tiny()
    before = torch.cat([p.detach().flatten() for p in module.parameters()]).clone()
    threads = threading.active_count()
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(strategy=name, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x, x[:, :2] * 2), batch_size=4))
    after = torch.cat([p.detach().flatten() for p in module.parameters()])
    assert trainer.world_size == 1 and trainer.global_step == 6
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-4
    assert threading.active_count() == threads, "a background thread outlived fit"


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_parameters_on_two_devices_are_refused_at_bind(name):
    from mpi4py import MPI

    from lightning_mpi.comm.transport import Transport

    class_name, init_params, _ = STRATEGIES[name]
    cls = getattr(lightning_mpi, class_name)
    rule = cls(**init_params).rule
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"2 devices \(cpu, meta\).*one device per rank.*materialise"):
        rule.bind(Transport(MPI.COMM_SELF), params)


# -- an asynchronous worker dies mid-run ------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_dying_async_worker_leaves_a_whole_checkpoint_that_resumes(tmp_path):
    strategy = "mpi_downpour"
    died = run_mpi(2, [FAULTS, "async_dies", str(tmp_path), strategy], timeout=110, check=False)
    output = died.stdout + died.stderr
    assert died.returncode != 0 and "RuntimeError: worker died on rank 1" in output, output[-3000:]
    assert "finished normally" not in output
    snapshot = torch.load(tmp_path / "snapshot.pt")
    at_death = torch.load(tmp_path / "at_death.pt")
    saved = torch.load(tmp_path / "k10.ckpt", weights_only=False)["lightning_mpi"]["state"]
    # the checkpoint holds exactly the center and clock of its moment: every commit whole, none torn
    assert torch.equal(saved["center"], snapshot["center"]) and saved["clock"] == snapshot["clock"] > 0
    assert torch.isfinite(saved["center"]).all()
    # training went on after the save: the worker died later, with more commits, on another center
    assert at_death["commits"] > snapshot["commits"] and not torch.equal(at_death["center"], saved["center"])
    run_mpi(2, [FAULTS, "async_resume", str(tmp_path), strategy], timeout=110)
    ranks = json.loads((tmp_path / "resume.json").read_text())
    for r in ranks:
        assert r["restored"] and r["global_step"] == 10 and r["final_step"] == 24
        assert torch.equal(torch.tensor(r["center"]), saved["center"]) and r["clock"] == saved["clock"]
        assert torch.isfinite(torch.tensor(r["weights"])).all()
    assert ranks[0]["weights"] == ranks[1]["weights"]
