"""Bad input on W ranks: each case must end in a clear error or a documented safe behaviour.

Usage: ``mpiexec -n W python tests/scripts/edge_cases.py OUT.json CASE[,CASE...]``. Rank 0 writes
``{"world_size": W, "cases": {CASE: [per-rank result, ...]}}`` to ``OUT.json``. Several cases run in
one launch because each launch costs 10-20 s of imports on a loaded 2-core machine.

Cases (the test, ``tests/strategies/test_reliability.py``, holds the expectations):

- ``frozen``: a frozen layer (``requires_grad=False``) between trainable ones; ranks start from
  different random weights. Frozen weights must end equal to rank 0's initial ones on every rank,
  trainable ones identical across ranks.
- ``unused``: a branch used only on the last rank on even batches, and a layer every rank uses
  only on every third batch, under overlapped (gradient-hook) exchanges. Records every rank's local
  gradients (``on_after_backward``) and the exchanged ones (``on_before_optimizer_step``), so the
  test can check that a missing gradient counts as zero in the average.
- ``nan``: the last rank's loss is NaN on batch 2, for synchronous and local-step rules.
- ``nan_commit``: the last rank's weights turn NaN after batch 3 (as if its optimizer had
  overflowed) under parameter-server rules: that worker's commit must be dropped, not added.
- ``empty``: an empty training set, with a plain DataLoader and with ``PrefetchDataModule``.
- ``tiny``: one training sample for W ranks, with a plain DataLoader and with ``PrefetchDataModule``.
"""
from __future__ import annotations

import json
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
LAST = W - 1


# -- helpers -----------------------------------------------------------------------------------------
def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.cat([x[:, :1] - x[:, 1:2], x[:, 2:3] * 0.5], dim=1))


def make_strategy(spec: object) -> object:
    if spec == "sync_tiny_buckets":  # every parameter in its own bucket: each one launched on its own
        return lightning_mpi.SyncStrategy(exchange="asa", bucket_mb=1e-5)
    if spec == "sync_one_bucket":  # every parameter in one bucket
        return lightning_mpi.SyncStrategy(exchange="allreduce")
    return spec


def fit(module: pl.LightningModule, strategy: object, train=None, datamodule=None, max_epochs: int = 1,
        callbacks: list | None = None) -> tuple[pl.Trainer, list[str]]:
    """Fit quietly; return the trainer and the RuntimeWarnings raised on this rank."""
    trainer = pl.Trainer(strategy=make_strategy(strategy), max_epochs=max_epochs, num_sanity_val_steps=0,
                         callbacks=callbacks or [], **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=train, datamodule=datamodule)
    return trainer, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def rule_counts(trainer: pl.Trainer) -> dict[str, float]:
    stats = trainer.strategy.bound_rule.stats() if trainer.strategy.bound_rule is not None else {}
    bound = trainer.strategy.bound_rule
    counts = {k: stats[k] for k in ("skipped_steps", "skipped_commits", "commits") if k in stats}
    if bound is not None and hasattr(bound, "skipped_steps"):  # synchronous rules keep a counter
        counts["skipped_steps"] = float(bound.skipped_steps)
    return counts


class CenterProbe(pl.Callback):
    """Reads the parameter server's center right after the strategy's ``on_train_end`` (every rank's
    last commit has landed) and before teardown frees the windows. Callbacks' ``on_train_end`` runs
    before the strategy's, so it wraps the rule's hook."""

    def __init__(self) -> None:
        self.center: list[float] | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        bound = trainer.strategy.bound_rule
        if getattr(bound, "center", None) is None or not hasattr(bound.center, "read"):  # not a ShardedVector
            return
        original = bound.on_train_end

        def wrapped() -> None:
            original()
            self.center = bound.center.read(torch.empty_like(bound.ref))[: bound.numel].tolist()

        bound.on_train_end = wrapped


class Net(pl.LightningModule):
    """4 → 8 → 2 MLP trained with plain SGD (so a zero gradient leaves a weight unchanged)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

    def training_step(self, batch, i):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


# -- cases -------------------------------------------------------------------------------------------
class Frozen(Net):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.frozen(torch.tanh(self.body(x))))), y)


def case_frozen(strategy: str) -> dict:
    module = Frozen(seed=RANK)  # ranks start apart: the strategy must broadcast rank 0's weights

    def trainable() -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in module.parameters() if p.requires_grad])

    frozen0 = COMM.bcast(flat(module.frozen).clone(), root=0)
    trainable0 = COMM.bcast(trainable().clone(), root=0)
    trainer, _ = fit(module, strategy, DataLoader(data(16 * W), batch_size=4))
    return {
        "frozen_equals_rank0_initial": bool(torch.equal(flat(module.frozen), frozen0)),
        "frozen_requires_grad": any(p.requires_grad for p in module.frozen.parameters()),
        "trainable": trainable().tolist(),
        "trainable_moved": float((trainable() - trainable0).abs().max()),
        "global_step": trainer.global_step,
    }


class Unused(Net):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.last_rank_branch = nn.Linear(8, 2)  # only the last rank, only on even batches
        self.sometimes = nn.Linear(4, 2)  # every rank, only on batches divisible by 3
        self.local: list[dict[str, list[float] | None]] = []
        self.averaged: list[dict[str, list[float]]] = []

    def training_step(self, batch, i):
        x, y = batch
        h = torch.tanh(self.body(x))
        out = self.head(h)
        if RANK == LAST and i % 2 == 0:
            out = out + self.last_rank_branch(h)
        if i % 3 == 0:
            out = out + self.sometimes(x)
        return nn.functional.mse_loss(out, y)

    def on_after_backward(self) -> None:  # inside the closure: gradients are still this rank's own
        self.local.append({n: (p.grad.flatten().tolist() if p.grad is not None else None) for n, p in self.named_parameters()})

    def on_before_optimizer_step(self, optimizer) -> None:  # after the exchange
        self.averaged.append({n: (p.grad.flatten().tolist() if p.grad is not None else None) for n, p in self.named_parameters()})


def case_unused(strategy: str) -> dict:
    module = Unused(seed=RANK)
    trainer, _ = fit(module, strategy, DataLoader(data(24 * W), batch_size=4))  # 6 batches per rank
    return {"local": module.local, "averaged": module.averaged, "weights": flat(module).tolist(),
            "global_step": trainer.global_step, "sizes": {n: p.numel() for n, p in module.named_parameters()},
            "hook_launches": trainer.strategy.bound_rule.hook_launches}


class NaNLoss(Net):
    def training_step(self, batch, i):
        loss = self.loss(batch)
        if RANK == LAST and i == 2:
            loss = loss * float("nan")
        return loss


def case_nan(strategy: str) -> dict:
    module = NaNLoss(seed=RANK)
    probe = CenterProbe()
    trainer, warned = fit(module, strategy, DataLoader(data(64 * W), batch_size=4), callbacks=[probe])
    weights = flat(module)
    return {"weights": weights.tolist(), "finite": bool(torch.isfinite(weights).all()),
            "center": probe.center, "global_step": trainer.global_step, **rule_counts(trainer),
            "warnings": [w for w in warned if "non-finite" in w or "inf/NaN" in w]}


class PoisonWeights(pl.Callback):
    """After batch 3 the last rank's weights become NaN, as if its optimizer had overflowed."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i) -> None:
        if RANK == LAST and i == 3:
            with torch.no_grad():
                pl_module.body.weight.fill_(float("nan"))


def case_nan_commit(strategy: str) -> dict:
    module = Net(seed=RANK)
    probe = CenterProbe()
    trainer, warned = fit(module, strategy, DataLoader(data(64 * W), batch_size=4), callbacks=[PoisonWeights(), probe])
    weights = flat(module)
    return {"weights": weights.tolist(), "finite": bool(torch.isfinite(weights).all()), "center": probe.center,
            "global_step": trainer.global_step, **rule_counts(trainer),
            "warnings": [w for w in warned if "inf/NaN" in w or "non-finite" in w]}


def _datamodule_or_error(dataset, **kwargs) -> tuple[object, str | None]:
    try:
        return lightning_mpi.PrefetchDataModule(dataset, batch_size=2, **kwargs), None
    except ValueError as exc:
        return None, str(exc)


class MaskedNet(Net):
    """Trains on PrefetchDataModule's ``(batch, valid)``: padded repeats get weight 0."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.valid_seen: list[list[bool]] = []

    def training_step(self, batch, i):
        (x, y), valid = batch
        self.valid_seen.append(valid.tolist())
        per_sample = ((self.head(torch.tanh(self.body(x))) - y) ** 2).mean(dim=1)
        return (per_sample * valid).sum() / valid.sum().clamp(min=1)


def case_empty(strategy: str) -> dict:
    module = Net(seed=RANK)
    start = COMM.bcast(flat(module), root=0)
    trainer, _ = fit(module, strategy, DataLoader(data(0), batch_size=2), max_epochs=2)
    dm, error = _datamodule_or_error(data(0))
    return {"loader_global_step": trainer.global_step, "loader_weights_unchanged": bool(torch.equal(flat(module), start)),
            "datamodule_error": error}


def case_tiny(strategy: str) -> dict:
    module = Net(seed=RANK)
    trainer, _ = fit(module, strategy, DataLoader(data(1), batch_size=2), max_epochs=2)
    loader_weights = flat(module)
    dm, error = _datamodule_or_error(data(1), return_mask=True)
    masked = MaskedNet(seed=RANK)
    dm_trainer, _ = fit(masked, strategy, datamodule=dm, max_epochs=2)
    return {"loader_global_step": trainer.global_step, "loader_weights": loader_weights.tolist(),
            "loader_finite": bool(torch.isfinite(loader_weights).all()), "datamodule_error": error,
            "dm_global_step": dm_trainer.global_step, "dm_valid": masked.valid_seen,
            "dm_weights": flat(masked).tolist(), "dm_finite": bool(torch.isfinite(flat(masked)).all())}


CASES = {"frozen": case_frozen, "unused": case_unused, "nan": case_nan, "nan_commit": case_nan_commit,
         "empty": case_empty, "tiny": case_tiny}


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2].split(",")
    results: dict[str, list] = {}
    for spec in specs:  # "case/strategy"
        case, strategy = spec.split("/", 1)
        mine = CASES[case](strategy)
        results[spec] = COMM.gather(mine, root=0)
    if RANK == 0:
        with open(out, "w") as f:
            json.dump({"world_size": W, "cases": results}, f)


if __name__ == "__main__":
    main()
