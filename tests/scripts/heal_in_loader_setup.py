"""A rank lost while Lightning sets the training loader up (tests/strategies/test_heal.py).

Usage: ``lightning-mpi --heal -n 3 heal_in_loader_setup.py OUT_DIR``. ``Trainer.fit`` on
``SyncStrategy(heal="shrink")``, 3 epochs of 60 samples in batches of 4, the training loader built
anew every epoch (``reload_dataloaders_every_n_epochs=1``). At the start of epoch 1, rank 2 passes the
loader's barrier and dies when Lightning reads the length of the loader it sharded: the survivors
find the loss in the reduce of the lengths that comes next, with the loader already sharded over 3
and handed to Lightning. Every training step is recorded in
``OUT_DIR/steps.<rank>.jsonl`` (epoch, world size, sample indices); every rank that ends writes
``OUT_DIR/end.<rank>.json`` (its weights, world size, step, heal history).
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mpi.lightning import SyncStrategy

N, B, EPOCHS, DIES = 60, 4, 3, 2
out = Path(sys.argv[1])
launch_rank = MPI.COMM_WORLD.Get_rank()
epochs_ended = 0


class Indexed(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Loader(DataLoader):
    """Lightning reads a loader's length after its barrier and after sharding it, just before the
    reduce of the lengths: rank DIES dies there at epoch 1."""

    def __len__(self) -> int:
        if epochs_ended == 1 and launch_rank == DIES:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__len__()


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        entry = {"epoch": self.current_epoch, "world": self.trainer.world_size, "indices": index.tolist()}
        with open(out / f"steps.{launch_rank}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_end(self):
        global epochs_ended
        epochs_ended += 1

    def train_dataloader(self):
        return Loader(Indexed(), batch_size=B, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


strategy = SyncStrategy(heal="shrink")
trainer = L.Trainer(
    strategy=strategy,
    accelerator="cpu",
    max_epochs=EPOCHS,
    reload_dataloaders_every_n_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Net()
trainer.fit(model)
end = {
    "weights": [p.detach().double().flatten().tolist() for p in model.parameters()],
    "world_size": trainer.world_size,
    "global_step": trainer.global_step,
    "history": strategy._core.healing.history,
}
(out / f"end.{launch_rank}.json").write_text(json.dumps(end))
