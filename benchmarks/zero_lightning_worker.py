"""One Lightning arm of ``benchmarks/zero.py`` on every rank of an ``mpiexec`` job: ``Trainer.fit``
of an MLP with Adam; memory, speed and, optionally, the time of ``trainer.save_checkpoint`` and of
loading it back. Rank 0 writes ``--out``.

Arms (what a Lightning user would pick):

- ``L_ddp``: ``DDPStrategy(process_group_backend="gloo")`` and the full Adam;
- ``L_ddp_zero``: the same with torch's ``ZeroRedundancyOptimizer(Adam)`` from ``configure_optimizers``
  (Lightning's rank-0 save consolidates it onto rank 0 first);
- ``L_mpi_asa``, ``L_mpi_zero``, ``L_mpi_zero_bf16``: the registered strategies, the full Adam
  (``mpi_zero*`` rebuild it over the rank's shard).

Steps ``--warmup`` .. end are timed on rank 0 from a barrier before the first to a barrier after the
last. Memory is the process's RSS once the module is built (``rss_model``) and the kernel's peak
(``ru_maxrss``) at the end of training, before any checkpoint. The optimizer state is counted from
the optimizer the Trainer steps (its shard's for the sharded ones). Checkpoint times (save, then
load: ``strategy.load_checkpoint`` + model and optimizer state) are taken at the end of training,
from a barrier to a barrier, ``--checkpoint-repeats`` times (median).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pytorch_lightning as pl  # noqa: E402

import lightning_mpi  # noqa: E402,F401  (registers the names)
from benchmarks.zero_worker import mlp, parse_worker_args, peak_mib, rss_mib, state_bytes, timed  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
ARMS = ("L_ddp", "L_ddp_zero", "L_mpi_asa", "L_mpi_zero", "L_mpi_zero_bf16")


class Module(pl.LightningModule):
    def __init__(self, width: int, depth: int, zero_redundancy: bool) -> None:
        super().__init__()
        self.net = mlp(width, depth)
        self.zero_redundancy = zero_redundancy

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Measure(pl.Callback):
    """Times the steps from ``warmup`` on; at the end of training, memory and checkpoint times."""

    def __init__(self, warmup: int, checkpoint_dir: Path | None, repeats: int) -> None:
        self.warmup, self.checkpoint_dir, self.repeats = warmup, checkpoint_dir, repeats
        self.begin = self.end = 0.0
        self.steps = 0
        self.result: dict = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.warmup:
            COMM.Barrier()
            self.begin = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.steps += 1

    def on_train_end(self, trainer, module):
        COMM.Barrier()
        self.end = time.perf_counter()
        optimizer = trainer.optimizers[0]
        self.result = {"peak_rss_mib": COMM.allgather(peak_mib()),
                       "optimizer_state_mib": COMM.allgather(state_bytes(optimizer) / 2**20)}
        if self.checkpoint_dir is not None:
            self.result["checkpoint_seconds"] = checkpoint_times(trainer, self.checkpoint_dir, self.repeats)


def checkpoint_times(trainer: pl.Trainer, directory: Path, repeats: int) -> dict:
    strategy = trainer.strategy

    def load(path: Path) -> None:
        checkpoint = strategy.load_checkpoint(path)
        strategy.load_model_state_dict(checkpoint)
        strategy.load_optimizer_state_dict(checkpoint)

    times: dict[str, list[float]] = {"save": [], "load": []}
    for i in range(repeats):
        path = directory / f"c{i}.ckpt"
        times["save"].append(timed(partial(trainer.save_checkpoint, path)))
        times["load"].append(timed(partial(load, path)))
    size = 0
    if RANK == 0:
        path = directory / "c0.ckpt"
        size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
    return {**{k: statistics.median(v) for k, v in times.items()}, "bytes": size}


def trainer_kwargs(arm: str) -> dict:
    if arm.startswith("L_ddp"):
        from benchmarks.ddp_peers import trainer_kwargs as ddp_kwargs

        return ddp_kwargs("ddp")
    return {"strategy": arm.removeprefix("L_")}


def main() -> None:
    args = parse_worker_args(ARMS, steps=10, checkpoint_repeats=2)
    torch.set_num_threads(1)
    module = Module(args.width, args.depth, zero_redundancy=args.arm == "L_ddp_zero")
    rss_model = rss_mib()
    g = torch.Generator().manual_seed(0)
    rows = W * args.batch * (args.warmup + args.steps)
    data = TensorDataset(torch.randn(rows, args.width, generator=g), torch.randint(0, 10, (rows,), generator=g))
    directory = Path(args.checkpoint_dir) / args.arm if args.checkpoint_dir else None
    if directory is not None and RANK == 0:
        directory.mkdir(parents=True, exist_ok=True)
    measure = Measure(args.warmup, directory, args.checkpoint_repeats)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[measure], **trainer_kwargs(args.arm))
    trainer.fit(module, DataLoader(data, batch_size=args.batch, shuffle=False))
    seconds = (measure.end - measure.begin) / max(measure.steps, 1)
    result = {"arm": args.arm, "world_size": W, "width": args.width, "depth": args.depth, "batch": args.batch,
              "params": sum(p.numel() for p in module.parameters()), "rss_model_mib": COMM.allgather(rss_model),
              "step_seconds": seconds, "samples_per_second": W * args.batch / seconds, **measure.result}
    if RANK == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
